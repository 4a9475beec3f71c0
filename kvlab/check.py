"""Exercise checkers for the notebooks (Tensor-Puzzles style).

Each exercise in a notebook is a spec in prose, a stub that raises ``NotImplementedError`` and one
call here. A checker runs the learner's function on fixed cases, compares with kvlab's own answer
and prints ONE stable line: ``[ok]``, ``[todo]`` (stub not written yet: shows the target, so the
notebook still runs top to bottom) or ``[fail]`` (shows yours vs expected for the first mismatch).
It returns True only on ``[ok]``.
"""

from __future__ import annotations

import math
from typing import Any, Callable, Sequence


def _run(name: str, fn: Callable, cases: Sequence[tuple[tuple, Any]], same=None) -> bool:
    if not callable(fn):
        raise TypeError(f"{name}: pass your function itself, got {type(fn).__name__}")
    same = same or (lambda a, b: a == b)
    for args, expected in cases:
        try:
            got = fn(*args)
        except NotImplementedError:
            print(f"[todo] {name}: not written yet - for {args} the answer is {expected!r}")
            return False
        except Exception as e:  # the learner's bug, shown rather than raised
            print(f"[fail] {name}{args} raised {type(e).__name__}: {e}")
            return False
        if not same(got, expected):
            print(f"[fail] {name}{args}: yours {got!r}, expected {expected!r}")
            return False
    print(f"[ok] {name}: {len(cases)} cases match")
    return True


# ---- notebook 00 -------------------------------------------------------------------------------

def _kv_bytes_cases():
    from kvlab.sizing import kv_bytes_per_token, kv_config

    cases = []
    for name in ("llama-2-7b", "llama-2-70b", "llama-3-8b", "qwen2.5-7b", "smollm2-135m"):
        c = kv_config(name)
        for dtype, nbytes in (("fp16", 2), ("fp32", 4), ("int8", 1)):
            cases.append(((c.num_layers, c.num_kv_heads, c.head_dim, nbytes), kv_bytes_per_token(name, dtype)))
    return cases


def kv_bytes_per_token(fn: Callable[[int, int, int, int], int]) -> bool:
    """``fn(num_layers, num_kv_heads, head_dim, bytes_per_element) -> bytes one token adds``."""
    return _run("kv_bytes_per_token", fn, _kv_bytes_cases())


# ---- notebook 01 -------------------------------------------------------------------------------

def token_forwards(fn: Callable[[int, int, bool], int]) -> bool:
    """``fn(prompt_len, new_tokens, cached) -> token positions pushed through the model``.

    Without a cache, step i re-runs the whole prefix (prompt_len + i positions); with one, the
    prompt goes through once and each later step feeds one token. The last token is sampled,
    never fed back.
    """
    from kvlab.bench import token_forwards as ref

    cases = [((p, n, c), ref(p, n, c)) for p, n in ((1, 1), (4, 3), (16, 16), (128, 16), (512, 64))
             for c in (False, True)]
    return _run("token_forwards", fn, cases)


def static_utilization(fn: Callable[[Sequence[int], int, int], float]) -> bool:
    """``fn(tokens_per_sequence, max_batch, max_seq_len) -> tokens stored / slots reserved``."""
    from kvlab.cache.naive import static_utilization as ref

    cases = [((lens, b, t), ref(lens, b, t))
             for lens, b, t in (([10], 1, 10), ([10, 20], 2, 40), ([5, 50, 500], 4, 2048), ([100] * 8, 8, 4096))]
    return _run("static_utilization", fn, cases, same=lambda a, b: isinstance(a, (int, float))
                and math.isclose(a, b, rel_tol=1e-9))


# ---- notebook 02 -------------------------------------------------------------------------------

def slot_mapping(fn: Callable[[Sequence[int], int, int, int], list]) -> bool:
    """``fn(block_table, block_size, start, end) -> slots of tokens start..end-1``."""
    from kvlab.cache import BlockManager

    cases = []
    for bs, lengths in ((1, (3,)), (4, (10, 3)), (16, (40, 1, 16)), (8, (64,))):
        bm = BlockManager(64, bs)
        for i, n in enumerate(lengths):
            bm.allocate(i, [7] * n)
        for i, n in enumerate(lengths):
            for start, end in ((0, n), (n - 1, n), (n // 2, n)):
                cases.append(((bm.block_table(i), bs, start, end), bm.slot_mapping(i, start, end)))
    return _run("slot_mapping", fn, cases, same=lambda a, b: list(a) == b)
