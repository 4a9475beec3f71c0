"""Notebook 02's build tasks: slots, growth with copy-on-write, the prefix lookup, forked samples' blocks."""

from __future__ import annotations

from typing import Callable, Sequence

from kvlab.cache import BlockManager
from kvlab.cache.paged import append_slot as ref_append_slot
from kvlab.cache.paged import block_hash, prefix_hits as ref_prefix_hits
from kvlab.cache.simulate import fork_blocks
from kvlab.validate import cdiv
from kvlab.check.core import run_task


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
    # and a long one: notebook 06's capstone grows tables past 8 blocks (a part capped there passed once)
    long = [(13 * k + 5) % 64 for k in range(12)]
    for table, bs, n in (([7, 2, 9, 0], 4, 14), ([5, 3], 16, 20), ([11, 4, 6], 8, 24), (long, 16, 180)):
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
    return run_task("slot_mapping", fn, cases, same=lambda a, b: list(a) == b, hint=hint)


def blocks_after_fork(fn: Callable[[int, int, int, int], int]) -> bool:
    """``fn(prompt_len, block_size, n, steps)``: physical blocks held after ``n`` samples (the original
    counts as one) write ``steps`` tokens each."""
    shapes = [(37, 16, 4, 20), (10, 4, 3, 1), (8, 4, 2, 5), (5, 16, 6, 11), (5, 16, 6, 12), (32, 16, 3, 1),
              (100, 16, 1, 30), (10, 4, 3, 0)]
    cases = [(a, fork_blocks(*a)) for a in shapes]
    def follows(formula) -> bool:  # the learner's function agrees with a mistaken formula on every shape
        try:
            return all(fn(*a) == formula(*a) for a in shapes)
        except Exception:  # noqa: BLE001  (the learner's error is reported by run_task, not here)
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
    return run_task("blocks_after_fork", fn, cases, hint=hint)


def _append_run(fn):
    # named as the task's arguments, so a failing case prints block_table=[3, 8], num_tokens=6, ...; the last
    # two are given as what ref_count and take_block see: the shared blocks and the free list
    def run(block_table, num_tokens, block_size, shared_blocks, free_blocks):
        table, n, bs, shared, free = block_table, num_tokens, block_size, shared_blocks, free_blocks
        table, free, taken = list(table), list(free), []
        def take_block():
            taken.append(free.pop(0))
            return taken[-1]
        out = fn(table, n, bs, lambda b: 2 if b in shared else 1, take_block)
        slot, copy = tuple(out) if isinstance(out, (tuple, list)) and len(out) == 2 else (out, "?")
        return slot, copy, table, len(taken)
    return run


def append_slot(fn: Callable) -> bool:
    """``fn(block_table, num_tokens, block_size, ref_count, take_block) -> (slot, copy)``, ``block_table``
    changed in place; ``copy`` is the (src, dst) copy-on-write pair, or None."""
    shapes = [([3], 2, 4, (), [7, 1]), ([3], 4, 4, (), [7, 1]), ([], 0, 4, (), [5, 1]), ([3, 8], 6, 4, {8}, [9, 1]),
              ([3, 8], 8, 4, {8}, [9, 1]), ([3, 8], 5, 4, {3}, [9, 1]), ([12, 4, 6], 40, 16, (), [2, 1]),
              ([12, 4, 6], 33, 16, {6}, [2, 1])]  # (table, num_tokens, block_size, shared blocks, free blocks)
    cases = [(a, _append_run(ref_append_slot)(*a)) for a in shapes]
    def hint(args, got, expected):
        table, n, bs, shared, free = args
        slot, copy, after, taken = got
        full = n % bs == 0
        if copy == "?":
            return "return two things: (slot, copy), copy being None or the (src, dst) pair"
        if isinstance(copy, (tuple, list)) and expected[1] is not None and tuple(copy) == tuple(reversed(expected[1])):
            return ("copy is (src, dst): the shared block you copy FROM first, then the fresh block you copy TO "
                    "(the one now in block_table)")
        if full and copy is not None:
            return "a full block is never written again, so sharing it is fine: take a fresh block, copy nothing"
        if full and taken == 0:
            return "the last block is full (num_tokens % block_size == 0): take a new block with take_block()"
        if not full and table[-1] not in shared and taken:
            return "there is room in the last block: no new block"
        if not full and table[-1] in shared and copy is None:
            return ("the last block is shared (ref_count > 1): writing into it would change the other sequence's "
                    "tokens; take a fresh block, return (old, new) as copy, and write there")
        if not full and table[-1] in shared and len(after) == len(table) + 1 and after[:-1] == list(table):
            return ("replace the shared last block in block_table (block_table[-1] = the fresh block), do not append: "
                    "the fresh block is the shared one's copy and takes its place")
        if after == list(table) and expected[2] != list(table):
            return "change block_table itself (append, or replace the last entry): the manager reads it after your call"
        if slot != expected[0]:
            return "slot = the last block's id x block_size + the offset inside it (num_tokens % block_size)"
        return None
    return run_task("append_slot", _append_run(fn), cases, hint=hint, learner=fn)


def _cached(bs: int, *prompts, start: int = 100) -> dict:
    """A prefix cache holding every full block of these prompts: chained key -> block id."""
    cached = {}
    for p in prompts:
        parent = None
        for i in range(len(p) // bs):
            parent = block_hash(parent, p[i * bs:(i + 1) * bs])
            cached.setdefault(parent, start + len(cached))
    return cached


def _chain(tokens, bs: int, n: int):
    """The chained key of the first ``n`` full blocks of ``tokens``."""
    key = None
    for i in range(n):
        key = block_hash(key, tokens[i * bs:(i + 1) * bs])
    return key


def prefix_hits(fn: Callable) -> bool:
    """``fn(token_ids, block_size, cached, block_hash) -> the cached blocks of the prompt's leading full blocks``."""
    a = list(range(1, 41))  # 40 tokens: 10 blocks of 4
    c = [50, 51, 52, 53] + a[4:20]  # a's blocks 1-4 after another first block
    cases = []
    for bs, cached, query in ((4, _cached(4, a), a), (4, _cached(4, a), a + [99]), (4, _cached(4, a), a[:22] + [7] * 9),
                              (4, _cached(4, a), c), (4, _cached(4, a, c), c + [1, 2]),
                              (4, _cached(4, a), a[:8] + [0, 0, 0, 0] + a[12:]), (16, _cached(16, a), a[:33]),
                              (4, {}, a)):
        cases.append(((query, bs, cached), ref_prefix_hits(query, bs, cached, block_hash)))
    # block 2's entry evicted while the blocks after it stay cached (an LRU can drop a parent before its
    # children): the walk must stop at the miss even though later chained keys would still hit
    gap = _cached(4, a)
    del gap[_chain(a, 4, 3)]
    cases.append(((a, 4, gap), ref_prefix_hits(a, 4, gap, block_hash)))
    def run(token_ids, block_size, cached):
        return fn(list(token_ids), block_size, dict(cached), block_hash)
    def unchained(query, bs, cached):
        out = []
        for i in range((len(query) - 1) // bs):
            k = block_hash(None, query[i * bs:(i + 1) * bs])
            if k not in cached:
                break
            out.append(cached[k])
        return out
    def hint(args, got, expected):
        query, bs, cached = args
        if not isinstance(got, (list, tuple)):
            return "return a list of block ids"
        got = list(got)
        if len(got) > len(expected) and got[:len(expected)] == expected and len(query) % bs == 0 \
                and len(got) == len(query) // bs:
            return ("leave the last prompt token out: its logits are needed for the first new token, so a prompt "
                    "that ends on a block boundary cannot take its last block from the cache")
        if got == unchained(query, bs, cached):
            return ("chain the keys: block i's key is block_hash(block i-1's key, its tokens), starting from None "
                    "- the same tokens after another prefix have other K/V")
        if len(got) > len(expected) and got[:len(expected)] == expected:
            return ("stop at the first miss: a block's K/V are only valid after every block before it, so a later "
                    "hit behind a miss cannot be used")
        if not got and expected:
            return ("no hit, though the cache holds the prompt's first block: the chain starts from None, block 0's "
                    "key is block_hash(None, its tokens)")
        return None
    return run_task("prefix_hits", run, cases, same=lambda x, y: isinstance(x, (list, tuple)) and list(x) == y,
                   hint=hint, learner=fn)
