"""Paged cache: block manager rules, storage, reference attention, and token identity with HF."""

import pytest
import torch

from kvlab.attention import attend, gather_kv, paged_attention
from kvlab.cache import BlockManager, OutOfBlocksError, PagedKVCache, block_hash
from kvlab.generate import greedy_generate, hf_generate, paged_generate

# ---- block manager ---------------------------------------------------------------------------------


def test_allocate_on_demand_and_slot_mapping():
    bm = BlockManager(8, block_size=4)
    assert bm.allocate(0, range(10, 16)) == 0  # 6 tokens -> 2 blocks
    t = bm.block_table(0)
    assert len(t) == 2
    assert bm.slot_mapping(0) == [t[0] * 4 + i for i in range(4)] + [t[1] * 4, t[1] * 4 + 1]
    assert bm.append_slot(0, 99) == t[1] * 4 + 2  # room in the last block: no new block
    assert bm.append_slot(0, 98) == t[1] * 4 + 3
    assert len(bm.block_table(0)) == 2
    bm.append_slot(0, 97)  # last block full: a new one
    assert len(bm.block_table(0)) == 3
    s = bm.stats()
    assert s["blocks_used"] == 3 and s["tokens_stored"] == 9
    assert s["empty_slot_share"] == pytest.approx(1 - 9 / 12)
    assert s["empty_slots"] == 12 - 9
    bm.check_invariants()


def test_can_allocate_and_can_append_predict_success():
    bm = BlockManager(3, block_size=4)
    assert bm.can_allocate(range(12)) and not bm.can_allocate(range(13))
    bm.allocate(0, range(8))
    assert bm.can_allocate([1, 2, 3])
    bm.allocate(1, [9, 9, 9])
    assert bm.can_append(1)  # room in its last block
    bm.append_slot(1, 9)
    assert not bm.can_append(1)  # full block and an empty pool
    with pytest.raises(OutOfBlocksError):
        bm.append_slot(1, 9)
    bm.free(0)
    assert bm.can_append(1)  # freed blocks (cached or free) can be taken
    # a prefix hit needs fewer new blocks: one free block admits a request that shares two
    bm2 = BlockManager(4, block_size=2)
    bm2.allocate(0, [1, 2, 3, 4, 5])
    assert not bm2.can_allocate([7, 8, 9]) and bm2.can_allocate([1, 2, 3, 4, 6])
    bm2.check_invariants()


def test_free_returns_tail_first():
    bm = BlockManager(4, block_size=2, enable_prefix_caching=False)
    bm.allocate(0, [1, 2, 3, 4, 5])
    table = bm.block_table(0)
    bm.free(0)
    assert list(bm.free_ids)[-3:] == table[::-1]
    bm.check_invariants()


def test_out_of_blocks_is_specific_and_changes_nothing():
    bm = BlockManager(3, block_size=4)
    bm.allocate(0, range(8))
    before = (list(bm.free_ids), dict(bm.cached_ids), bm.stats())
    with pytest.raises(OutOfBlocksError, match="needs 2 block"):
        bm.allocate(1, range(100, 108))
    assert (list(bm.free_ids), dict(bm.cached_ids), bm.stats()) == before
    assert 1 not in bm.seqs
    bm.allocate(2, [7])
    for t in range(3):
        bm.append_slot(2, t)
    with pytest.raises(OutOfBlocksError) as e:
        bm.append_slot(2, 42)
    assert e.value.needed == 1 and e.value.available == 0
    assert bm.num_tokens(2) == 4  # the refused token was not recorded
    bm.check_invariants()


@pytest.mark.parametrize("bad", [0, 3, 12, 512, -16, 1.5, True, "16"])
def test_invalid_block_size(bad):
    with pytest.raises(ValueError, match="block_size must be a power of two from 1 to 256"):
        BlockManager(4, block_size=bad)


def test_double_free_append_after_finish_unknown_sequence():
    bm = BlockManager(4, block_size=4)
    bm.allocate(0, [1, 2, 3])
    bm.free(0)
    with pytest.raises(ValueError, match="sequence 0 is finished"):
        bm.free(0)
    with pytest.raises(ValueError, match="sequence 0 is finished"):
        bm.append_slot(0, 5)
    with pytest.raises(ValueError, match="sequence 7 is not allocated"):
        bm.append_slot(7, 5)
    with pytest.raises(ValueError, match="already allocated"):
        bm.allocate(1, [1]) or bm.allocate(1, [2])
    with pytest.raises(ValueError, match="must not be empty"):
        bm.allocate(2, [])
    bm.check_invariants()


def test_prefix_hits_share_full_blocks_but_never_the_last_prompt_token():
    bm = BlockManager(16, block_size=4)
    system = list(range(100, 112))  # 3 full blocks
    assert bm.allocate(0, system + [1, 2]) == 0
    assert bm.allocate(1, system + [7, 8, 9]) == 12  # all three shared
    assert bm.block_table(1)[:3] == bm.block_table(0)[:3]
    assert bm.stats()["blocks_shared"] == 3
    # the prompt IS the system prompt: its last block holds the last token, so only 2 blocks hit
    assert bm.allocate(2, system) == 8
    s = bm.stats()
    assert s["prefix_hits"] == 3 + 2 and s["prefix_queries"] == 3 + 3 + 2
    assert s["blocks_saved"] == 5
    bm.check_invariants()


def test_freed_blocks_stay_cached_until_evicted_lru():
    bm = BlockManager(4, block_size=2)
    bm.allocate(0, [1, 2, 3, 4, 5])  # blocks: [1,2] [3,4] [5]
    bm.free(0)
    assert bm.stats()["blocks_cached"] == 2  # the two full blocks keep their hashes
    assert bm.allocate(1, [1, 2, 3, 4, 9]) == 4  # both reused after free
    bm.free(1)
    bm.allocate(2, list(range(50, 58)))  # 4 blocks: needs every block, evicting the cached ones
    assert bm.counters["evictions"] == 2
    assert bm.stats()["blocks_cached"] == 0
    bm.free(2)
    assert bm.allocate(3, [1, 2, 3, 4, 9]) == 0  # evicted: no hit any more
    bm.check_invariants()


def test_hash_collision_is_not_a_hit():
    bm = BlockManager(8, block_size=2)
    bm.allocate(0, [1, 2, 3])
    h = bm.seqs[0].hashes[0]
    bm.blocks[bm.hash_to_block[h]].token_ids = (9, 9)  # pretend another block landed on this hash
    assert bm.allocate(1, [1, 2, 3]) == 0


def test_hash_chain_depends_on_the_parent():
    assert block_hash(None, [1, 2]) != block_hash(block_hash(None, [0, 0]), [1, 2])
    assert block_hash(None, [1, 2]) == block_hash(None, (1, 2))


def test_fork_shares_blocks_and_copies_the_partial_block_on_write():
    bm = BlockManager(8, block_size=4)
    bm.allocate(0, range(6))  # one full block, one partial (2 of 4)
    bm.fork(0, 1)
    assert bm.block_table(1) == bm.block_table(0)
    assert bm.stats()["blocks_shared"] == 2
    shared_partial = bm.block_table(0)[1]
    slot = bm.append_slot(1, 42)
    copies = bm.take_blocks_to_copy()
    new = bm.block_table(1)[1]
    assert copies == [(shared_partial, new)] and new != shared_partial
    assert slot == new * 4 + 2
    assert bm.block_table(1)[0] == bm.block_table(0)[0]  # the full block stays shared
    bm.append_slot(0, 43)  # the parent now owns its partial block alone: no copy
    assert bm.take_blocks_to_copy() == []
    bm.free(0)
    bm.free(1)
    bm.check_invariants()
    assert bm.stats()["blocks_used"] == 0


# ---- storage and reference attention --------------------------------------------------------------


def test_storage_write_gather_and_copy():
    c = PagedKVCache(num_layers=2, num_blocks=4, block_size=4, num_kv_heads=2, head_dim=8)
    k, v = torch.randn(6, 2, 8), torch.randn(6, 2, 8)
    table = [2, 0]
    slots = torch.tensor([table[t // 4] * 4 + t % 4 for t in range(6)])
    c.write(1, k, v, slots)
    gk, gv = c.gather(1, table, 6)
    assert torch.equal(gk, k) and torch.equal(gv, v)
    c.copy_blocks([(0, 3)])
    assert torch.equal(c.k_cache[1][3], c.k_cache[1][0])
    with pytest.raises(ValueError, match="slot_mapping"):
        c.write(0, k, v, slots[:3])
    assert c.bytes_reserved == 2 * 2 * 4 * 4 * 2 * 8 * 4


def dense_reference(q, k, v, scale):
    """Naive causal GQA attention in float64 for one sequence: q (q_len, Hq, D), k/v (ctx, Hkv, D)."""
    q_len, hq, d = q.shape
    ctx, hkv, _ = k.shape
    k = k.repeat_interleave(hq // hkv, dim=1).double()
    v = v.repeat_interleave(hq // hkv, dim=1).double()
    s = torch.einsum("qhd,khd->hqk", q.double(), k) * scale
    pos = torch.arange(ctx - q_len, ctx)[:, None]
    s = s.masked_fill(torch.arange(ctx)[None, :] > pos, float("-inf"))
    return torch.einsum("hqk,khd->qhd", s.softmax(-1), v)


@pytest.mark.parametrize("block_size", [1, 4, 16])
@pytest.mark.parametrize("hq,hkv", [(4, 4), (4, 2), (6, 1)])
def test_paged_attention_matches_dense_on_ragged_batches(block_size, hq, hkv):
    torch.manual_seed(block_size * 10 + hq + hkv)
    d, num_blocks = 8, 64
    kc = torch.full((num_blocks, block_size, hkv, d), float("nan"))  # poisoned: any stray read shows
    vc = torch.full_like(kc, float("nan"))
    ctxs, qlens = [1, 7, 23, 16], [1, 3, 23, 1]
    free = torch.randperm(num_blocks).tolist()
    tables, dense = [], []
    for ctx in ctxs:
        n = -(-ctx // block_size)
        table, free = free[:n], free[n:]
        k, v = torch.randn(ctx, hkv, d), torch.randn(ctx, hkv, d)
        slots = torch.tensor([table[t // block_size] * block_size + t % block_size for t in range(ctx)])
        kc.view(-1, hkv, d)[slots], vc.view(-1, hkv, d)[slots] = k, v
        tables.append(table)
        dense.append((k, v))
    q = torch.randn(sum(qlens), hq, d)
    out = paged_attention(q, kc, vc, tables, ctxs, qlens, scale=d ** -0.5)
    start = 0
    for (k, v), ql in zip(dense, qlens):
        ref = dense_reference(q[start:start + ql], k, v, d ** -0.5)
        torch.testing.assert_close(out[start:start + ql].double(), ref, atol=1e-5, rtol=1e-5)
        start += ql
    assert not out.isnan().any()


def test_gather_reads_only_the_needed_blocks():
    kc = torch.arange(4 * 2 * 1 * 1, dtype=torch.float32).view(4, 2, 1, 1)
    k, _ = gather_kv(kc, kc, [3, 1, 0], 3)
    assert k.flatten().tolist() == [6.0, 7.0, 2.0]


def test_attend_rejects_bad_gqa():
    with pytest.raises(ValueError, match="multiple of KV heads"):
        attend(torch.randn(1, 3, 4), torch.randn(2, 2, 4), torch.randn(2, 2, 4), 0.5)


# ---- token identity -----------------------------------------------------------------------------------

PROMPTS = [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [100] * 12, [200 + i % 50 for i in range(60)]]


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_paged_generation_matches_hf(tiny, block_size):
    model, _ = tiny
    ref = hf_generate(model, PROMPTS, 20)
    assert paged_generate(model, PROMPTS, 20, block_size=block_size).token_ids == ref
    assert greedy_generate(model, PROMPTS, 20, cache="paged", block_size=block_size).token_ids == ref


def test_paged_eos_stops_each_sequence_and_frees_its_blocks(tiny):
    model, _ = tiny
    free = hf_generate(model, PROMPTS, 20)
    eos = free[0][2]
    bm = BlockManager(64, 4)
    g = paged_generate(model, PROMPTS, 20, eos_token_id=eos, manager=bm)
    assert g.token_ids == hf_generate(model, PROMPTS, 20, eos_token_id=eos)
    assert bm.stats()["blocks_used"] == 0 and not bm.seqs
    bm.check_invariants()


SYSTEM = [30 + (i * 7) % 200 for i in range(40)]


@pytest.mark.parametrize("block_size", [1, 16, 64])
def test_second_request_hits_the_shared_system_prompt(tiny, block_size):
    model, _ = tiny
    a, b = SYSTEM + [1, 2, 3, 4, 5], SYSTEM + [9, 8, 7]
    bm = BlockManager(256, block_size)
    cache = PagedKVCache.from_model(model, 256, block_size)
    ga = paged_generate(model, [a], 12, manager=bm, cache=cache)
    gb = paged_generate(model, [b], 12, manager=bm, cache=cache)
    assert ga.token_ids == hf_generate(model, [a], 12)
    assert gb.token_ids == hf_generate(model, [b], 12)
    assert gb.cache_stats["cached_prompt_tokens"] == (40 // block_size) * block_size
    bm.check_invariants()


def test_prefix_hit_inside_one_batch(tiny):
    model, _ = tiny
    a, b = SYSTEM + [1, 2, 3, 4, 5], SYSTEM + [9, 8, 7]
    g = paged_generate(model, [a, b], 12, block_size=16)
    assert g.token_ids == hf_generate(model, [a, b], 12)
    assert g.cache_stats["prefix_hits"] == 2 and g.cache_stats["blocks_saved"] == 2


def test_a_pool_too_small_for_one_request_is_refused_up_front(tiny):
    model, _ = tiny
    bm = BlockManager(3, 4)
    with pytest.raises(ValueError, match="needs 6 blocks of 4 tokens; the whole pool has 3"):
        paged_generate(model, [[5, 6, 7], [8, 9]], 20, manager=bm)
    assert not bm.seqs and bm.stats()["blocks_used"] == 0
    bm.check_invariants()


def test_a_pool_too_small_for_all_at_once_preempts_and_still_matches_hf(tiny):
    model, _ = tiny
    bm = BlockManager(6, 4)  # one request fits (<= 23 tokens), two do not
    g = paged_generate(model, [[5, 6, 7], [8, 9]], 20, manager=bm)
    assert g.token_ids == hf_generate(model, [[5, 6, 7], [8, 9]], 20)
    assert not bm.seqs and bm.stats()["blocks_used"] == 0
    bm.check_invariants()
