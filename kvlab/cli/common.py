"""What every ``kvlab`` command module shares: the bad-input error, and a table or one JSON object out."""

from __future__ import annotations

import json


class CLIError(Exception):
    """Bad input the parser cannot see (a combination of options): one ``kvlab: error`` line, status 2."""


def emit(obj: dict, as_json: bool, lines: list[str]) -> None:
    if as_json:
        print(json.dumps(obj))
    else:
        print("\n".join(lines))


def batched_tokens(value: int | None, max_num_seqs: int) -> int:
    """``--max-num-batched-tokens`` for ``generate --engine`` and ``bench engine``: its default, or a refusal."""
    if value is None:
        return max(512, max_num_seqs)  # the default budget, raised so every running sequence can decode
    if value < max_num_seqs:
        raise CLIError(f"--max-num-batched-tokens ({value}) must be >= --max-num-seqs ({max_num_seqs}): every "
                       "running sequence needs one token of budget per decode step")
    return value
