"""Workload simulation: the breakdown adds up, policies order as in the paper, paged uses the real manager."""

import pytest

from kvlab.cache import simulate
from kvlab.cache.simulate import Request


def test_breakdown_sums_to_one_and_policies_order():
    reqs = simulate.workload("sharegpt", 32, seed=3)
    res = {p: simulate.simulate(reqs, p) for p in simulate.POLICIES}
    for r in res.values():
        assert r["token_states"] + r["reservation"] + r["internal_fragmentation"] == pytest.approx(1)
    ts = [res[p]["token_states"] for p in ("max", "pow2", "oracle", "paged")]
    assert ts == sorted(ts)
    assert res["oracle"]["internal_fragmentation"] == 0
    assert res["paged"]["peak_slots"] < res["oracle"]["peak_slots"]


def test_single_request_by_hand():
    # 6-token prompt, 3 new tokens (the last never stored), max_seq_len 16: it holds 6, 7, 8 of its final 8
    r = simulate.simulate([Request(6, 3)], "max", max_seq_len=16)
    assert r["token_states"] == pytest.approx((6 + 7 + 8) / 48)
    assert r["reservation"] == pytest.approx((2 + 1 + 0) / 48)
    assert r["internal_fragmentation"] == pytest.approx(3 * 8 / 48)
    p = simulate.simulate([Request(6, 3)], "paged", block_size=4, max_seq_len=16)
    assert p["token_states"] == pytest.approx(21 / 24)  # two 4-slot blocks the whole time
    assert p["internal_fragmentation"] == 0
    p = simulate.simulate([Request(6, 4)], "paged", block_size=4, max_seq_len=16)
    # a third block at step 3 for the 9th token: 12 slots, 3 of which nothing will fill
    assert p["internal_fragmentation"] == pytest.approx(3 / (8 + 8 + 8 + 12))


def test_block_size_sweep_trades_fragmentation_for_table_size():
    rows = simulate.block_size_sweep(simulate.uniform(100, 40, 60, seed=0))
    frag = [r["waste_at_completion"] for r in rows]
    entries = [r["table_entries_per_seq"] for r in rows]
    assert frag[0] == 0 and frag == sorted(frag)
    assert entries == sorted(entries, reverse=True)


def test_parallel_sampling_shares_prompts():
    r = simulate.parallel_sampling([Request(32, 8)], n=4, block_size=16)
    # 2 shared prompt blocks + each sample's own block for its 8 new tokens
    assert r["blocks_with_fork"] == 2 + 4 and r["blocks_without"] == 4 * 3
    assert r["cow_copies"] == 0  # the prompt ends on a block boundary: nothing partial to copy


@pytest.mark.parametrize("call,match", [
    (lambda: simulate.workload("reddit"), "workload must be one of"),
    (lambda: simulate.simulate([Request(4, 4)], "buddy"), "policy must be one of"),
    (lambda: simulate.simulate([Request(4000, 4)], "max"), "longer than max_seq_len"),
    (lambda: simulate.uniform(3, 10, 5), "lo <= hi"),
])
def test_bad_arguments(call, match):
    with pytest.raises(ValueError, match=match):
        call()


def test_block_table_widget_reads_a_trace():
    from kvlab.cache import BlockManager
    from kvlab.viz import paged as pviz

    bm = BlockManager(8, 4)
    trace = pviz.Trace(bm)
    bm.allocate(0, range(6))
    trace.record("one")
    bm.fork(0, 1)
    trace.record("fork")
    w = pviz.block_table_widget(trace)
    step = w.children[0].children[1]
    step.value = 1
    assert "fork" in w.children[1].value
    frame = trace.frames[1]
    assert [b["ref"] for b in frame["blocks"][:2]] == [2, 2] and frame["blocks"][2]["state"] == "free"
    opened = pviz.block_table_widget(trace, start=1)  # opens at a chosen frame, the slider there too
    assert opened.children[0].children[1].value == 1 and "fork" in opened.children[1].value
    for bad in (2, -1, True, 0.5):
        with pytest.raises(ValueError, match="start must be a frame index in 0..1"):
            pviz.block_table_widget(trace, start=bad)


def test_paging_loses_no_free_memory_between_allocations_where_contiguous_first_fit_does():
    r = simulate.external_fragmentation()
    assert r["refused_with_room"]["paged"] == 0 < r["refused_with_room"]["contiguous"]
    with pytest.raises(ValueError, match="leave"):
        simulate.external_fragmentation(leave=1.5)
