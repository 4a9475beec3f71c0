"""Notebook 07's build tasks: which blocks sinks + window keeps after n tokens (Task 1), H2O's choice of
blocks (Task 2), copy a block back from the host or recompute it (Task 3)."""

from __future__ import annotations

import math
from typing import Callable

from kvlab.engine.fleet import GPU_FLOPS, LINKS, prefill_flops
from kvlab.cache.evict import SinksWindow
from kvlab.cache.evict import h2o_keep as ref_h2o_keep
from kvlab.cache.paged import BlockManager
from kvlab.check.core import run_task
from kvlab.sizing import kv_bytes_per_token, kv_config
from kvlab.validate import cdiv


def kept_after(num_tokens: int, block_size: int, budget: int, sinks: int) -> list[int]:
    """The answer from the real block manager, the policy dropping blocks after every token."""
    policy = SinksWindow(budget, sinks=sinks)
    bm = BlockManager(cdiv(num_tokens, block_size) + 1, block_size, enable_prefix_caching=False)
    bm.allocate(0, [7])
    for n in range(1, num_tokens + 1):
        if n > 1:
            bm.append_slot(0, 7)
        bm.evict(0, policy.choose(bm.logical_blocks(0), n, 1, block_size))
    return bm.logical_blocks(0)


#: (num_tokens, block_size, budget, sinks) of the sinks + window task
_SHAPES = [(200, 16, 64, 4),  # 13 blocks, 4 kept: the sink block + the last 3 (the one being written among them)
           (40, 16, 64, 4),  # 3 blocks, under the budget: nothing dropped
           (64, 16, 64, 4),  # exactly 4 full blocks: still under the budget
           (65, 16, 64, 4),  # a fifth block opens: one must go
           (300, 16, 100, 4),  # a budget that is not a whole number of blocks
           (120, 4, 24, 10),  # sinks longer than a block: 3 sink blocks
           (500, 16, 256, 16),  # sinks exactly one block
           (33, 1, 8, 4)]  # block size 1: the token-level rule


def sinks_window_blocks(fn: Callable[[int, int, int, int], list]) -> bool:
    """``fn(num_tokens, block_size, budget, sinks)`` -> the logical blocks sinks + window keeps, ascending."""
    cases = [(a, kept_after(*a)) for a in _SHAPES]
    def rule(sink_blocks, budget_blocks, window_adjust=0, blocks=True, span=cdiv):
        def f(n, bs, budget, sinks):
            total = span(n, bs)
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
        (rule(ceil_sinks, floor_budget, span=lambda n, bs: n // bs),
         "a sequence of num_tokens tokens spans ceil(num_tokens / block_size) blocks: its partly filled last block "
         "is held too (it is the block being written)"),
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
    return run_task("sinks_window_blocks", fn, cases, same=lambda a, b: list(a) == list(b), hint=hint)


# ---- Task 2: copy a block back, or compute it again? -------------------------------------------------

def copy_and_recompute(tokens: int, cfg, link_bytes_per_s: float, flops_per_s: float) -> tuple[float, float]:
    """The answer: seconds to copy ``tokens`` tokens' FP16 K and V over the link, and seconds to
    recompute them by a prefill (2 FLOPs per parameter per token, attention left out), both at peak:
    the arithmetic of :func:`kvlab.engine.fleet.tier_projection`."""
    return tokens * kv_bytes_per_token(cfg, "fp16") / link_bytes_per_s, prefill_flops(cfg, tokens) / flops_per_s


#: (tokens, model, link) of the copy-or-recompute task
_COPY_SHAPES = [(1024, "llama-3-8b", LINKS["PCIe 4.0 x16"]),  # GQA, 8 KV heads: the copy wins
                (1024, "llama-2-7b", LINKS["PCIe 4.0 x16"]),  # no GQA: four times the bytes, about even
                (4096, "qwen2.5-7b", LINKS["PCIe 5.0 x16"]),  # 4 KV heads of 28
                (256, "smollm2-135m", LINKS["NVLink-C2C (GH200)"]),  # a tiny model: recomputing is cheap
                (1, "llama-2-70b", LINKS["PCIe 4.0 x16"])]


def copy_or_recompute(fn: Callable) -> bool:
    """``fn(tokens, cfg, link_bytes_per_s, flops_per_s)`` -> ``(copy_seconds, recompute_seconds)``: FP16 K/V
    over the link, or a prefill at 2 FLOPs per parameter per token, both at peak."""
    cases = [((n, kv_config(m), bw, GPU_FLOPS[1]), copy_and_recompute(n, kv_config(m), bw, GPU_FLOPS[1]))
             for n, m, bw in _COPY_SHAPES]
    def close(a, b):
        return (isinstance(a, (tuple, list)) and len(a) == 2 and all(isinstance(x, (int, float)) for x in a)
                and all(abs(x - y) <= 1e-6 * abs(y) for x, y in zip(a, b)))
    def hint(args, got, expected):
        if not (isinstance(got, (tuple, list)) and len(got) == 2):
            return "return two numbers: (copy seconds, recompute seconds)"
        (c, r), (ce, re_) = got, expected
        n, cfg, bw, flops = args
        if close((r, c), expected):
            return "the order is (copy seconds, recompute seconds)"
        # (ratio yours / expected, the mistake behind it); the first that fits is named
        copy_why = [(0.5, "a factor of 2 is missing: a token stores K and V (two tensors per layer), each element "
                          "2 bytes in FP16"),
                    (2.0, "a factor of 2 too many: FP16 is 2 bytes per element (not 4), and K and V count once each"),
                    (8.0, "the link is in bytes per second already (PCIe 4.0 x16: 32 GB/s), not bits"),
                    (1 / cfg.num_layers, "every layer stores its own K and V: multiply by the layers"),
                    (cfg.num_heads / cfg.num_kv_heads, "the cache holds num_kv_heads heads (GQA), not num_heads"),
                    (1 / cfg.head_dim, "each head stores head_dim numbers per token"),
                    (1 / n, "every one of the tokens crosses the link: multiply the bytes per token by tokens"),
                    (0.25, "K and V, 2 bytes each: the factor is 2 x 2")]
        recompute_why = [(0.5, "a multiply-add is 2 FLOPs: 2 x parameters per token"),
                         (3.0, "6 x parameters is training (forward + backward); a prefill is the forward only, 2 x"),
                         (1 / n, "the prefill recomputes every one of the tokens: multiply by tokens")]
        for yours, want, mistakes in ((c, ce, copy_why), (r, re_, recompute_why)):
            if yours and want and not math.isclose(yours, want, rel_tol=1e-6):
                for f, why in mistakes:
                    if math.isclose(yours / want, f, rel_tol=1e-6):
                        return why
        return None
    return run_task("copy_or_recompute", fn, cases, same=close, hint=hint)


#: (logical, budget, recent, scores): gaps from earlier evictions, ties, a heavy block among the recent
_H2O_CASES = [([0, 1, 2, 3, 4, 5, 6, 7], 4, 2, {0: 9.0, 1: 1.0, 2: 5.0, 3: 0.5, 4: 2.0, 5: 3.0, 6: 8.0, 7: 0.1}),
              ([0, 2, 5, 6, 9, 10, 11], 4, 2, {0: 7.0, 2: 7.0, 5: 9.0, 6: 1.0, 9: 4.0, 10: 0.0, 11: 50.0}),
              ([0, 3, 4, 8, 9, 12, 13, 14, 15], 6, 3, {0: 3.0, 3: 1.0, 4: 3.0, 8: 2.0, 9: 2.5, 12: 0.2, 13: 9.0,
                                                       14: 1.0, 15: 0.0}),
              ([1, 2, 3, 4, 5], 2, 1, {1: 0.0, 2: 0.0, 3: 0.0, 4: 0.0, 5: 0.0})]


def h2o_keep(fn: Callable) -> bool:
    """``fn(logical, budget, recent, scores)``: the ``recent`` newest, then the most-attended older blocks
    (ties to the earlier), ``budget`` in all."""
    cases = [(a, ref_h2o_keep(*a)) for a in _H2O_CASES]
    def run(logical, budget, recent, scores):
        got = fn(list(logical), budget, recent, dict(scores))
        return sorted(got) if isinstance(got, (list, tuple)) else got
    def hint(args, got, expected):
        logical, budget, recent, scores = args
        if not isinstance(got, list):
            return "return a list of block ids"
        top_all = sorted(logical, key=lambda b: (-scores[b], b))[:budget - recent]
        if sorted(set(logical[-recent:]) | set(top_all)) == got:
            return "choose the heavy blocks among the OLDER ones only (logical[:-recent]): the recent ones are kept anyway"
        if len(got) != len(expected):
            return f"keep budget blocks in all ({budget} here): the recent ones and the heaviest older ones"
        if not set(logical[-recent:]) <= set(got):
            return "the recent newest blocks stay whatever their scores: logical[-recent:]"
        lightest = sorted(logical[:-recent], key=lambda b: (scores[b], b))[:budget - recent]
        if sorted(logical[-recent:] + lightest) == got:
            return "keep the blocks that received the MOST attention"
        return "on equal scores the earlier block wins: sort by (-score, block)"
    return run_task("h2o_keep", run, cases, hint=hint, learner=fn)
