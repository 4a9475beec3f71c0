"""``kvlab claims``: every numeric claim of the source articles, measured, with a verdict (notebook 06)."""

from __future__ import annotations

from kvlab import claims
from kvlab.cli.common import CLIError, emit


def cmd_claims(args) -> int:
    ids = [x.strip() for x in args.only.split(",") if x.strip()] if args.only is not None else None
    if ids is not None and not ids:
        raise CLIError(f"--only names no claim id (got {args.only!r}): give ids separated by commas, e.g. --only "
                       "D1,Q2 (kvlab claims lists them)")
    rows = claims.run(ids=ids, progress=True)  # a bar on stderr, --json or not: stdout stays the table
    emit({"claims": rows, "counts": claims.counts(rows)}, args.json, [claims.format_table(rows)])
    return 0
