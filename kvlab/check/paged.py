"""Notebook 02's exercises: block table -> slots, blocks held by forked samples."""

from __future__ import annotations

from typing import Callable, Sequence


from kvlab.cache import BlockManager
from kvlab.cache.simulate import fork_blocks
from kvlab.validate import cdiv
from kvlab.check.core import _run


def slot_mapping(fn: Callable[[Sequence[int], int, int, int], list]) -> bool:
    """``fn(block_table, block_size, start, end) -> slots of tokens start..end-1``."""
    cases = []
    for bs, lengths in ((1, (3,)), (4, (10, 3)), (16, (40, 1, 16)), (8, (64,))):
        bm = BlockManager(64, bs)
        for i, n in enumerate(lengths):
            bm.allocate(i, [7] * n)
        for i, n in enumerate(lengths):
            for start, end in ((0, n), (n - 1, n), (n // 2, n)):
                cases.append(((bm.block_table(i), bs, start, end), bm.slot_mapping(i, start, end)))
    # tables whose blocks are scattered and out of order, as after requests have come and gone
    for table, bs, n in (([7, 2, 9, 0], 4, 14), ([5, 3], 16, 20), ([11, 4, 6], 8, 24)):
        for start, end in ((0, n), (n - 1, n), (n // 2, n)):
            cases.append(((table, bs, start, end), BlockManager.slot_mapping_of(table, bs, start, end)))
    def hint(args, got, expected):
        table, bs, start, end = args
        try:
            got = list(got)
        except TypeError:
            return "return a list of slot numbers, one per token"
        if got == [table[i // bs] + i % bs for i in range(start, end)]:
            return "a block id counts blocks, a slot counts tokens: block id x block_size + offset"
        if got == [table[i // bs] * bs + i % bs for i in range(0, end - start)]:
            return "the tokens are start..end-1, not 0..end-start-1"
        if got == [table[0] * bs + i for i in range(start, end)]:
            return ("the blocks need not follow one another: look up token t's own block, "
                    "block_table[t // block_size], for every token")
        if got == [i for i in range(start, end)]:
            return "the block table says where each block lives: slots are not the token positions"
        return None

    # reveal=False: the first case is block size 1, whose answer (slot = position) would mislead
    return _run("slot_mapping", fn, cases, same=lambda a, b: list(a) == b, hint=hint, reveal=False)


def blocks_after_fork(fn: Callable[[int, int, int, int], int]) -> bool:
    """``fn(prompt_len, block_size, n, steps)``: physical blocks held after a prompt is forked into
    ``n`` samples (the original counts as one) and each sample writes ``steps`` new tokens."""
    shapes = [(37, 16, 4, 20), (10, 4, 3, 1), (8, 4, 2, 5), (5, 16, 6, 11), (5, 16, 6, 12), (32, 16, 3, 1),
              (100, 16, 1, 30), (10, 4, 3, 0)]
    cases = [(a, fork_blocks(*a)) for a in shapes]

    def follows(formula) -> bool:  # the learner's function agrees with a mistaken formula on every shape
        try:
            return all(fn(*a) == formula(*a) for a in shapes)
        except Exception:  # noqa: BLE001  (the learner's error is reported by _run, not here)
            return False

    fresh = lambda p, bs, n, steps: cdiv(p, bs) + n * cdiv(steps, bs) if steps else cdiv(p, bs)  # noqa: E731
    n_copies = lambda p, bs, n, steps: fork_blocks(p, bs, n, steps) + (1 if steps and p % bs else 0)  # noqa: E731

    def hint(args, got, expected):
        p, bs, n, steps = args
        if got == n * cdiv(p + steps, bs):
            return "the samples share the prompt's full blocks: count those once"
        if steps and p % bs and got == cdiv(p, bs) + n * (cdiv(p + steps, bs) - cdiv(p, bs)):
            return "the prompt's partial last block: a sample's first write copies it (copy-on-write)"
        if steps == 0 and got > expected:
            return "nobody writes, so nothing is copied: every block is still shared"
        # these two agree on most shapes: the whole function tells them apart
        if steps and p % bs and got == fresh(*args) and follows(fresh):
            return ("a sample's new tokens fill the prompt's partial last block first (its own copy of it), "
                    "then new blocks: they do not start in a fresh block")
        if steps and p % bs and got == expected + 1 and follows(n_copies):
            return "n - 1 copies, not n: the last sample to write finds the block no longer shared and keeps it"
        return None

    return _run("blocks_after_fork", fn, cases, hint=hint, reveal=False)
