"""Notebook 02's build tasks: the checkers name the planted mistakes, and the references plugged into a
BlockManager through the notebook's own calls keep the pool's invariants and HF generate()'s tokens."""

import pytest

from kvlab import check
from kvlab.cache import BlockManager, OutOfBlocksError, PagedKVCache
from kvlab.cache.paged import append_slot, block_hash, prefix_hits
from kvlab.generate import hf_generate, paged_generate


def stub(*args):
    raise NotImplementedError


def test_append_slot_checker_names_the_mistakes(capsys):
    assert check.append_slot(append_slot)

    def never_copies(table, n, bs, ref, take):
        if n % bs == 0:
            table.append(take())
        return table[-1] * bs + n % bs, None

    def copies_full_blocks(table, n, bs, ref, take):
        copy = None
        if ref(table[-1]) > 1 if table else False:
            copy = (table[-1], take())
            table[-1] = copy[1]
        if n % bs == 0:
            table.append(take())
        return table[-1] * bs + n % bs, copy

    def always_new(table, n, bs, ref, take):
        table.append(take())
        return table[-1] * bs + n % bs, None

    def reversed_copy(table, n, bs, ref, take):  # the pair the wrong way round: (dst, src)
        slot, copy = append_slot(table, n, bs, ref, take)
        return slot, copy[::-1] if copy else copy

    def appends_the_copy(table, n, bs, ref, take):  # copies the shared block, but appends the copy
        copy = None
        if n % bs == 0:
            table.append(take())
        elif ref(table[-1]) > 1:
            copy = (table[-1], take())
            table.append(copy[1])
        return table[-1] * bs + n % bs, copy

    for why, fn in {"the last block is shared": never_copies, "a full block is never written again": copies_full_blocks,
                    "room in the last block": always_new, "return two things": lambda *a: 3,
                    "copy is (src, dst)": reversed_copy, "replace the shared last block": appends_the_copy}.items():
        capsys.readouterr()
        assert not check.append_slot(fn)
        out = capsys.readouterr().out
        assert out.startswith("[fail] append_slot: ") and why in out, out
    assert not check.append_slot(stub)
    assert capsys.readouterr().out.startswith("[todo]")


def test_prefix_hits_checker_names_the_mistakes(capsys):
    assert check.prefix_hits(prefix_hits)

    def unchained(tokens, bs, cached, h):
        out = []
        for i in range((len(tokens) - 1) // bs):
            key = h(None, tokens[i * bs:(i + 1) * bs])
            if key not in cached:
                break
            out.append(cached[key])
        return out

    def unchained_past_a_miss(tokens, bs, cached, h):
        return [cached[k] for i in range((len(tokens) - 1) // bs) if (k := h(None, tokens[i * bs:(i + 1) * bs])) in cached]

    def last_token_too(tokens, bs, cached, h):
        out, parent = [], None
        for i in range(len(tokens) // bs):
            parent = h(parent, tokens[i * bs:(i + 1) * bs])
            if parent not in cached:
                break
            out.append(cached[parent])
        return out

    def past_a_miss(tokens, bs, cached, h):  # chained, but walks on after a miss
        out, parent = [], None
        for i in range((len(tokens) - 1) // bs):
            parent = h(parent, tokens[i * bs:(i + 1) * bs])
            if parent in cached:
                out.append(cached[parent])
        return out

    def chain_from_empty(tokens, bs, cached, h):  # block 0 chained to the hash of no tokens, not to None
        out, parent = [], h(None, [])
        for i in range((len(tokens) - 1) // bs):
            parent = h(parent, tokens[i * bs:(i + 1) * bs])
            if parent not in cached:
                break
            out.append(cached[parent])
        return out

    for why, fn in {"chain the keys": unchained, "chain the keys - ": unchained_past_a_miss,
                    "leave the last prompt token out": last_token_too, "stop at the first miss": past_a_miss,
                    "the chain starts from None": chain_from_empty}.items():
        capsys.readouterr()
        assert not check.prefix_hits(fn)
        out = capsys.readouterr().out
        assert out.startswith("[fail] prefix_hits: ") and why.removesuffix(" - ") in out, out


def test_slot_mapping_checker_names_the_mistakes(capsys):
    assert check.slot_mapping(BlockManager.slot_mapping_of)
    mistakes = {
        "the tokens are start..end-1": lambda t, bs, s, e: [t[i // bs] * bs + i % bs for i in range(0, e - s)],
        "block id x block_size + offset": lambda t, bs, s, e: [t[i // bs] + i % bs for i in range(s, e)],
        "block_table[t // block_size]": lambda t, bs, s, e: [t[0] * bs + i for i in range(s, e)],
    }
    for why, fn in mistakes.items():
        capsys.readouterr()
        assert not check.slot_mapping(fn)
        out = capsys.readouterr().out
        assert out.startswith("[fail] slot_mapping: ") and why in out, out


def test_a_failing_case_prints_its_arguments_by_name(capsys):
    def off_by_one(block_table, num_tokens, block_size, ref_count, take_block):
        slot, copy = append_slot(block_table, num_tokens, block_size, ref_count, take_block)
        return slot + 1, copy

    assert not check.append_slot(off_by_one)
    out = capsys.readouterr().out
    assert "For block_table=[3], num_tokens=2, block_size=4, shared_blocks=(), free_blocks=[7, 1]: yours" in out, out
    assert not check.prefix_hits(lambda tokens, bs, cached, h: [0])
    assert "For token_ids=[1, 2, 3" in capsys.readouterr().out


def test_the_references_plugged_in_keep_hf_tokens_and_the_invariants(tiny):
    model, _ = tiny
    prompts = [[5, 17, 3, 9, 11, 2, 8, 4, 6, 1, 12, 13, 14, 15, 16, 18, 19, 20], [5, 17, 3, 9, 11, 2, 8, 4, 7]]
    ref = hf_generate(model, prompts, 9)
    bm = BlockManager(32, 4, slot_mapping=BlockManager.slot_mapping_of, append=append_slot, prefix_match=prefix_hits)
    cache = PagedKVCache.from_model(model, 32, 4)
    out = paged_generate(model, prompts, 9, manager=bm, cache=cache)
    assert out.token_ids == ref
    bm.check_invariants()
    again = paged_generate(model, prompts[:1], 9, manager=bm, cache=cache)  # the first prompt's blocks are cached now
    assert again.token_ids == ref[:1] and again.cache_stats["cached_prompt_tokens"] == 16
    # the same story as kvlab's own code: fork, copy-on-write, the same tables and copies
    ours, theirs = BlockManager(16, 4, append=append_slot), BlockManager(16, 4)
    for bm in (ours, theirs):
        bm.allocate(0, list(range(10)))
        bm.fork(0, 1)
        for t in range(7):
            bm.append_slot(0, 50 + t), bm.append_slot(1, 60 + t)
        bm.check_invariants()
    assert ours.block_table(1) == theirs.block_table(1) and ours.take_blocks_to_copy() == theirs.take_blocks_to_copy()
    hits = BlockManager(16, 4, prefix_match=prefix_hits)
    plain = BlockManager(16, 4)
    for bm in (hits, plain):
        bm.allocate(0, list(range(13)))
        bm.free(0)
        assert bm.allocate(1, list(range(12)) + [99]) == 12


def test_a_wrong_function_plugged_in_is_refused_and_leaves_the_pool_as_it_was():
    bm = BlockManager(4, 4, append=lambda table, n, bs, ref, take: (take(), None))  # takes a block and forgets it
    bm.allocate(0, [1, 2, 3])
    free = bm.num_free_blocks
    with pytest.raises(ValueError, match="append returned slot .* not a consistent append"):
        bm.append_slot(0, 4)
    assert bm.num_free_blocks == free and bm.block_table(0) == [0] and bm.num_tokens(0) == 3
    bm.check_invariants()
    wrong = BlockManager(8, 4, prefix_match=lambda tokens, bs, cached, h: list(cached.values())[:1])
    wrong.allocate(0, [9] * 9)
    wrong.free(0)
    with pytest.raises(ValueError, match="prefix_match returned block"):
        wrong.allocate(1, [1] * 9)
    with pytest.raises(TypeError, match="slot_mapping must be a function"):
        BlockManager(4, 4, slot_mapping=[1, 2])
    with pytest.raises(ValueError, match="host_blocks"):
        BlockManager(4, 4, prefix_match=prefix_hits, host_blocks=2)
    full = BlockManager(1, 4, append=append_slot)
    full.allocate(0, [1, 2, 3, 4])
    with pytest.raises(OutOfBlocksError):
        full.append_slot(0, 5)
    assert full.block_table(0) == [0] and full.num_free_blocks == 0
