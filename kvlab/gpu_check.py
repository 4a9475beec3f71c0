"""``kvlab gpu-check --out DIR``: the whole lab on one CUDA GPU, in one command, inside 8 minutes.

GPU time is lent in short loans, so the check is a fixed plan of steps, each with a time budget
that is also its limit, and the whole plan stops itself at a deadline (``--deadline-s``, 480 s by
default): a failed first run leaves room for a second. The steps, in the order they run:

| step                  | runs                                                            | writes into DIR          |
|-----------------------|-----------------------------------------------------------------|--------------------------|
| `environment`         | versions, device, ``kvlab.kernels.triton_mode()`` (must be "compiled") | `environment.json` |
| `bench-kernels`       | ``kvlab.bench.kernels.run`` (``kvlab bench kernels``) in a subprocess, every conversion variant it takes | `bench_kernels.json` |
| `bench-engine-triton` | ``kvlab bench engine --attn-backend triton --systems kvlab_continuous`` | `bench_engine_triton.json` |
| `bench-engine-torch`  | the same on the torch backend                                   | `bench_engine_torch.json` |
| `notebooks`           | every ``notebooks/*.ipynb`` top to bottom in its own Jupyter kernel (nbclient), ``--jobs`` at once | `notebooks/NN_name.ipynb` |
| `summary`             | one screen: machine, each step against its budget, each notebook, the kernels' speed-ups, the engine's tok/s | `summary.md`, `gpu_check.json` |

The benchmarks run first: they are short and their numbers are the check's point; the notebooks
are the long step and get what their budget leaves. A step that fails (an exception, a non-zero
exit, its time limit) is recorded with one line saying why, and the rest go on; a step the
deadline leaves no time for is recorded as ``not run (deadline)``. The summary is always written.
The benchmarks run in subprocesses, so a step that hangs is killed at its limit and a kernel
that breaks the CUDA context takes only its own step down.

Without Jupyter (no nbclient/nbformat, as on a bare GPU box that cannot reach PyPI) the notebook
step is recorded as skipped, saying so, and everything else runs.

``--dry-run`` rehearses the same plan on a CPU, through the same functions: every notebook parsed
(nbformat) and its kernel looked up, ONE small rehearsal notebook executed by the same executor
and written the same way, the kernel benchmark on its smallest settings, the engine benchmark on
the tiny model with two short requests (SmolLM2 under Triton's interpreter takes minutes), the
summary read from the files those wrote. ``tests/test_gpu_check.py`` runs it, so the first GPU
call is not where this module's bugs are found.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import shlex
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Callable

import torch

from kvlab import kernels
from kvlab.bench import kernels as kbench
from kvlab.env import cpu_name, lab_info
from kvlab.files import FileError, read_json, write_atomic
from kvlab.validate import check_int

from kvlab.kernels.convert import CONVERSIONS

#: the 8-minute goal on one H200 (the default deadline is the goal itself)
GOAL_S = 480.0
DEFAULT_DEADLINE_S = GOAL_S
DEFAULT_JOBS = 4
#: step names, in the order they run (``--only`` picks among them; the summary always runs)
STEP_NAMES = ("environment", "bench-kernels", "bench-engine-triton", "bench-engine-torch", "notebooks", "summary")
#: each step's budget in seconds: also its limit. They add up to 470 s, 10 s under the goal for start-up.
#: The kernel sweep took 42 s on an H200 with one conversion; every variant x 2 stage counts adds
#: about 20 timings and a compile each per point, hence 150 (estimates until a GPU run measures them).
BUDGETS = {"environment": 20, "bench-kernels": 150, "bench-engine-triton": 60, "bench-engine-torch": 40,
           "notebooks": 190, "summary": 10}
#: the model the engine benchmark serves: SmolLM2 on the GPU, the tiny random Llama in the dry run
GPU_MODEL, DRY_RUN_MODEL = "smollm2-135m", "tiny"
ENGINE_BACKENDS = ("triton", "torch")
NO_GPU = "no CUDA GPU here: run with --dry-run to rehearse the plan"
NOTEBOOK_TOOLS = ("nbformat", "nbclient")

OK, FAILED, SKIPPED = "ok", "failed", "skipped"
NOT_RUN_DEADLINE, NOT_RUN_ONLY = "not run (deadline)", "not run (--only)"
#: the statuses that make ``kvlab gpu-check`` exit with 1 (skipped and --only do not)
BAD_STATUSES = (FAILED, NOT_RUN_DEADLINE)

#: the notebook the dry run executes in place of the lab's: a set-up cell like theirs and one print
REHEARSAL_NAME = "dry_run_rehearsal"
REHEARSAL_CELLS = (
    "# NBVAL_IGNORE_OUTPUT\nimport kvlab\n\ninfo = kvlab.setup()",
    "from kvlab.kernels import triton_mode\n\nprint('rehearsal ok:', info.device, triton_mode())",
)


@dataclass
class Step:
    """One step of the plan: ``run(limit_s)`` does it within ``limit_s`` seconds and returns its record
    (a dict with at least ``status`` and ``detail``, a one-line reason where it is not ok). The
    summary's ``run`` is None: :func:`run_check` writes it last, whatever happened before."""
    name: str
    what: str  # what it runs, in words or as the command line
    budget_s: float
    output: str  # where its output goes, relative to DIR
    run: Callable[[float], dict] | None = field(repr=False)


# ---- argument checks ---------------------------------------------------------------------------------

def check_deadline(deadline_s) -> float:
    """``deadline_s`` as a float, or a ValueError naming it: a finite number of seconds >= 0."""
    if isinstance(deadline_s, bool) or not isinstance(deadline_s, (int, float)) or not 0 <= deadline_s < math.inf:
        raise ValueError(f"deadline_s must be a number of seconds >= 0 (and finite), got {deadline_s!r}")
    return float(deadline_s)


def check_only(only) -> tuple[str, ...] | None:
    """``only`` as a tuple of step names (None: every step), or a ValueError naming the unknown ones."""
    if only is None:
        return None
    if isinstance(only, str):
        only = [s for s in only.split(",") if s.strip()]
    only = tuple(str(s).strip() for s in only)
    unknown = [s for s in only if s not in STEP_NAMES]
    if unknown or not only:
        raise ValueError(f"only must name steps of {', '.join(STEP_NAMES)}, got {', '.join(unknown) or 'none'}")
    return only


def _one_line(e: BaseException) -> str:
    text = " ".join(str(e).split())
    return f"{type(e).__name__}: {text}" if text else type(e).__name__


def _tail(text: str, lines: int = 1) -> str:
    """The last non-empty lines of a process's output (where its error is), joined into one."""
    kept = [line.strip() for line in text.splitlines() if line.strip()]
    return " | ".join(kept[-lines:]) if kept else "(no output)"


# ---- the environment ---------------------------------------------------------------------------------

def environment(dry_run: bool) -> dict:
    """Versions, device, Triton mode; on the GPU run, a problem for each thing that would make the
    other steps measure the wrong thing (no CUDA device, no triton, the interpreter on)."""
    info = lab_info()
    cuda = torch.cuda.is_available()
    env = {**info.__dict__, "triton_mode": kernels.triton_mode(), "cuda_available": cuda,
           "cuda_version": torch.version.cuda, "cpu": cpu_name(), "cpu_count": os.cpu_count(),
           "python_executable": sys.executable}
    if cuda:
        props = torch.cuda.get_device_properties(0)
        env["gpu_memory_gib"] = props.total_memory / 2**30
        env["compute_capability"] = f"{props.major}.{props.minor}"
    problems = []
    if not dry_run:
        if not cuda:
            problems.append("torch sees no CUDA device")
        if not kernels.available():
            problems.append(f"no triton: {kernels.WHY_NO_TRITON}")
        elif env["triton_mode"] != "compiled":
            problems.append(f"kvlab.kernels.triton_mode() is {env['triton_mode']!r}, not 'compiled' "
                            "(TRITON_INTERPRET=1 is set): the kernels would run in the interpreter")
    env["problems"] = problems
    return env


def _environment_step(out: Path, dry_run: bool) -> Callable[[float], dict]:
    def run(limit_s: float) -> dict:
        env = environment(dry_run)
        write_atomic(out / "environment.json", json.dumps(env, indent=1), "environment file")
        return {"status": FAILED if env["problems"] else OK, "detail": "; ".join(env["problems"]),
                "environment": env}

    return run


# ---- subprocess steps (the benchmarks) ------------------------------------------------------------------

def _run_process(argv: list[str], limit_s: float, log: Path) -> tuple[int | None, str, str]:
    """Run ``argv`` for at most ``limit_s`` seconds (killed then): (exit status or None when killed,
    stdout, stderr); stderr also goes to ``log``."""
    try:
        r = subprocess.run(argv, capture_output=True, text=True, timeout=limit_s,
                           env={**os.environ, "PYTHONUNBUFFERED": "1"})
        rc, stdout, stderr = r.returncode, r.stdout, r.stderr
    except subprocess.TimeoutExpired as e:  # subprocess.run killed it
        rc = None
        stdout = e.stdout.decode(errors="replace") if isinstance(e.stdout, bytes) else (e.stdout or "")
        stderr = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else (e.stderr or "")
    write_atomic(log, f"$ {shlex.join(argv)}\n{stderr}", "log file")
    return rc, stdout, stderr


def _process_failure(rc: int | None, stderr: str, limit_s: float) -> dict | None:
    if rc is None:
        return {"status": FAILED, "detail": f"stopped at its time limit ({limit_s:.0f} s)"}
    if rc != 0:
        return {"status": FAILED, "detail": f"exit status {rc}: {_tail(stderr)}"}
    return None


#: the GPU sweep: both shapes, batch 1/8/32, a short and the longest context (the issue's 8 x 16K and
#: 32 x 16K among them); every conversion variant x 2 launch options per point must fit the step's budget
GPU_SWEEP = {"batches": [1, 8, 32], "contexts": [1024, 16384]}


def kernel_bench_kwargs(dry_run: bool, function: Callable | None = None) -> dict:
    """The keyword arguments the kernel step hands ``kvlab.bench.kernels.run``: :data:`GPU_SWEEP` on the
    GPU, its smallest settings in the dry run, and every conversion variant
    (:data:`kvlab.kernels.convert.CONVERSIONS`) either way. ``function``: whose signature is read
    (default ``kvlab.bench.kernels.run``); only the parameters it has are passed."""
    params = inspect.signature(function or kbench.run).parameters
    kwargs = {"shapes": ["smollm2-135m"], "batches": [1], "contexts": [16]} if dry_run else dict(GPU_SWEEP)
    kwargs["converts"] = list(CONVERSIONS)
    return {k: v for k, v in kwargs.items() if k in params}


def _kernel_step(out: Path, dry_run: bool) -> tuple[str, Callable[[float], dict]]:
    kwargs = kernel_bench_kwargs(dry_run)
    target = out / "bench_kernels.json"
    argv = [sys.executable, "-m", "kvlab.gpu_check", "bench-kernels", str(target), json.dumps(kwargs)]
    what = f"kvlab.bench.kernels.run({', '.join(f'{k}={v!r}' for k, v in kwargs.items())}) in a subprocess"

    def run(limit_s: float) -> dict:
        if target.exists():
            target.unlink()  # a file left by an earlier run must not pass for this one's
        rc, _, stderr = _run_process(argv, limit_s, out / "logs" / "bench-kernels.log")
        failure = _process_failure(rc, stderr, limit_s)
        if failure:
            return {**failure, "args": kwargs}
        res = read_json(target, "kernel benchmark result")
        bad = [c for c in res.get("checks", []) if not c.get("ok", False)]
        rec = {"status": FAILED if bad else OK, "args": kwargs, "mode": res.get("mode"),
               "detail": f"{len(bad)} of {len(res.get('checks', []))} correctness cases out of tolerance" if bad
               else ""}
        if not dry_run and res.get("mode") != "gpu":
            rec["status"], rec["detail"] = FAILED, f"the kernels ran in mode {res.get('mode')!r}, not 'gpu'"
        return rec

    return what, run


def engine_argv(backend: str, dry_run: bool, model: str) -> list[str]:
    """``kvlab bench engine`` on one attention backend, kvlab continuous only: 32 requests on the GPU,
    two short ones (and two seats) in the dry run."""
    argv = [sys.executable, "-m", "kvlab", "bench", "engine", "--model", model, "--attn-backend", backend,
            "--systems", "kvlab_continuous", "--num-requests", "2" if dry_run else "32", "--json"]
    if dry_run:
        argv[-1:-1] = ["--scale", "0.02", "--max-num-seqs", "2"]
    return argv


def _engine_step(out: Path, backend: str, dry_run: bool, model: str) -> tuple[str, Callable[[float], dict]]:
    argv = engine_argv(backend, dry_run, model)
    target = out / f"bench_engine_{backend}.json"

    def run(limit_s: float) -> dict:
        if target.exists():
            target.unlink()
        rc, stdout, stderr = _run_process(argv, limit_s, out / "logs" / f"bench-engine-{backend}.log")
        failure = _process_failure(rc, stderr, limit_s)
        if failure:
            return failure
        try:
            res = json.loads(stdout.strip().splitlines()[-1])
        except (ValueError, IndexError):
            return {"status": FAILED, "detail": f"no JSON on its stdout: {_tail(stdout)}"}
        write_atomic(target, json.dumps(res, indent=1), "engine benchmark result")
        row = res.get("systems", {}).get("kvlab_continuous", {})
        return {"status": OK, "detail": "", "output_tok_s": row.get("output_tok_s"), "device": res.get("device")}

    return "python -m " + shlex.join(["kvlab", *argv[3:]]), run


# ---- notebooks -----------------------------------------------------------------------------------------

def missing_notebook_tools() -> list[str]:
    """The packages the notebook step needs (:data:`NOTEBOOK_TOOLS`) that do not import here."""
    missing = []
    for name in NOTEBOOK_TOOLS:
        try:
            __import__(name)
        except ImportError:
            missing.append(name)
    return missing


def rehearsal_notebook():
    """The dry run's notebook: the lab's set-up cell and one print (:data:`REHEARSAL_CELLS`)."""
    import nbformat  # optional: Jupyter is not installed on every GPU box

    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in REHEARSAL_CELLS])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3 (ipykernel)", "language": "python"}
    return nb


def read_notebook(path: Path) -> tuple[object | None, dict]:
    """(the notebook, or None where it cannot run; its record): parsed and validated with nbformat,
    its kernel named in its metadata and installed here."""
    import nbformat  # optional: Jupyter is not installed on every GPU box
    from jupyter_client.kernelspec import find_kernel_specs  # optional: comes with nbclient

    rec = {"notebook": path.stem, "status": "parsed", "cell": None, "error": None, "seconds": None}
    try:
        nb = nbformat.read(path, as_version=4)
        nbformat.validate(nb)
    except Exception as e:  # nbformat's errors have no common base: unreadable, not JSON, not a notebook
        return None, {**rec, "status": FAILED, "error": f"not a valid notebook: {_one_line(e)}"}
    rec["kernel"] = nb.metadata.get("kernelspec", {}).get("name")
    rec["code_cells"] = sum(c.cell_type == "code" for c in nb.cells)
    if not rec["kernel"]:
        return None, {**rec, "status": FAILED, "error": "its metadata names no kernel (kernelspec.name)"}
    if rec["kernel"] not in find_kernel_specs():
        return None, {**rec, "status": FAILED,
                      "error": f"no Jupyter kernel {rec['kernel']!r} installed here (pip install ipykernel)"}
    return nb, rec


def execute_notebook(nb, out_path: Path, *, cwd: Path, stop_at: float, env: dict | None = None) -> dict:
    """Run ``nb`` top to bottom in a fresh Jupyter kernel (nbclient) in folder ``cwd``, and write it,
    executed (up to where it stopped), to ``out_path``.

    Every cell may run until ``stop_at`` (a ``time.monotonic()`` value): the notebook's time limit.
    Returns its record: status ``ok`` or ``failed``, seconds, and where it failed, ``cell`` (the index
    in the notebook's cells, from 0) and ``error`` (the exception's line, or the timeout)."""
    import nbclient  # optional: Jupyter is not installed on every GPU box
    import nbformat  # optional: likewise
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError  # optional: likewise

    rec = {"notebook": out_path.stem, "status": OK, "cell": None, "error": None, "seconds": 0.0,
           "output": f"notebooks/{out_path.name}"}
    if time.monotonic() >= stop_at:
        return {**rec, "status": NOT_RUN_DEADLINE, "output": None}
    current = {"cell": None}

    def on_cell_start(cell, cell_index):
        current["cell"] = cell_index

    client = nbclient.NotebookClient(
        nb, timeout_func=lambda cell: max(1, math.ceil(stop_at - time.monotonic())),
        kernel_name=nb.metadata.get("kernelspec", {}).get("name", "python3"),
        startup_timeout=max(1, min(60, math.ceil(stop_at - time.monotonic()))),
        resources={"metadata": {"path": str(cwd)}}, on_cell_start=on_cell_start)
    t0 = time.perf_counter()
    try:
        client.execute(**({"env": env} if env is not None else {}))  # env: the kernel's environment
    except CellExecutionError as e:
        first = (e.evalue or "").strip().splitlines()
        rec.update(status=FAILED, cell=current["cell"], error=f"{e.ename}: {first[0] if first else ''}".rstrip(": "))
    except CellTimeoutError:
        rec.update(status=FAILED, cell=current["cell"],
                   error=f"timeout: still running at the time limit ({time.perf_counter() - t0:.0f} s)")
    except DeadKernelError as e:
        rec.update(status=FAILED, cell=current["cell"], error=f"the kernel died (out of memory?): {_one_line(e)}")
    except Exception as e:  # the kernel did not start, a message was lost: recorded, the other notebooks go on
        rec.update(status=FAILED, cell=current["cell"], error=_one_line(e))
    rec["seconds"] = time.perf_counter() - t0
    write_atomic(out_path, nbformat.writes(nb), "executed notebook")
    return rec


def execute_notebooks(named: list[tuple[str, object]], folder: Path, *, cwd: Path, stop_at: float,
                      jobs: int = DEFAULT_JOBS) -> list[dict]:
    """:func:`execute_notebook` for each ``(name, notebook)``, ``jobs`` at once (each its own kernel, a
    process), into ``folder/name.ipynb``; a failure is recorded and the others go on. Each kernel gets
    ``cores / jobs`` threads unless ``OMP_NUM_THREADS`` is set. Records in the order given."""
    jobs = check_int("jobs", jobs)
    env = dict(os.environ)
    env.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // jobs)))
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        futures = [pool.submit(execute_notebook, nb, folder / f"{name}.ipynb", cwd=cwd, stop_at=stop_at, env=env)
                   for name, nb in named]
        return [f.result() for f in futures]


def notebooks_folder() -> Path:
    """The lab's notebooks: ``notebooks/`` beside the ``kvlab`` package in this checkout."""
    return Path(__file__).resolve().parent.parent / "notebooks"


def _notebook_step(out: Path, dry_run: bool, jobs: int, notebooks_dir: Path) -> Callable[[float], dict]:
    def run(limit_s: float) -> dict:
        stop_at = time.monotonic() + limit_s
        paths = sorted(notebooks_dir.glob("*.ipynb"))
        missing = missing_notebook_tools()
        if missing:
            return {"status": SKIPPED, "notebooks": [{"notebook": p.stem, "status": SKIPPED} for p in paths],
                    "detail": f"{' and '.join(missing)} not installed (pip install nbclient ipykernel): "
                              "no notebook was run"}
        if not paths:
            return {"status": FAILED, "detail": f"no notebooks in {str(notebooks_dir)!r}", "notebooks": []}
        parsed = [read_notebook(p) for p in paths]
        records = [rec for _, rec in parsed]
        if dry_run:  # the lab's notebooks take minutes each on a CPU: the executor runs the rehearsal one
            named = [(REHEARSAL_NAME, rehearsal_notebook())]
        else:
            named = [(rec["notebook"], nb) for nb, rec in parsed if nb is not None]
        done = {r["notebook"]: r for r in execute_notebooks(named, out / "notebooks", cwd=notebooks_dir,
                                                             stop_at=stop_at, jobs=jobs)}
        records = [{**rec, **done.get(rec["notebook"], {})} for rec in records]
        if dry_run:
            records.append({**done[REHEARSAL_NAME], "kernel": "python3"})
        bad = [r for r in records if r["status"] not in (OK, "parsed")]
        detail = "; ".join(f"{r['notebook']}: {r['status']}" + (f" ({r['error']})" if r.get("error") else "")
                           for r in bad)
        return {"status": FAILED if bad else OK, "detail": detail, "notebooks": records}

    return run


# ---- the plan ----------------------------------------------------------------------------------------------

def plan(out, dry_run: bool = False, jobs: int = DEFAULT_JOBS, model: str | None = None,
         notebooks_dir=None) -> list[Step]:
    """The steps of one check into folder ``out``, in order (:data:`STEP_NAMES`); the dry run has the
    same steps on the smallest settings. ``model``: the engine benchmark's (default SmolLM2 on the GPU,
    the tiny random Llama in the dry run)."""
    out = Path(out)
    jobs = check_int("jobs", jobs)
    model = model or (DRY_RUN_MODEL if dry_run else GPU_MODEL)
    notebooks_dir = Path(notebooks_dir) if notebooks_dir is not None else notebooks_folder()
    kernel_what, kernel_run = _kernel_step(out, dry_run)
    steps = [Step("environment", "kvlab.env.lab_info(), kvlab.kernels.triton_mode()"
                  + (" (recorded)" if dry_run else " (must be 'compiled')"),
                  BUDGETS["environment"], "environment.json", _environment_step(out, dry_run)),
             Step("bench-kernels", kernel_what, BUDGETS["bench-kernels"], "bench_kernels.json", kernel_run)]
    for backend in ENGINE_BACKENDS:
        what, run = _engine_step(out, backend, dry_run, model)
        steps.append(Step(f"bench-engine-{backend}", what, BUDGETS[f"bench-engine-{backend}"],
                          f"bench_engine_{backend}.json", run))
    nb_what = (f"nbclient, {jobs} at once: every notebook in {notebooks_dir.name}/ parsed and its kernel looked up, "
               + (f"then the rehearsal notebook executed ({REHEARSAL_NAME})" if dry_run else "then executed top to bottom"))
    steps.append(Step("notebooks", nb_what, BUDGETS["notebooks"], "notebooks/",
                      _notebook_step(out, dry_run, jobs, notebooks_dir)))
    steps.append(Step("summary", "read the files above; one screen", BUDGETS["summary"], "summary.md", None))
    assert tuple(s.name for s in steps) == STEP_NAMES
    return steps


def run_check(out, dry_run: bool = False, jobs: int = DEFAULT_JOBS, deadline_s: float = DEFAULT_DEADLINE_S,
              only=None, model: str | None = None, notebooks_dir=None, progress=None) -> dict:
    """Run the plan (:func:`plan`) into folder ``out`` and return the report (also ``out/gpu_check.json``;
    ``out/summary.md`` is the screen). Each step runs for at most its budget and what is left before the
    deadline (``deadline_s`` after the start); a step with no time left is ``not run (deadline)``, one
    not in ``only`` (step names) ``not run (--only)``. ``report["ok"]``: no step failed or went unrun.

    Without a CUDA GPU only the dry run runs: a ValueError (:data:`NO_GPU`) otherwise."""
    t_start, started = time.monotonic(), datetime.now(timezone.utc).isoformat(timespec="seconds")
    jobs = check_int("jobs", jobs)
    deadline_s = check_deadline(deadline_s)
    only = check_only(only)
    if not dry_run and not torch.cuda.is_available():
        raise ValueError(NO_GPU)
    out = Path(out)
    if out.exists() and not out.is_dir():
        raise FileError(f"cannot write the check into {str(out)!r}: it is a file, not a folder")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise FileError(f"cannot create the folder {str(out)!r}: {e.strerror or type(e).__name__}") from None
    say = progress or (lambda line: print(line, file=sys.stderr, flush=True))
    stop_at = t_start + deadline_s
    steps = plan(out, dry_run=dry_run, jobs=jobs, model=model, notebooks_dir=notebooks_dir)
    say(f"kvlab gpu-check{' --dry-run' if dry_run else ''}: {len(steps)} steps into {out}, deadline {deadline_s:.0f} s")
    records = []
    for step in steps[:-1]:  # the summary is written whatever happened
        base = {"name": step.name, "what": step.what, "budget_s": step.budget_s, "output": step.output}
        left = stop_at - time.monotonic()
        if only is not None and step.name not in only:
            rec = {**base, "status": NOT_RUN_ONLY, "detail": "", "seconds": 0.0}
        elif left <= 0:
            rec = {**base, "status": NOT_RUN_DEADLINE, "detail": "no time left before the deadline", "seconds": 0.0}
        else:
            limit = min(step.budget_s, left)
            say(f"  {step.name}: {step.what} (at most {limit:.0f} s) ...")
            t0 = time.monotonic()
            try:
                rec = {**base, **step.run(limit)}
            except Exception as e:  # a step's failure is recorded; the rest of the plan goes on
                rec = {**base, "status": FAILED, "detail": _one_line(e)}
            rec["seconds"] = time.monotonic() - t0
        say(f"  {step.name}: {rec['status']}" + (f": {rec['detail']}" if rec.get("detail") else "")
            + (f" ({rec['seconds']:.1f} s of {step.budget_s:.0f})" if rec["seconds"] else ""))
        records.append(rec)
    last = steps[-1]
    records.append({"name": last.name, "what": last.what, "budget_s": last.budget_s, "output": last.output,
                    "status": OK, "detail": "", "seconds": 0.0})
    report = {"dry_run": dry_run, "started": started,
              "deadline_s": deadline_s, "goal_s": GOAL_S, "jobs": jobs, "only": list(only) if only else None,
              "ok": not any(r["status"] in BAD_STATUSES for r in records), "steps": records}
    t0 = time.monotonic()
    report["total_s"] = t0 - t_start
    write_atomic(out / "summary.md", summary(report, out), "summary")
    records[-1]["seconds"] = time.monotonic() - t0
    report["total_s"] = time.monotonic() - t_start
    write_atomic(out / "gpu_check.json", json.dumps(report, indent=1, default=str), "report")
    say(f"kvlab gpu-check: {'ok' if report['ok'] else 'FAILED'} in {report['total_s']:.0f} s; {out / 'summary.md'}")
    return report


# ---- the summary ---------------------------------------------------------------------------------------------

def _fmt_s(seconds) -> str:
    return "-" if not seconds else f"{seconds:.1f} s" if seconds < 10 else f"{seconds:.0f} s"


def _section(title: str, build: Callable[[], list[str]]) -> list[str]:
    """A summary section; a file it reads that is not as expected is one line, not a crash."""
    try:
        body = build()
    except Exception as e:  # the summary is written whatever the files hold
        body = [f"(could not read it: {_one_line(e)})"]
    return [f"## {title}", "", *body, ""] if body else []


def _machine_lines(report: dict) -> list[str]:
    env = next((r.get("environment") for r in report["steps"] if r["name"] == "environment"), None)
    if not env:
        return ["(the environment step did not run)"]
    dev = env.get("device_name", "?")
    gpu = f", {env['gpu_memory_gib']:.0f} GiB, sm {env.get('compute_capability', '?')}" if env.get("gpu_memory_gib") else ""
    return [f"- device: {env.get('device', '?')} ({dev}{gpu}); CPU {env.get('cpu', '?')}",
            f"- torch {env.get('torch', '?')} (CUDA {env.get('cuda_version') or 'none'}), triton {env.get('triton', '?')} "
            f"({env.get('triton_mode', '?')}), transformers {env.get('transformers', '?')}, kvlab {env.get('kvlab', '?')}, "
            f"Python {env.get('python', '?')}"]


def _step_lines(report: dict) -> list[str]:
    lines = ["| step | status | time / budget | output |", "|---|---|---|---|"]
    for r in report["steps"]:
        status = r["status"] + (f": {r['detail']}" if r.get("detail") else "")
        over = " **over**" if r.get("seconds", 0) > r["budget_s"] else ""
        lines.append(f"| {r['name']} | {status} | {_fmt_s(r.get('seconds'))} / {r['budget_s']:.0f} s{over} "
                     f"| {r['output']} |")
    return lines


def _notebook_lines(report: dict) -> list[str]:
    step = next(r for r in report["steps"] if r["name"] == "notebooks")
    books = step.get("notebooks")
    if not books:
        return [f"(none: {step['status']}{': ' + step['detail'] if step.get('detail') else ''})"]
    lines = []
    for b in books:
        if b["status"] == "parsed":
            what = f"parsed, kernel {b.get('kernel')}, {b.get('code_cells', '?')} code cells (not executed: dry run)"
        elif b["status"] == OK:
            what = f"ok in {_fmt_s(b.get('seconds'))}"
        elif b.get("error"):
            where = f"cell {b['cell']}: " if b.get("cell") is not None else ""
            what = f"{b['status']} after {_fmt_s(b.get('seconds'))}: {where}{b['error']}"
        else:
            what = b["status"]
        lines.append(f"- {b['notebook']}: {what}")
    return lines


def _kernel_lines(out: Path) -> list[str]:
    path = out / "bench_kernels.json"
    if not path.exists():
        return ["(no bench_kernels.json)"]
    res = read_json(path, "kernel benchmark result")
    checks = res.get("checks") or []
    lines = [f"mode {res.get('mode', '?')} on {res.get('device', '?')}, triton {res.get('triton')}; correctness "
             f"{sum(bool(c.get('ok')) for c in checks)}/{len(checks)} cases ok"
             + (f"; copy bandwidth {res['copy_GBps']:.0f} GB/s" if isinstance(res.get("copy_GBps"), (int, float)) else "")]
    measured = res.get("measured") or []
    if not measured:
        return lines + ["no timings (no GPU): the projection only"]
    keys, via = [], []
    for row in measured:
        keys += [k for k in (row.get("speedup_vs_fp16") or {}) if k != "fp16" and k not in keys]
        via += [k for k in (row.get("best_convert") or {}) if k != "fp16" and k not in via]
    lines += ["", "speed-up over the FP16 kernel (x; > 1 is faster)"
              + (", and the conversion variant that won" if via else "") + ":", "",
              "| shape | batch | context | fp16 us | " + " | ".join(keys + [f"{k} via" for k in via]) + " |",
              "|---|---|---|---|" + "---|" * (len(keys) + len(via))]
    for row in measured:
        sp, us, best = row.get("speedup_vs_fp16") or {}, row.get("us") or {}, row.get("best_convert") or {}
        cells = [f"{sp[k]:.2f}" if isinstance(sp.get(k), (int, float)) else "-" for k in keys]
        cells += [str(best.get(k, "-")) for k in via]
        fp16 = f"{us['fp16']:.1f}" if isinstance(us.get("fp16"), (int, float)) else "-"
        lines.append(f"| {row.get('shape', '?')} | {row.get('batch', '?')} | {row.get('context', '?')} | {fp16} | "
                     + " | ".join(cells) + " |")
    return lines


def _engine_lines(out: Path) -> list[str]:
    lines, rates = [], {}
    for backend in ENGINE_BACKENDS:
        path = out / f"bench_engine_{backend}.json"
        if not path.exists():
            lines.append(f"- {backend}: (no {path.name})")
            continue
        res = read_json(path, "engine benchmark result")
        w = res.get("workload") or {}
        for name, r in (res.get("systems") or {}).items():
            rate, ttft, tpot = r.get("output_tok_s"), r.get("ttft_p50_s"), r.get("tpot_p50_s")
            rates[backend] = rate
            lines.append(f"- {backend}: {name} {rate:.1f} output tok/s" if isinstance(rate, (int, float))
                         else f"- {backend}: {name} (no tok/s)")
            lines[-1] += (f", TTFT p50 {ttft:.3f} s" if isinstance(ttft, (int, float)) else "") + (
                f", TPOT p50 {tpot * 1e3:.1f} ms" if isinstance(tpot, (int, float)) else "") + (
                f" ({w.get('requests', '?')} requests, {w.get('output_tokens_total', '?')} output tokens, "
                f"{res.get('device', '?')})")
    if all(isinstance(rates.get(b), (int, float)) and rates[b] > 0 for b in ENGINE_BACKENDS):
        lines.append(f"- triton / torch: {rates['triton'] / rates['torch']:.2f}x the throughput")
    return lines


def summary(report: dict, out) -> str:
    """The one-screen markdown of a check: machine and versions, every step's status and time against
    its budget, every notebook's time and error, the kernels' speed-ups over FP16, the engine's tok/s
    per backend, the total against the 8-minute goal. Reads the files the steps wrote, defensively."""
    out = Path(out)
    total, goal = report.get("total_s", 0.0), report.get("goal_s", GOAL_S)
    verdict = "all steps ok" if report.get("ok", True) else "SOME STEPS FAILED OR DID NOT RUN"
    lines = [f"# kvlab gpu-check{' (dry run: the plan rehearsed on a CPU)' if report['dry_run'] else ''}", "",
             f"{verdict}; total {total:.0f} s against the {goal:.0f} s goal ({goal / 60:.0f} minutes: "
             f"{'within it' if total <= goal else 'OVER it'}), deadline {report['deadline_s']:.0f} s, "
             f"{report['jobs']} notebooks at once; started {report['started']}", ""]
    lines += _section("machine", lambda: _machine_lines(report))
    lines += _section("steps", lambda: _step_lines(report))
    lines += _section("notebooks", lambda: _notebook_lines(report))
    lines += _section("kernels (bench_kernels.json)", lambda: _kernel_lines(out))
    lines += _section("engine (bench_engine_*.json)", lambda: _engine_lines(out))
    return "\n".join(lines).rstrip() + "\n"


# ---- the subprocess worker --------------------------------------------------------------------------------

def _worker(argv: list[str]) -> int:
    """``python -m kvlab.gpu_check bench-kernels OUT.json KWARGS_JSON``: the kernel step's subprocess
    (its own CUDA context; killed at the step's limit): ``kvlab.bench.kernels.run(**kwargs)`` -> OUT.json."""
    if len(argv) != 3 or argv[0] != "bench-kernels":
        print("usage: python -m kvlab.gpu_check bench-kernels OUT.json KWARGS_JSON", file=sys.stderr)
        return 2
    kwargs = json.loads(argv[2])
    res = kbench.run(**kwargs, progress=lambda m: print(m, file=sys.stderr, flush=True))
    write_atomic(argv[1], json.dumps(res, indent=1), "kernel benchmark result")
    return 0


if __name__ == "__main__":
    sys.exit(_worker(sys.argv[1:]))
