"""``kvlab gpu-check``: the dry run of the GPU plan end to end on this CPU, so that the first GPU call is
not where its bugs are found; a failing notebook recorded while the others go on; the deadline; bad
input; the refusal without a GPU; a GPU box without Jupyter (the benchmarks still run)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import nbformat
import pytest
import torch

from kvlab import gpu_check as gc
from kvlab.bench import kernels as kbench
from kvlab.cli import main
from kvlab.kernels.convert import CONVERSIONS

ROOT = Path(__file__).resolve().parent.parent
NOTEBOOKS = sorted(p.stem for p in (ROOT / "notebooks").glob("*.ipynb"))


def _notebook(*sources: str):
    nb = nbformat.v4.new_notebook(cells=[nbformat.v4.new_code_cell(s) for s in sources])
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    return nb


@pytest.fixture(scope="module")
def dry_run(tmp_path_factory):
    """``kvlab gpu-check --out DIR --dry-run`` as a user types it: (process, DIR, wall seconds)."""
    out = tmp_path_factory.mktemp("gpu-check") / "out"
    t0 = time.perf_counter()
    r = subprocess.run([sys.executable, "-m", "kvlab", "gpu-check", "--out", str(out), "--dry-run"],
                       capture_output=True, text=True, timeout=600)
    return r, out, time.perf_counter() - t0


def test_dry_run_end_to_end(dry_run):
    r, out, seconds = dry_run
    assert r.returncode == 0, r.stderr[-3000:]
    for name in ("summary.md", "gpu_check.json", "environment.json", "bench_kernels.json", "bench_engine_triton.json",
                 "bench_engine_torch.json", f"notebooks/{gc.REHEARSAL_NAME}.ipynb", "logs/bench-kernels.log"):
        assert (out / name).is_file(), name
    report = json.loads((out / "gpu_check.json").read_text())
    assert [s["name"] for s in report["steps"]] == list(gc.STEP_NAMES)
    assert all(s["status"] == "ok" for s in report["steps"]), [(s["name"], s["status"], s["detail"]) for s in report["steps"]]
    assert report["ok"] and report["dry_run"] and report["total_s"] < 180
    assert seconds < 200  # the whole command, start-up included: the dry run stays a short test

    summary = (out / "summary.md").read_text()
    assert r.stdout == summary  # the screen is the file
    assert "could not read" not in summary and "(no bench" not in summary, summary
    for name in NOTEBOOKS + [gc.REHEARSAL_NAME] + list(gc.STEP_NAMES):
        assert name in summary, name
    assert summary.count("(not executed: dry run)") == len(NOTEBOOKS) == 8
    assert "480 s goal" in summary and "within it" in summary

    kernels = json.loads((out / "bench_kernels.json").read_text())
    assert kernels["mode"] == "interpreter" and kernels["checks"] and all(c["ok"] for c in kernels["checks"])
    kstep = next(s for s in report["steps"] if s["name"] == "bench-kernels")
    assert kstep["args"]["converts"] == list(CONVERSIONS)  # the variants went through
    for backend in gc.ENGINE_BACKENDS:
        engine = json.loads((out / f"bench_engine_{backend}.json").read_text())
        assert engine["systems"]["kvlab_continuous"]["output_tok_s"] > 0 and engine["workload"]["requests"] == 2
        assert f"- {backend}: kvlab_continuous" in summary

    executed = nbformat.read(out / "notebooks" / f"{gc.REHEARSAL_NAME}.ipynb", as_version=4)
    printed = "".join(o.get("text", "") for c in executed.cells for o in c.outputs)
    assert "rehearsal ok: cpu interpreter" in printed and "kvlab 0.1.0 | device cpu" in printed
    books = next(s for s in report["steps"] if s["name"] == "notebooks")["notebooks"]
    assert [b["notebook"] for b in books] == NOTEBOOKS + [gc.REHEARSAL_NAME]
    assert all(b["kernel"] == "python3" for b in books)


def test_the_gpu_plan_is_the_dry_runs_plan_at_full_size(tmp_path):
    dry, gpu = gc.plan(tmp_path, dry_run=True), gc.plan(tmp_path, dry_run=False)
    assert [(s.name, s.budget_s, s.output) for s in dry] == [(s.name, s.budget_s, s.output) for s in gpu]
    assert sum(s.budget_s for s in gpu) <= gc.GOAL_S - 5  # room for start-up inside the 8 minutes
    assert gc.kernel_bench_kwargs(dry_run=False) == {**gc.GPU_SWEEP, "converts": list(CONVERSIONS)}
    assert 16384 in gc.GPU_SWEEP["contexts"] and {8, 32} <= set(gc.GPU_SWEEP["batches"])  # the points
    argv = gc.engine_argv("triton", dry_run=False, model=gc.GPU_MODEL)
    assert argv[argv.index("--num-requests") + 1] == "32" and argv[argv.index("--systems") + 1] == "kvlab_continuous"
    assert "--scale" not in argv and argv[argv.index("--model") + 1] == "smollm2-135m"
    assert "(must be 'compiled')" in gpu[0].what


def test_only_the_parameters_the_benchmark_has_are_passed():
    def several(shapes=None, batches=(1,), contexts=(16,), converts=("cast",)): ...
    def none(shapes=None, batches=(1,), contexts=(16,)): ...

    assert gc.kernel_bench_kwargs(True, several)["converts"] == list(CONVERSIONS)
    assert gc.kernel_bench_kwargs(True, none) == {"shapes": ["smollm2-135m"], "batches": [1], "contexts": [16]}
    assert gc.kernel_bench_kwargs(True)["converts"] == list(CONVERSIONS)  # the real one has converts=


def test_a_failing_notebook_is_recorded_and_the_others_go_on(tmp_path):
    named = [("a_ok", _notebook("x = 6 * 7", "print(x)")),
             ("b_fails", _notebook("y = 1", "raise ValueError('planted failure')\nmore", "print('never')")),
             ("c_ok", _notebook("print('after the failure')"))]
    recs = gc.execute_notebooks(named, tmp_path / "notebooks", cwd=tmp_path, stop_at=time.monotonic() + 120, jobs=2)
    assert [r["notebook"] for r in recs] == ["a_ok", "b_fails", "c_ok"]
    assert [r["status"] for r in recs] == ["ok", "failed", "ok"], recs
    bad = recs[1]
    assert bad["cell"] == 1 and bad["error"] == "ValueError: planted failure" and bad["seconds"] > 0
    for name in ("a_ok", "b_fails", "c_ok"):
        assert (tmp_path / "notebooks" / f"{name}.ipynb").is_file()
    written = nbformat.read(tmp_path / "notebooks" / "b_fails.ipynb", as_version=4)
    assert written.cells[1].outputs[0].output_type == "error" and not written.cells[2].outputs  # it stopped there
    ok = nbformat.read(tmp_path / "notebooks" / "a_ok.ipynb", as_version=4)
    assert ok.cells[1].outputs[0].text == "42\n"
    report = {"dry_run": False, "started": "now", "deadline_s": 480, "goal_s": 480, "jobs": 2, "ok": False,
              "total_s": 9.0, "steps": [{"name": "notebooks", "status": "failed", "detail": "", "budget_s": 190,
                                         "output": "notebooks/", "seconds": 9.0, "notebooks": recs}]}
    assert "- b_fails: failed after " in gc.summary(report, tmp_path)
    assert "cell 1: ValueError: planted failure" in gc.summary(report, tmp_path)


def test_a_notebook_stops_at_its_time_limit_and_one_past_it_does_not_start(tmp_path):
    t0 = time.monotonic()
    rec = gc.execute_notebook(_notebook("print(1)", "import time\ntime.sleep(60)"), tmp_path / "slow.ipynb",
                              cwd=tmp_path, stop_at=time.monotonic() + 8)
    assert rec["status"] == "failed" and rec["cell"] == 1 and rec["error"].startswith("timeout"), rec
    assert time.monotonic() - t0 < 40 and (tmp_path / "slow.ipynb").is_file()
    late = gc.execute_notebook(_notebook("print(1)"), tmp_path / "late.ipynb", cwd=tmp_path, stop_at=time.monotonic())
    assert late["status"] == "not run (deadline)" and not (tmp_path / "late.ipynb").exists()


def test_a_step_is_killed_at_its_limit(tmp_path):
    t0 = time.perf_counter()
    rc, _, _ = gc._run_process([sys.executable, "-c", "import time; time.sleep(30)"], 1, tmp_path / "x.log")
    assert rc is None and time.perf_counter() - t0 < 10
    assert gc._process_failure(rc, "", 1) == {"status": "failed", "detail": "stopped at its time limit (1 s)"}
    assert gc._process_failure(3, "Traceback\nRuntimeError: boom\n", 9)["detail"] == "exit status 3: RuntimeError: boom"


def test_the_deadline_marks_steps_not_run(tmp_path, capsys):
    assert main(["gpu-check", "--out", str(tmp_path), "--dry-run", "--deadline-s", "0"]) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    statuses = {s["name"]: s["status"] for s in report["steps"]}
    assert statuses.pop("summary") == "ok"
    assert set(statuses.values()) == {"not run (deadline)"} and set(statuses) == set(gc.STEP_NAMES[:-1])
    summary = (tmp_path / "summary.md").read_text()
    rows = [line for line in summary.splitlines() if line.startswith(tuple(f"| {n} |" for n in statuses))]
    assert len(rows) == len(statuses) and all("| not run (deadline)" in row for row in rows), rows
    assert "SOME STEPS FAILED" in summary and not (tmp_path / "bench_kernels.json").exists()
    assert capsys.readouterr().out == summary


def test_a_step_that_raises_is_recorded_and_the_rest_go_on(tmp_path, monkeypatch):
    real_plan = gc.plan

    def broken(*args, **kwargs):
        steps = real_plan(*args, **kwargs)
        steps[0].run = lambda limit_s: 1 / 0
        return steps

    monkeypatch.setattr(gc, "plan", broken)
    report = gc.run_check(tmp_path, dry_run=True, only=["environment", "notebooks"], progress=lambda line: None)
    statuses = {s["name"]: (s["status"], s["detail"]) for s in report["steps"]}
    assert statuses["environment"] == ("failed", "ZeroDivisionError: division by zero")
    assert statuses["notebooks"][0] == "ok" and statuses["bench-kernels"][0] == "not run (--only)"
    assert not report["ok"]


@pytest.mark.parametrize("args, named", [(["--jobs", "0"], "--jobs"), (["--deadline-s", "-1"], "--deadline-s"),
                                         (["--deadline-s", "nan"], "--deadline-s"), (["--only", "nope"], "--only")])
def test_bad_options_exit_2_naming_the_option(args, named, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["gpu-check", "--out", str(tmp_path / "out"), "--dry-run", *args])
    assert e.value.code == 2 and named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kwargs, named", [({"jobs": 0}, "jobs"), ({"jobs": True}, "jobs"),
                                           ({"deadline_s": -1}, "deadline_s"), ({"deadline_s": float("inf")}, "deadline_s"),
                                           ({"only": ["environment", "nope"]}, "only")])
def test_bad_arguments_are_value_errors_naming_them(kwargs, named, tmp_path):
    with pytest.raises(ValueError, match=named):
        gc.run_check(tmp_path / "out", dry_run=True, **kwargs)
    assert not (tmp_path / "out").exists()


def test_an_out_that_is_a_file_is_refused(tmp_path, capsys):
    (tmp_path / "f").write_text("x")
    assert main(["gpu-check", "--out", str(tmp_path / "f"), "--dry-run"]) == 2
    assert "is a file, not a folder" in capsys.readouterr().err


def test_without_a_gpu_it_refuses_with_one_line(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main(["gpu-check", "--out", str(tmp_path / "out")]) == 2
    captured = capsys.readouterr()
    assert captured.err == "kvlab: error: no CUDA GPU here: run with --dry-run to rehearse the plan\n"
    assert captured.out == "" and not (tmp_path / "out").exists()


def test_the_gpu_runs_environment_check_names_what_is_missing(monkeypatch):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert gc.environment(dry_run=True)["problems"] == []
    problems = gc.environment(dry_run=False)["problems"]
    assert "torch sees no CUDA device" in problems
    if os.environ.get("TRITON_INTERPRET") == "1":
        assert any("not 'compiled'" in p for p in problems)


def test_without_jupyter_the_notebooks_are_skipped_and_the_benchmarks_still_run(tmp_path, monkeypatch):
    """The lent H200 has no nbclient/nbformat/ipykernel: the notebook step says so, nothing crashes."""
    monkeypatch.setitem(sys.modules, "nbclient", None)  # `import nbclient` now raises ImportError
    assert gc.missing_notebook_tools() == ["nbclient"]
    report = gc.run_check(tmp_path, dry_run=True, only=["notebooks", "bench-engine-torch"], progress=lambda line: None)
    steps = {s["name"]: s for s in report["steps"]}
    assert steps["notebooks"]["status"] == "skipped"
    assert steps["notebooks"]["detail"].startswith("nbclient not installed")
    assert [b["status"] for b in steps["notebooks"]["notebooks"]] == ["skipped"] * len(NOTEBOOKS)
    assert steps["bench-engine-torch"]["status"] == "ok" and (tmp_path / "bench_engine_torch.json").is_file()
    assert report["ok"]  # skipped is not failed: the exit status is 0
    summary = (tmp_path / "summary.md").read_text()
    assert "skipped: nbclient not installed" in summary and "- torch: kvlab_continuous" in summary


def test_the_summary_reads_a_gpu_runs_files(tmp_path):
    """The GPU-only parts of the summary (timings, engine rates), from the recorded H200 kernel run."""
    recorded = kbench.recorded_h200()
    (tmp_path / "bench_kernels.json").write_text(json.dumps(recorded))
    for backend, rate in (("triton", 900.0), ("torch", 600.0)):
        (tmp_path / f"bench_engine_{backend}.json").write_text(json.dumps(
            {"systems": {"kvlab_continuous": {"output_tok_s": rate, "ttft_p50_s": 0.05, "tpot_p50_s": 0.004}},
             "workload": {"requests": 32, "output_tokens_total": 2700}, "device": "cuda:0"}))
    steps = [{"name": n, "status": "ok", "detail": "", "budget_s": gc.BUDGETS[n], "output": "", "seconds": 1.0}
             for n in gc.STEP_NAMES]
    steps[0]["environment"] = {"device": "cuda", "device_name": "NVIDIA H200", "gpu_memory_gib": 139.8,
                               "compute_capability": "9.0", "torch": "2.11.0+cu130", "triton": "3.6.0",
                               "triton_mode": "compiled"}
    report = {"dry_run": False, "started": "now", "deadline_s": 480.0, "goal_s": 480.0, "jobs": 4, "ok": True,
              "total_s": 500.0, "steps": steps}
    text = gc.summary(report, tmp_path)
    assert "could not read" not in text and "OVER it" in text and "NVIDIA H200, 140 GiB, sm 9.0" in text
    rows = [line for line in text.splitlines() if line.startswith(("| llama-3-8b", "| smollm2-135m"))]
    assert len(rows) == len(recorded["measured"])
    first = recorded["measured"][0]
    assert f"{first['speedup_vs_fp16']['int8']:.2f}" in rows[0] and f"{first['us']['fp16']:.1f}" in rows[0]
    assert "triton / torch: 1.50x" in text and "900.0 output tok/s" in text
    assert len(text.splitlines()) < 60  # one screen

    (tmp_path / "bench_kernels.json").write_text(json.dumps({"measured": [{"shape": "x", "speedup_vs_fp16": 3}]}))
    text = gc.summary(report, tmp_path)  # a file not as expected: one line in its section, the rest still there
    assert "(could not read it: " in text and "triton / torch: 1.50x" in text


def test_make_gpu_check_runs_the_command_into_out():
    env = {k: v for k, v in os.environ.items() if k not in ("MAKEFLAGS", "MAKELEVEL", "MFLAGS")}
    if shutil.which("make") is None:
        pytest.skip("no make on this machine")
    r = subprocess.run(["make", "--no-print-directory", "-n", "-o", "setup", "-o", ".venv/.kvlab-setup", "gpu-check",
                        "OUT=somewhere"], capture_output=True, text=True, cwd=ROOT, env=env)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip().splitlines() == [".venv/bin/kvlab gpu-check --out somewhere"]
    assert "gpu-check" in next(line for line in (ROOT / "Makefile").read_text().splitlines() if line.startswith(".PHONY"))
