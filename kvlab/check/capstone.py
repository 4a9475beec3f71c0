"""Notebook 06's exercise: how many requests a pool can hold to completion at once."""

from __future__ import annotations

import random
from typing import Callable

import torch

from kvlab.capstone import max_held as _max_held
from kvlab.check.core import run_task
from kvlab.export import fp8_scales as ref_fp8_scales
from kvlab.validate import cdiv


def _cases() -> list[tuple[tuple, int]]:
    rng = random.Random(6)
    shapes = [([70, 20, 33, 40], 0, 8, 16),  # blocks 5, 2, 3, 3: shortest first 2 + 3 + 3 = 8 holds 3; arrival order 2
              ([50, 50, 50], 32, 6, 16),  # a 2-block system prompt stored once, 2 own blocks each: 2 + 2 + 2 = 6, two
              ([64, 64, 64], 40, 7, 16),  # 40 shared tokens: 2 full blocks shared, the third (partial) is each one's own
              ([16, 16, 16], 0, 3, 16),  # an exact fit: three requests fill the pool to the last block
              ([30, 30], 0, 1, 16),  # not even one request fits
              ([10, 11, 12, 13], 8, 3, 4)]  # small blocks, a shared prefix of exactly two
    for _ in range(6):
        shared = rng.choice((0, 16, 27, 48))
        lengths = [shared + rng.randint(1, 300) for _ in range(rng.randint(3, 20))]
        shapes.append((lengths, shared, rng.randint(8, 120), 16))
    return [(a, _max_held(*a)) for a in shapes]


def max_held(fn: Callable[[list, int, int, int], int]) -> bool:
    """``fn(lengths, shared_tokens, num_blocks, block_size)``: requests held to completion at once,
    shortest first, the system prompt's full blocks stored once."""
    cases = _cases()
    def greedy(blocks_of, start, order=sorted, fits=lambda used, n, cap: used + n <= cap):
        def f(lengths, shared, cap, bs):
            used, held = start(shared, bs), 0
            for n in order([blocks_of(x, shared, bs) for x in lengths]):
                if not fits(used, n, cap):
                    break
                used, held = used + n, held + 1
            return held
        return f
    own = lambda x, s, bs: cdiv(x, bs) - s // bs  # noqa: E731  (the right count of a request's own blocks)
    mistakes = [
        (greedy(lambda x, s, bs: cdiv(x, bs), lambda s, bs: 0),
         "the system prompt's full blocks are shared: store them once, not once per request"),
        (greedy(own, lambda s, bs: 0), "the shared blocks are stored once, but they are stored: count them once"),
        (greedy(own, lambda s, bs: s // bs, order=list),
         "shortest first: the bound asks for the most requests that could be held at once"),
        (greedy(own, lambda s, bs: s // bs, fits=lambda used, n, cap: used + n < cap),
         "a request whose blocks fill the pool to its last block still fits"),
        (greedy(lambda x, s, bs: cdiv(x, bs) - cdiv(s, bs), lambda s, bs: cdiv(s, bs)),
         "only full blocks are shared: a partly filled last block of the system prompt is each request's own"),
        (greedy(lambda x, s, bs: (x - s) / bs, lambda s, bs: s / bs),
         "memory comes in whole blocks: a request of n tokens holds ceil(n / block_size) blocks"),
    ]
    def hint(args, got, expected):
        for formula, why in mistakes:
            try:
                if all(fn(*a) == formula(*a) for a, _ in cases):
                    return why
            except Exception:  # noqa: BLE001  (the learner's error is reported by run_task)
                return None
        return None
    return run_task("max_held", fn, cases, hint=hint)


def fp8_scales(fn: Callable) -> bool:
    """``fn(absmax (L, H), strategy)``: absmax / 448, 1.0 below 1e-6; (L, 1) "tensor", (L, H) "attn_head"."""
    g = torch.Generator().manual_seed(6)
    table = torch.rand(5, 3, generator=g) * 20
    table[2, 1] = 0.0  # a head that never saw a value above zero
    table[4] = 0.0  # a whole layer of them
    table = torch.cat([table, torch.tensor([[1e-8, 5e-7, 0.0]])])  # near zero, not zero: below 1e-6 is guarded too
    cases = [((table.clone(), s), ref_fp8_scales(table.clone(), s)) for s in ("attn_head", "tensor")]
    def hint(args, got, expected):
        absmax, strategy = args
        if not isinstance(got, torch.Tensor):
            return "return a tensor of scales"
        if got.shape != expected.shape:
            want = "(L, 1): one per layer, kept 2-D" if strategy == "tensor" else "(L, H): one per layer and KV head"
            return f"shape {want}"
        amax = absmax.amax(dim=1, keepdim=True) if strategy == "tensor" else absmax
        safe = torch.where(amax < 1e-6, torch.ones_like(amax), amax)
        if torch.allclose(got, torch.where(amax < 1e-6, torch.ones_like(amax), amax / 127)):
            return "FP8 e4m3's largest value is 448, not INT8's 127"
        if strategy == "tensor" and torch.allclose(got, torch.where(absmax.mean(1, keepdim=True) < 1e-6, 1.0,
                                                                   absmax.mean(1, keepdim=True) / 448)):
            return "one scale per layer must cover its largest head: the max over heads, not the mean"
        if torch.allclose(got, expected, rtol=1e-6) and not torch.equal(got, expected):
            return ("divide by 448: multiplying by 1/448 rounds differently in float32, and the checkpoint must hold "
                    "exactly the scales kvlab's pool uses")
        if torch.allclose(got, safe * 448):
            return "divide by 448: the scale is what one step of the grid is worth, absmax / 448"
        if not torch.isfinite(got).all() or bool((got[amax < 1e-6] == 0).any()):
            return "an abs-max below 1e-6 gets scale 1.0 (the zero guard): a zero scale would divide by zero"
        tiny = (amax > 0) & (amax < 1e-6)
        if bool((got[amax == 0] == 1).all()) and bool((got[tiny] != 1).any()):
            return "the zero guard covers an abs-max below 1e-6, not only exactly 0: scale 1.0 there too"
        return None
    return run_task("fp8_scales", fn, cases, hint=hint,  # exact: the checkpoint must hold the pool's own scales
                   same=lambda a, b: isinstance(a, torch.Tensor) and a.shape == b.shape and a.dtype == b.dtype and torch.equal(a, b))
