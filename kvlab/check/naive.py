"""Notebook 01's exercises: work with and without a cache, what a static cache really uses."""

from __future__ import annotations

import math
from typing import Callable, Sequence


from kvlab.bench.caches import token_forwards as ref_token_forwards
from kvlab.cache.naive import static_tokens_stored
from kvlab.cache.naive import static_utilization as ref_static_utilization
from kvlab.check.core import _run


def token_forwards(fn: Callable[[int, int, bool], int]) -> bool:
    """``fn(prompt_len, new_tokens, cached) -> token positions pushed through the model``.

    Without a cache, step i re-runs the whole prefix (prompt_len + i positions); with one, the
    prompt goes through once and each later step feeds one token. The last token is sampled,
    never fed back.
    """
    cases = [((p, n, c), ref_token_forwards(p, n, c)) for p, n in ((1, 1), (4, 3), (16, 16), (128, 16), (512, 64))
             for c in (False, True)]

    def hint(args, got, expected):
        p, n, cached = args
        if got == expected + (1 if cached else p + n):
            return "the last token is sampled, never fed back: there is no step after it"
        if cached and got == n:
            return "the prompt itself goes through the model once (prefill) before the first new token"
        if cached and got == ref_token_forwards(p, n, False) and n > 1:
            return "with a cache each step feeds ONE token; re-running the whole sequence is the no-cache count"
        if cached and got == p + n - 1 + (n - 1):
            return "with a cache each step feeds ONE token, not the whole sequence so far"
        if not cached and got == expected + n:
            return ("without a cache step i runs prompt_len + i positions for i = 0 .. new_tokens - 1 "
                    "(the first step is the prompt alone)")
        if not cached and got == p * n:
            return "without a cache step i re-runs the prompt AND the i tokens generated so far"
        return None

    return _run("token_forwards", fn, cases, hint=hint, reveal=False)  # the cases are the exercise: no answer shown


def static_utilization(fn: Callable[[Sequence[int], int, int], float]) -> bool:
    """``fn(tokens_per_sequence, max_batch, max_seq_len) -> tokens stored / slots reserved``."""
    cases = [((lens, b, t), ref_static_utilization(lens, b, t))
             for lens, b, t in (([10], 1, 10), ([10, 20], 2, 40), ([5, 50, 500], 4, 2048), ([100] * 8, 8, 4096))]

    def hint(args, got, expected):
        lens, b, t = args
        if not isinstance(got, (int, float)):
            return "return one number, the share (a float between 0 and 1)"
        if math.isclose(got, sum(lens) / (len(lens) * t), rel_tol=1e-9):
            return "the cache reserves max_batch rows, filled or not: an empty row is reserved too"
        if math.isclose(got, 1 - expected, rel_tol=1e-9):
            return "that is the share wasted; the question asks for the share used"
        if math.isclose(got, 100 * expected, rel_tol=1e-9):
            return "a share, not a percentage"
        return None

    return _run("static_utilization", fn, cases, same=lambda a, b: isinstance(a, (int, float))
                and math.isclose(a, b, rel_tol=1e-9), hint=hint, reveal=False)


def tokens_stored(fn: Callable[[Sequence[int], Sequence[int]], list]) -> bool:
    """``fn(prompt_lens, answer_lens) -> real tokens per row`` of a static cache after one padded greedy
    batch (answers cut after their end-of-sequence token)."""
    shapes = [([5], [3]), ([37, 38, 40, 46], [8, 64, 64, 64]), ([10, 10], [1, 4]), ([4, 9, 2], [6, 6, 2]),
              ([7, 7, 7], [5, 5, 5])]
    cases = [((p, a), static_tokens_stored(p, a)) for p, a in shapes]

    def hint(args, got, expected):
        p, a = args
        if not isinstance(got, (list, tuple)) or len(got) != len(p):
            return "one number per row"
        longest = [i for i, n in enumerate(a) if n == max(a)]
        early = [i for i, n in enumerate(a) if n < max(a)]
        if any(got[i] == p[i] + a[i] for i in longest):
            return "the longest row's last token is sampled from the final step and never fed back"
        if len(set(p)) > 1 and all(g == max(p) + max(a) - 1 for g in got):
            return "the left padding is written too, but it is padding: a row's real tokens start with its own prompt"
        if early and all(got[i] == p[i] + max(a) - 1 for i in early):
            return "after its end-of-sequence token a row only receives pads: written, but not tokens"
        if early and all(got[i] == p[i] + a[i] - 1 for i in early):
            return "a row that ended early did feed back its last token (the loop went on for the others)"
        return None

    return _run("tokens_stored", fn, cases, same=lambda x, y: list(x) == list(y) if isinstance(x, (list, tuple)) else False,
                hint=hint, reveal=False)
