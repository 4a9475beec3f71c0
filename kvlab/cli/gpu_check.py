"""``kvlab gpu-check --out DIR``: the lab's one GPU check (:mod:`kvlab.gpu_check`), or its rehearsal
on a CPU with ``--dry-run``. Exit status 0 when every step passed (or was skipped: no Jupyter), 1 when
one failed or the deadline left it unrun, 2 for bad input and for a plain run without a CUDA GPU."""

from __future__ import annotations

import json

from kvlab.gpu_check import run_check
from kvlab.cli.common import emit
from kvlab.files import read_text


def cmd_gpu_check(args) -> int:
    report = run_check(args.out, dry_run=args.dry_run, jobs=args.jobs, deadline_s=args.deadline_s, only=args.only,
                       model=args.model)
    if args.json:
        print(json.dumps(report, default=str))
    else:
        emit(report, False, read_text(f"{args.out}/summary.md", "summary").splitlines())
    return 0 if report["ok"] else 1
