"""``kvlab gpu-check``: the plan run end to end on this CPU (``--dry-run``), so that the first GPU call is
not where its bugs are found; a failing step recorded while the others go on; a step killed at its
limit with its children; bad input; the refusal without a GPU."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest
import torch

from kvlab import gpu_check as gc
from kvlab.cli import main
from kvlab.kernels.convert import CONVERSIONS


def test_dry_run_end_to_end(tmp_path):
    out = tmp_path / "out"
    r = subprocess.run([sys.executable, "-m", "kvlab", "gpu-check", "--out", str(out), "--dry-run"],
                       capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    report = json.loads((out / "gpu_check.json").read_text())
    assert [s["name"] for s in report["steps"]] == list(gc.STEP_NAMES) and report["ok"] and report["dry_run"]
    summary = (out / "summary.md").read_text()
    assert r.stdout == summary  # the screen is the file
    assert "all steps ok" in summary and summary.count("| ok |") == len(gc.STEP_NAMES)
    assert "21/21 cases" in summary and summary.count("kvlab_continuous  ") == 2  # each command's own table
    assert "collected" in summary and "%|" not in summary  # nbval collected the notebooks; no progress bars
    assert json.loads((out / "bench_kernels.json").read_text())["mode"] == "interpreter"
    for s in report["steps"]:
        assert (out / s["log"]).is_file() and s["seconds"] <= s["limit_s"]


def test_the_gpu_plan_runs_the_issues_points_within_the_goal(tmp_path):
    steps = gc.plan(tmp_path)
    assert [s.name for s in steps] == list(gc.STEP_NAMES) == [s.name for s in gc.plan(tmp_path, dry_run=True)]
    assert sum(s.limit_s for s in steps) <= gc.GOAL_S - 10  # room for start-up inside the 8 minutes
    kernels = " ".join(steps[1].argv)
    assert "--batches 1 8 32 --contexts 1024 16384" in kernels and f"--converts {' '.join(CONVERSIONS)}" in kernels
    for s in steps[2:4]:
        assert "--model smollm2-135m --num-requests 32" in " ".join(s.argv)
    assert "-n 4 --dist loadfile" in " ".join(steps[4].argv) and "--collect-only" not in steps[4].argv  # a notebook in one kernel


def test_a_step_is_killed_with_its_children_at_its_limit(tmp_path):
    child = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', 'import time; time.sleep(60)']); " \
            f"open({str(tmp_path / 'started')!r}, 'w'); time.sleep(60)"
    t0 = time.perf_counter()
    rec = gc.run_step(gc.Step("slow", [sys.executable, "-c", child], 3), tmp_path / "slow.log")
    assert rec["status"] == "failed" and rec["detail"] == "stopped at its limit (3 s)" and time.perf_counter() - t0 < 15
    left = subprocess.run(["pgrep", "-f", "time.sleep\\(60\\)"], capture_output=True, text=True).stdout.split()
    assert (tmp_path / "started").exists() and not left, left


def test_a_failing_step_is_recorded_and_the_rest_go_on(tmp_path, monkeypatch, capsys):
    fail = gc.Step("environment", [sys.executable, "-c", "print('hello'); raise SystemExit('planted failure')"], 20)
    ok = gc.Step("notebooks", [sys.executable, "-c", "print('after it')"], 20)
    monkeypatch.setattr(gc, "plan", lambda out, dry_run=False, jobs=4: [fail, ok])
    assert main(["gpu-check", "--out", str(tmp_path), "--dry-run"]) == 1
    report = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(s["status"], s["detail"]) for s in report["steps"]] == [
        ("failed", "exit status 1: planted failure"), ("ok", "")]
    summary = capsys.readouterr().out
    assert "SOME STEPS FAILED" in summary and "after it" in summary


def test_interpreted_kernels_fail_the_environment_step_on_a_gpu(tmp_path):
    step = gc.Step("environment", [sys.executable, "-c", "print('triton 3.7.1 interpreter (CPU)')"], 20)
    assert gc.run_step(step, tmp_path / "a.log", dry_run=True)["status"] == "ok"
    assert gc.run_step(step, tmp_path / "b.log")["detail"].startswith("Triton does not run compiled kernels")
    compiled = gc.Step("environment", [sys.executable, "-c", "print('triton 3.7.1 compiled (GPU)')"], 20)
    assert gc.run_step(compiled, tmp_path / "c.log")["status"] == "ok"


@pytest.mark.parametrize("args, named", [(["--jobs", "0"], "--jobs"), (["--only", "nope"], "--only")])
def test_bad_options_exit_2_naming_the_option(args, named, tmp_path, capsys):
    with pytest.raises(SystemExit) as e:
        main(["gpu-check", "--out", str(tmp_path / "out"), "--dry-run", *args])
    assert e.value.code == 2 and named in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


@pytest.mark.parametrize("kwargs, named", [({"jobs": 0}, "jobs"), ({"jobs": True}, "jobs"),
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
