"""Grading a course: every submitted notebook executed, every task graded by kvlab's own checker
(``kvlab grade``, docs/COURSE.md).

Each submission runs headless in its own worker process; after its last cell the worker re-imports kvlab
afresh and calls each task's checker on the participant's function, never reading what the notebook
printed, so patching ``kvlab.check`` or printing ``[ok]`` gains nothing. It runs participants' code with
your rights (use a container) and stops the plain ways of faking a pass, not a determined attacker.
"""

from __future__ import annotations

import csv
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

from kvlab.check.kept import ENGINE_TASKS
from kvlab.check.progress import EXERCISES, read_record
from kvlab.env import limit_memory

STATUSES = ("pass", "fail", "not attempted")
#: a task whose function has another name in its notebook than the task's own
TASK_FUNCTIONS = {"online_softmax_update": "my_update"}
NOTEBOOKS = tuple(dict.fromkeys(nb for nb, _, _ in EXERCISES.values()))
DEFAULT_TIMEOUT_S = 900
DEFAULT_MEMORY_GB = 8.0


def function_name(task: str) -> str:
    """The name the notebook gives the participant's function for ``task``."""
    return TASK_FUNCTIONS.get(task, task)


def tasks_of(notebook: str) -> list[str]:
    """The graded tasks of one notebook, in task order."""
    if notebook not in NOTEBOOKS:
        raise ValueError(f"notebook must be one of {NOTEBOOKS}, got {notebook!r}")
    return sorted((t for t, (nb, _, _) in EXERCISES.items() if nb == notebook), key=lambda t: EXERCISES[t][1])


def load_points(path) -> dict[str, float]:
    """Points per task from a JSON file ``{"slot_mapping": 2, ...}``; tasks it leaves out are worth 1."""
    points = {t: 1.0 for t in EXERCISES}
    if path is None:
        return points
    try:
        given = json.loads(Path(path).read_text())
    except (OSError, ValueError) as e:
        raise ValueError(f"points: cannot read {str(path)!r} as JSON ({e})") from None
    if not isinstance(given, dict):
        raise ValueError(f"points: {str(path)!r} must hold an object mapping task -> points")
    for task, p in given.items():
        if task not in EXERCISES:
            raise ValueError(f"points: unknown task {task!r}; the tasks are {sorted(EXERCISES)}")
        if isinstance(p, bool) or not isinstance(p, (int, float)) or p < 0:
            raise ValueError(f"points: {task!r} must be a number >= 0, got {p!r}")
        points[task] = float(p)
    return points


@dataclass
class Row:
    """One submission's grades."""

    who: str
    file: str
    notebook: str = ""
    tasks: dict = field(default_factory=dict)  # task -> {"status", "hint"}
    score: float = 0.0
    max_score: float = 0.0
    seconds: float = 0.0
    error: str = ""  # what went wrong where the notebook could not run to its end
    engine: str = ""  # notebook 06's engine from the parts this participant passed: "yes", "no", "-" (none), "?"
    engine_detail: str = ""
    kept: dict = field(default_factory=dict, repr=False)  # task -> the passed part's record (engine tasks)


def who_of(path: Path, roots: list[Path]) -> str:
    """The submission's folder under the one given (``alice/02_paged_blocks.ipynb``), else the file's name."""
    for root in roots:
        try:
            rel = path.resolve().relative_to(root.resolve())
        except ValueError:
            continue
        if len(rel.parts) > 1:
            return rel.parts[0]
    stem = path.stem
    for nb in NOTEBOOKS:
        stem = stem.replace(nb, "")
    return stem.strip("_- .") or path.stem


def notebook_of(path: Path, forced: str | None = None) -> str | None:
    """The lab notebook a submission answers: ``forced``, else the one its file name contains."""
    if forced is not None:
        return forced
    return next((nb for nb in NOTEBOOKS if nb in path.name), None)


def _title_number(nb: dict) -> str | None:
    """The number of the notebook's title, its first ``# NN · ...`` heading (a participant may add cells above)."""
    for cell in nb.get("cells", []):
        if cell.get("cell_type") == "markdown":
            m = re.search(r"^#\s+(\d\d)\s+·", "".join(cell.get("source", "")), re.M)
            if m:
                return m.group(1)
    return None


# Runs in the participant's kernel after their last cell. Every kvlab module goes, so that nothing the
# notebook patched survives; the checkers and their references are imported afresh from disk.
_GRADER = r'''
def __kvlab_grade(tasks, token, package):
    import contextlib, io, json, os, sys
    shell = get_ipython()
    for callbacks in shell.events.callbacks.values():  # the notebook's hooks run no more
        callbacks.clear()
    for name in [m for m in sys.modules if m == "kvlab" or m.startswith("kvlab.")]:
        del sys.modules[name]
    sys.path[:] = [p for p in sys.path if p not in ("", ".", os.getcwd())]  # no kvlab/ of the submission's
    import kvlab.check as fresh
    from kvlab.check.progress import is_learners
    here = os.path.dirname(os.path.dirname(os.path.realpath(sys.modules["kvlab"].__file__)))
    if here != package:
        with open(token, "w") as f:
            json.dump({"__error__": f"kvlab was shadowed by {here!r}: not graded"}, f)
        return
    ns, out = globals(), {}
    for task, fname in tasks:
        fn = ns.get(fname)
        if fn is None or not callable(fn):
            out[task] = ["not attempted", f"no function {fname!r} in the notebook"]
            continue
        if not is_learners(fn):
            out[task] = ["fail", f"{fname!r} is kvlab's own function (or a lambda), not the participant's"]
            continue
        buf = io.StringIO()
        try:
            with contextlib.redirect_stdout(buf):
                ok = getattr(fresh, task)(fn)
        except BaseException as e:
            out[task] = ["fail", f"the checker stopped: {type(e).__name__}: {str(e)[:200]}"]
            continue
        lines = [line for line in buf.getvalue().splitlines() if line.strip()]
        line = lines[-1] if lines else ""
        status = ("pass" if ok is True and line.startswith("[ok]") else
                  "not attempted" if line.startswith("[todo]") else "fail")
        out[task] = [status, line[:300]]
    with open(token, "w") as f:
        json.dump(out, f)
'''


def _package_dir() -> str:
    """The folder that holds the installed kvlab package (what the grading cell must import)."""
    import kvlab
    return os.path.dirname(os.path.dirname(os.path.realpath(kvlab.__file__)))


def run_one(path, notebook: str, timeout_s: float = DEFAULT_TIMEOUT_S) -> dict:
    """Execute and grade one submission in this process (the worker)."""
    import nbformat  # the notebook runner loads in the worker only (nbformat, nbclient: the test tools)
    from nbclient import NotebookClient  # as above
    from nbclient.exceptions import CellExecutionError, CellTimeoutError, DeadKernelError  # as above
    t0 = time.perf_counter()
    tasks = [(t, function_name(t)) for t in tasks_of(notebook)]
    error = ""
    try:
        nb = nbformat.read(str(path), as_version=4)
    except Exception as e:  # invalid JSON, not a notebook
        return {"tasks": {}, "error": f"not a readable notebook: {type(e).__name__}: {str(e).splitlines()[0][:200]}",
                "seconds": 0.0}
    number = _title_number(nb)
    if number != notebook[:2]:
        seen = f"notebook {number}'s" if number else "no lab notebook's"
        return {"tasks": {}, "error": f"this is {seen} content, submitted as {notebook}", "seconds": 0.0}
    work = Path(path).parent
    token = str(work / f".grades-{os.getpid()}-{time.time_ns()}.json")
    client = NotebookClient(nb, timeout=timeout_s, kernel_name="python3", allow_errors=True,
                            resources={"metadata": {"path": str(work)}})
    deadline = t0 + timeout_s
    grades = {}
    try:
        with client.setup_kernel():
            for index, cell in enumerate(nb.cells):
                if cell.cell_type != "code":
                    continue
                client.timeout = max(1, int(deadline - time.perf_counter()))
                client.execute_cell(cell, index)
            grader = nbformat.v4.new_code_cell(_GRADER + f"\n__kvlab_grade({tasks!r}, {token!r}, {_package_dir()!r})\n")
            nb.cells.append(grader)
            client.timeout = 300
            client.execute_cell(grader, len(nb.cells) - 1)
    except CellTimeoutError:
        error = f"a cell was still running when the {timeout_s:.0f} s limit came: stopped"
    except DeadKernelError:
        error = "the kernel died (it exited, or ran out of memory)"
    except CellExecutionError as e:  # pragma: no cover - allow_errors=True: nbclient raises none of these
        error = f"grading failed: {str(e).splitlines()[0][:200]}"
    except Exception as e:
        error = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
    if os.path.exists(token):
        with open(token) as f:
            grades = json.load(f)
        os.remove(token)
        error = grades.pop("__error__", error) if isinstance(grades, dict) else "the grades file was not grades"
    elif not error:
        error = "the grading cell did not finish (the kernel stopped before it, or the cell raised)"
    return {"tasks": grades, "error": error, "seconds": round(time.perf_counter() - t0, 1)}


def _worker_main(argv) -> int:
    path, notebook, timeout_s, out, memory_gb = argv
    if float(memory_gb) > 0:
        limit_memory(float(memory_gb))
    result = run_one(path, notebook, float(timeout_s))
    Path(out).write_text(json.dumps(result))
    return 0


def _kill_tree(pid: int) -> None:
    """The worker and everything it started (its kernel, the kernel's children)."""
    import psutil  # comes with ipykernel, which grading needs anyway
    try:
        root = psutil.Process(pid)
        procs = root.children(recursive=True) + [root]
    except psutil.NoSuchProcess:
        return
    for p in procs:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass
    psutil.wait_procs(procs, timeout=10)


def grade_one(path, notebook: str, timeout_s: float = DEFAULT_TIMEOUT_S, memory_gb: float | None = DEFAULT_MEMORY_GB,
              python: str | None = None) -> dict:
    """Grade one submission in a worker process of its own (time limit plus 6 minutes to start the kernel
    and run the checkers); its result counts only when the worker itself ends well."""
    scratch = Path(tempfile.mkdtemp(prefix="kvlab-grade-"))
    work = scratch / "work"  # the kernel's folder: the worker's files stay one level up
    work.mkdir()
    try:
        copy = work / Path(path).name
        shutil.copyfile(path, copy)
        out, log = scratch / f"result-{os.urandom(8).hex()}.json", scratch / "worker.log"
        env = dict(os.environ, KVLAB_PROGRESS=str(scratch / "progress.json"), KVLAB_KEPT=str(scratch / "kept_parts.json"),
                   PYTHONUNBUFFERED="1")
        cmd = [python or sys.executable, "-m", "kvlab.grade", str(copy), notebook, str(timeout_s), str(out),
               str(memory_gb or 0)]
        limit = timeout_s + 360
        with open(log, "wb") as err:  # a file, not a pipe: a process the kernel leaves behind cannot block it
            proc = subprocess.Popen(cmd, cwd=work, env=env, stdout=subprocess.DEVNULL, stderr=err,
                                    start_new_session=True)
            try:
                rc = proc.wait(timeout=limit)
            except subprocess.TimeoutExpired:
                _kill_tree(proc.pid)
                return {"tasks": {}, "error": f"the worker ran past {limit:.0f} s and was killed", "seconds": timeout_s}
        if rc == 0 and out.exists():
            result = json.loads(out.read_text())
            if isinstance(result, dict) and {"tasks", "error", "seconds"} <= set(result):
                # the engine's parts this submission passed, as the worker's checkers kept them
                result["kept"] = {t: r for t, r in read_record(scratch / "kept_parts.json", "kept parts file").items()
                                  if t in ENGINE_TASKS and result["tasks"].get(t, [""])[0] == "pass"}
                return result
        if rc is not None and rc < 0:  # a signal: the notebook (or the system) killed it
            return {"tasks": {}, "error": f"the worker died: killed by signal {-rc}", "seconds": 0.0}
        tail = log.read_text(errors="replace").strip().splitlines()[-1:] or [""]
        return {"tasks": {}, "error": f"the worker died (status {rc}): {tail[0][:200]}", "seconds": 0.0}
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def grade(submissions, notebook: str | None = None, timeout_s: float = DEFAULT_TIMEOUT_S, jobs: int = 1,
          points: dict | None = None, memory_gb: float | None = DEFAULT_MEMORY_GB, progress=None) -> list[Row]:
    """One :class:`Row` per ``.ipynb`` among ``submissions`` (searched recursively), in the order found;
    ``notebook`` forces which lab notebook they answer (else the file name says)."""
    if not isinstance(jobs, int) or isinstance(jobs, bool) or jobs < 1:
        raise ValueError(f"jobs must be an int >= 1, got {jobs!r}")
    if not isinstance(timeout_s, (int, float)) or timeout_s <= 0:
        raise ValueError(f"timeout_s must be > 0 seconds, got {timeout_s!r}")
    if notebook is not None and notebook not in NOTEBOOKS:
        raise ValueError(f"notebook must be one of {NOTEBOOKS}, got {notebook!r}")
    if memory_gb is not None and not (isinstance(memory_gb, (int, float)) and 0 < memory_gb < float("inf")):
        raise ValueError(f"memory_gb must be a number of GiB > 0 (or None: no limit), got {memory_gb!r}")
    points = {**load_points(None), **(points or {})}
    roots, files = [], []
    for s in submissions:
        p = Path(s)
        if p.is_dir():
            roots.append(p)
            files += sorted(f for f in p.rglob("*.ipynb") if ".ipynb_checkpoints" not in f.parts)
        elif p.is_file():
            files.append(p)
        else:
            raise ValueError(f"submissions: {str(p)!r} is neither a file nor a folder")
    if not files:
        raise ValueError("submissions: no .ipynb found")
    def one(path: Path) -> Row:
        row = Row(who=who_of(path, roots), file=str(path))
        nb = notebook_of(path, notebook)
        if nb is None:
            row.error = f"cannot tell which notebook this answers from its name: pass --notebook (one of {NOTEBOOKS})"
            return row
        row.notebook = nb
        try:
            result = grade_one(path, nb, timeout_s, memory_gb)
        except Exception as e:  # one submission's trouble stays in its row
            result = {"tasks": {}, "error": f"grading failed: {type(e).__name__}: {str(e)[:200]}", "seconds": 0.0}
        row.seconds, row.error, row.kept = result["seconds"], result["error"], result.get("kept", {})
        for task in tasks_of(nb):
            got = result["tasks"].get(task)
            status, hint = got if (isinstance(got, list) and len(got) == 2 and got[0] in STATUSES) else (
                "not attempted", "not graded: " + (row.error or "no result"))
            row.tasks[task] = {"status": status, "hint": hint}
            row.max_score += points[task]
            row.score += points[task] if status == "pass" else 0.0
        if progress is not None:
            progress(row)
        return row
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        rows = list(pool.map(one, files))
    try:
        grade_engines(rows, timeout_s, jobs=jobs, memory_gb=memory_gb)
    except Exception as e:  # the notebooks' grades stand whatever happens to the engine column
        for r in rows:
            r.engine, r.engine_detail = "?", f"the engine column failed: {type(e).__name__}: {str(e)[:200]}"
    return rows


ENGINE_TIMEOUT_S = 300  # one participant's engine: the model, kvlab's own run and theirs (about 20 s on 2 cores)


def grade_engines(rows: list[Row], timeout_s: float = ENGINE_TIMEOUT_S, model: str = "smollm2-135m", jobs: int = 1,
                  memory_gb: float | None = DEFAULT_MEMORY_GB) -> None:
    """Notebook 06's engine for each participant whose submissions passed one of its parts, assembled from
    those parts only (never the grader's own kept parts), served beside kvlab's in a worker of its own:
    ``row.engine`` "yes" when its answers equal kvlab's token for token, "no" when not, "-" with no part
    passed, "?" when the worker itself failed (the detail says how)."""
    kept: dict[str, dict] = {}
    for r in rows:
        kept.setdefault(r.who, {}).update(r.kept)

    def one(who: str) -> dict:
        with tempfile.TemporaryDirectory(prefix="kvlab-engine-") as tmp:
            src, dst = Path(tmp) / "kept.json", Path(tmp) / "engine.json"
            src.write_text(json.dumps({"kept": {who: kept[who]}, "model": model, "memory_gb": memory_gb}))
            env = dict(os.environ, KVLAB_KEPT=str(Path(tmp) / "none.json"), KVLAB_PROGRESS=str(Path(tmp) / "p.json"))
            try:
                proc = subprocess.run([sys.executable, "-m", "kvlab.yours", str(src), str(dst)], env=env, cwd=tmp,
                                      capture_output=True, text=True, timeout=max(timeout_s, ENGINE_TIMEOUT_S))
            except subprocess.TimeoutExpired:
                return {"engine": "?", "detail": f"the engine's worker ran past {max(timeout_s, ENGINE_TIMEOUT_S):.0f} s"}
            if proc.returncode == 0 and dst.exists():
                return json.loads(dst.read_text())[who]
            why = (proc.stderr.strip().splitlines() or [f"status {proc.returncode}"])[-1][:300]
            return {"engine": "?", "detail": f"the engine's worker failed: {why}"}

    job = [who for who, k in kept.items() if k]
    with ThreadPoolExecutor(max_workers=jobs) as pool:
        results = dict(zip(job, pool.map(one, job)))
    for r in rows:
        got = results.get(r.who, {"engine": "-", "detail": "no part of notebook 06's engine passed"})
        r.engine, r.engine_detail = got["engine"], got["detail"]


def write_csv(rows: list[Row], path) -> Path:
    """One row per submission: who, notebook, each task's status and hint, score, max, seconds, error."""
    tasks = [t for nb in NOTEBOOKS for t in tasks_of(nb) if any(r.notebook == nb for r in rows)]
    path = Path(path)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(["who", "notebook", "file", *[c for t in tasks for c in (t, f"{t} hint")], "score", "max_score",
                    "seconds", "error", "engine", "engine detail"])
        for r in rows:
            cells = []
            for t in tasks:
                g = r.tasks.get(t)
                cells += [g["status"], g["hint"]] if g else ["", ""]
            w.writerow([r.who, r.notebook, r.file, *cells, f"{r.score:g}", f"{r.max_score:g}", f"{r.seconds:.1f}", r.error,
                        r.engine, r.engine_detail])
    return path


NBGRADER_COLUMNS = ("assignment", "duedate", "timestamp", "student_id", "last_name", "first_name", "email",
                    "raw_score", "late_submission_penalty", "score", "max_score")


def write_nbgrader_csv(rows: list[Row], path) -> Path:
    """The grades in ``nbgrader export``'s columns, for a course on nbgrader to merge into its gradebook."""
    path = Path(path)
    with path.open("w", newline="") as f:
        w = csv.writer(f)
        w.writerow(NBGRADER_COLUMNS)
        for r in rows:
            w.writerow([r.notebook, "", "", r.who, "", "", "", f"{r.score:g}", "0.0", f"{r.score:g}", f"{r.max_score:g}"])
    return path


if __name__ == "__main__":
    sys.exit(_worker_main(sys.argv[1:]))
