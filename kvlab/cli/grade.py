"""``kvlab grade``: submitted notebooks run headless, each task graded by kvlab's checker (docs/COURSE.md)."""

from __future__ import annotations

import sys

from kvlab import grade as G
from kvlab.cli.common import CLIError, emit


def cmd_grade(args) -> int:
    import importlib.util  # only to ask whether the grading tools are installed
    missing = [m for m in ("nbclient", "nbformat", "ipykernel", "psutil") if importlib.util.find_spec(m) is None]
    if missing:
        raise CLIError(f"grading runs notebooks and needs {', '.join(missing)}: pip install 'kvlab[grade]'")
    if args.notebook is not None and args.notebook not in G.NOTEBOOKS:
        raise CLIError(f"--notebook must be one of {G.NOTEBOOKS}, got {args.notebook!r}")
    if not args.memory_gb > 0:
        raise CLIError(f"--memory-gb must be > 0, got {args.memory_gb}")
    try:
        points = G.load_points(args.points)
    except ValueError as e:
        raise CLIError(f"--{e}") from None
    bar = None
    if not args.json:
        from tqdm.auto import tqdm  # the progress bar, on stderr
        bar = tqdm(total=None, desc="graded", unit="submission", file=sys.stderr)
    try:
        rows = G.grade(args.submissions, notebook=args.notebook, timeout_s=args.timeout, jobs=args.jobs,
                       points=points, memory_gb=args.memory_gb, progress=(lambda row: bar.update(1)) if bar is not None else None)
    except ValueError as e:
        raise CLIError(str(e)) from None
    finally:
        if bar is not None:
            bar.close()
    G.write_csv(rows, args.out)
    if args.nbgrader:
        G.write_nbgrader_csv(rows, args.nbgrader)
    failed = [r for r in rows if r.error]
    lines = [f"{r.who:<16} {r.notebook:<24} {r.score:g}/{r.max_score:g}  {r.seconds:6.1f} s  engine {r.engine}"
             + (f"  ({r.error})" if r.error else "") for r in rows]
    lines.append(f"{len(rows)} submissions graded into {args.out}; {len(failed)} could not run to the end")
    emit({"rows": [{k: v for k, v in r.__dict__.items() if k != "kept"} for r in rows], "out": args.out}, args.json, lines)
    return 0
