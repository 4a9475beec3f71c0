"""``kvlab gpu-check --out DIR`` (:mod:`kvlab.gpu_check`): exit status 0 when every step passed, 1 when one
failed, 2 for bad input and for a run without a CUDA GPU (unless ``--dry-run``)."""

from __future__ import annotations

import json
import sys

from kvlab.gpu_check import run_check


def cmd_gpu_check(args) -> int:
    report = run_check(args.out, dry_run=args.dry_run, jobs=args.jobs, only=args.only,
                       progress=lambda line: print(line, file=sys.stderr, flush=True))
    print(json.dumps(report) if args.json else (args.out / "summary.md").read_text(encoding="utf-8").rstrip("\n"))
    return 0 if report["ok"] else 1
