"""Notebook 07's exercise: which blocks sinks + window keeps after n tokens."""

from __future__ import annotations

from typing import Callable

from kvlab.cache.evict import SinksWindow
from kvlab.cache.paged import BlockManager
from kvlab.check.core import _run
from kvlab.validate import cdiv


def kept_after(num_tokens: int, block_size: int, budget: int, sinks: int) -> list[int]:
    """The answer, by driving the real block manager: a sequence grows one token at a time from its
    first, and after every token the policy drops what it must (as the engine does after each step)."""
    policy = SinksWindow(budget, sinks=sinks)
    bm = BlockManager(cdiv(num_tokens, block_size) + 1, block_size, enable_prefix_caching=False)
    bm.allocate(0, [7])
    for n in range(1, num_tokens + 1):
        if n > 1:
            bm.append_slot(0, 7)
        bm.evict(0, policy.choose(bm.logical_blocks(0), n, 1, block_size))
    return bm.logical_blocks(0)


def _cases():
    shapes = [(200, 16, 64, 4),  # 13 blocks, 4 kept: the sink block + the last 3 (the one being written among them)
              (40, 16, 64, 4),  # 3 blocks, under the budget: nothing dropped
              (64, 16, 64, 4),  # exactly 4 full blocks: still under the budget
              (65, 16, 64, 4),  # a fifth block opens: one must go
              (300, 16, 100, 4),  # a budget that is not a whole number of blocks
              (120, 4, 24, 10),  # sinks longer than a block: 3 sink blocks
              (500, 16, 256, 16),  # sinks exactly one block
              (33, 1, 8, 4)]  # block size 1: the token-level rule
    return [(a, kept_after(*a)) for a in shapes]


def sinks_window_blocks(fn: Callable[[int, int, int, int], list]) -> bool:
    """``fn(num_tokens, block_size, budget, sinks)`` -> the logical blocks (ascending) that sinks + window
    keeps once the sequence holds ``num_tokens`` tokens, the policy acting after every token."""
    cases = _cases()

    def rule(sink_blocks, budget_blocks, window_adjust=0, blocks=True):
        def f(n, bs, budget, sinks):
            total = cdiv(n, bs)
            b, s = budget_blocks(budget, bs), sink_blocks(sinks, bs)
            keep = list(range(total)) if total <= b else sorted(set(range(min(s, total))) | set(
                range(max(0, total - (b - s) - window_adjust), total)))
            return keep if blocks else [p for lb in keep for p in range(lb * bs, min(n, lb * bs + bs))]
        return f

    ceil_sinks, floor_budget = (lambda s, bs: cdiv(s, bs)), (lambda b, bs: b // bs)
    mistakes = [
        (rule(lambda s, bs: s, floor_budget), "the sinks are tokens: they sit in ceil(sinks / block_size) blocks"),
        (rule(lambda s, bs: s // bs, floor_budget),
         "sinks shorter than a block still take a whole block: ceil(sinks / block_size), not floor"),
        (rule(ceil_sinks, lambda b, bs: b), "the budget is in tokens: it holds budget // block_size blocks"),
        (rule(ceil_sinks, lambda b, bs: cdiv(b, bs)),
         "a budget that is not a whole number of blocks rounds down: a partial block would overshoot it"),
        (rule(ceil_sinks, floor_budget, window_adjust=1),
         "the block being written counts towards the budget: the window has budget_blocks - sink_blocks blocks "
         "including it"),
        (rule(ceil_sinks, floor_budget, window_adjust=-1), "the window is budget_blocks - sink_blocks blocks, "
                                                           "the one being written among them"),
        (rule(ceil_sinks, floor_budget, blocks=False),
         "return logical block indices (position // block_size), not token positions"),
    ]

    def hint(args, got, expected):
        for formula, why in mistakes:
            if formula(*args) == got and formula(*args) != expected:
                return why
        if list(got) != sorted(got):
            return "return the blocks in ascending order"
        return None

    return _run("sinks_window_blocks", fn, cases, same=lambda a, b: list(a) == list(b), hint=hint, reveal=False)
