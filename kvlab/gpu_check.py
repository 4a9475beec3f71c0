"""``kvlab gpu-check --out DIR``: the lab's own commands on one CUDA GPU, each under a time limit, and
a summary an instructor can read (``DIR/summary.md``, also printed).

| step                  | command                                                                   | limit |
|-----------------------|---------------------------------------------------------------------------|-------|
| `environment`         | ``kvlab info`` (the Triton mode must be "compiled")                       |  30 s |
| `bench-kernels`       | ``kvlab bench kernels`` at b1/8/32 x 1K/16K, every conversion variant     | 150 s |
| `bench-engine-triton` | ``kvlab bench engine --attn-backend triton``, 32 requests, SmolLM2        |  60 s |
| `bench-engine-torch`  | the same on the torch backend                                             |  40 s |
| `notebooks`           | ``pytest notebooks --nbval-lax`` (nbval, as ``make test`` runs them)      | 190 s |

GPU time comes in short loans: the limits add up to under 8 minutes, so a failed first run leaves room
for a second (``--only STEP,STEP``). A failing step is recorded with its log's last line (logs in
``DIR/logs``) and the rest go on; ``--dry-run`` tries the plan on a CPU at the smallest settings.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from kvlab.kernels.convert import CONVERSIONS

GOAL_S = 480
DEFAULT_JOBS = 4
NO_GPU = "no CUDA GPU here: run with --dry-run to rehearse the plan"
STEP_NAMES = ("environment", "bench-kernels", "bench-engine-triton", "bench-engine-torch", "notebooks")
ROOT = Path(__file__).resolve().parent.parent  # the checkout: its notebooks/ are the ones checked
KVLAB = [sys.executable, "-m", "kvlab"]


@dataclass(frozen=True)
class Step:
    name: str
    argv: list[str]
    limit_s: int


def plan(out: Path, dry_run: bool = False, jobs: int = DEFAULT_JOBS) -> list[Step]:
    """The steps, in the order they run: the GPU sizes, or the smallest ones in the dry run."""
    sweep = (["--shapes", "smollm2-135m", "--batches", "1", "--contexts", "16"] if dry_run
             else ["--batches", "1", "8", "32", "--contexts", "1024", "16384"])
    engine = (["--model", "tiny", "--num-requests", "2", "--scale", "0.02", "--max-num-seqs", "2"] if dry_run
              else ["--model", "smollm2-135m", "--num-requests", "32"])
    nbval = [sys.executable, "-m", "pytest", "notebooks", "--nbval-lax", "--nbval-current-env", "-q",
             "-p", "no:cacheprovider", *(["--collect-only"] if dry_run else ["-n", str(jobs), "--dist", "loadfile"])]
    return [Step("environment", KVLAB + ["info"], 30),
            Step("bench-kernels", KVLAB + ["bench", "kernels", *sweep, "--converts", *CONVERSIONS,
                                           "--out", str(Path(out) / "bench_kernels.json")], 150),
            *(Step(f"bench-engine-{b}", KVLAB + ["bench", "engine", "--attn-backend", b, "--systems",
                                                 "kvlab_continuous", *engine], limit)
              for b, limit in (("triton", 60), ("torch", 40))),
            Step("notebooks", nbval, 190)]


def check_only(only) -> tuple[str, ...] | None:
    """``only`` as a tuple of step names (None: every step), or a ValueError naming the unknown ones."""
    if only is None:
        return None
    names = tuple(str(s).strip() for s in (only.split(",") if isinstance(only, str) else only) if str(s).strip())
    unknown = [s for s in names if s not in STEP_NAMES]
    if unknown or not names:
        raise ValueError(f"only must name steps of {', '.join(STEP_NAMES)}, got {', '.join(unknown) or 'none'}")
    return names


def run_step(step: Step, log: Path, dry_run: bool = False) -> dict:
    """Run one step with its output in ``log``; killed (with its children) at its limit."""
    t0, rc = time.perf_counter(), None
    env = {**os.environ, "TQDM_DISABLE": "1", "PYTHONUNBUFFERED": "1"}  # no progress bars; a killed step's last lines
    with open(log, "w", encoding="utf-8") as f:
        try:
            proc = subprocess.Popen(step.argv, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT, env=env,
                                    start_new_session=True)  # its own process group: killed whole at its limit
        except OSError as e:
            print(f"could not start: {e}", file=f)
            rc = -1
        else:
            try:
                rc = proc.wait(timeout=step.limit_s)
            except subprocess.TimeoutExpired:
                pass
            finally:  # its limit, or Ctrl-C here: nothing of the step keeps running
                if proc.poll() is None and hasattr(os, "killpg"):
                    os.killpg(proc.pid, signal.SIGKILL)
                elif proc.poll() is None:  # no process groups (Windows): the step itself
                    proc.kill()
                proc.wait()
    text = log.read_text(encoding="utf-8", errors="replace")
    last = next((line.strip() for line in reversed(text.splitlines()) if line.strip()), "")
    if rc is None:
        status, detail = "failed", f"stopped at its limit ({step.limit_s} s)"
    elif rc != 0:
        status, detail = "failed", f"exit status {rc}: {last}"
    elif step.name == "environment" and not dry_run and "compiled" not in text:
        status, detail = "failed", "Triton does not run compiled kernels here (its interpreter, or no triton)"
    else:
        status, detail = "ok", ""
    return {"name": step.name, "status": status, "detail": detail, "seconds": round(time.perf_counter() - t0, 1),
            "limit_s": step.limit_s, "command": " ".join(step.argv[2:] if step.argv[:2] == KVLAB[:2] else step.argv),
            "log": f"logs/{step.name}.log"}


def run_check(out, dry_run: bool = False, jobs: int = DEFAULT_JOBS, only=None, progress=print) -> dict:
    """Run the plan into folder ``out``; the report is also ``out/gpu_check.json`` and ``out/summary.md``."""
    if isinstance(jobs, bool) or not isinstance(jobs, int) or jobs < 1:
        raise ValueError(f"jobs must be a whole number >= 1, got {jobs!r}")
    only = check_only(only)
    out = Path(out).resolve()  # the steps run in the checkout: a relative --out means the caller's folder
    if out.exists() and not out.is_dir():
        raise ValueError(f"out: {out} is a file, not a folder")
    if not dry_run and not torch.cuda.is_available():
        raise ValueError(NO_GPU)
    (out / "logs").mkdir(parents=True, exist_ok=True)
    t0, steps = time.perf_counter(), []
    for step in plan(out, dry_run, jobs):
        if only and step.name not in only:
            continue
        progress(f"kvlab gpu-check: {step.name} (limit {step.limit_s} s) ...")
        steps.append(run_step(step, out / "logs" / f"{step.name}.log", dry_run))
    report = {"dry_run": dry_run, "ok": all(s["status"] == "ok" for s in steps),
              "total_s": round(time.perf_counter() - t0, 1), "goal_s": GOAL_S, "steps": steps}
    (out / "gpu_check.json").write_text(json.dumps(report, indent=1), encoding="utf-8")
    (out / "summary.md").write_text(summary(report, out), encoding="utf-8")
    return report


def summary(report: dict, out: Path, tail: int = 12) -> str:
    """Markdown: each step against its limit, then the last lines each command printed."""
    verdict = "all steps ok" if report["ok"] else "SOME STEPS FAILED"
    lines = [f"# kvlab gpu-check{' (dry run on a CPU)' if report['dry_run'] else ''}", "",
             f"{verdict}; {report['total_s']:.0f} s in all against the {report['goal_s']} s goal", "",
             "| step | status | seconds / limit | command |", "|---|---|---|---|"]
    for s in report["steps"]:
        status = s["status"] + (f": {s['detail']}" if s["detail"] else "")
        lines.append(f"| {s['name']} | {status} | {s['seconds']:.0f} / {s['limit_s']} | `{s['command']}` |")
    for s in report["steps"]:
        log = Path(out) / s["log"]
        printed = log.read_text(encoding="utf-8", errors="replace").rstrip().splitlines() if log.exists() else ["(no log)"]
        lines += ["", f"## {s['name']}", "", "```", *printed[-tail:], "```"]
    return "\n".join(lines) + "\n"
