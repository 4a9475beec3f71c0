"""Notebook 06's four configurations (kvlab/capstone.py) and its dashboard (kvlab/viz/dashboard.py), on
the tiny model: one budget, static ≡ paged token for token, Triton ≡ PyTorch on the same INT8 pool."""

import random

import pytest
import torch

from kvlab import capstone as C
from kvlab.calibrate import calibrate

MAX_LEN = 64


def _workload(n=10, seed=0):
    rng = random.Random(seed)
    system = [rng.randrange(3, 259) for _ in range(9)]  # a shared "system prompt": 2 full blocks of 4
    prompts = [system + [rng.randrange(3, 259) for _ in range(rng.randint(3, 20))] for _ in range(n)]
    return prompts, [rng.randint(3, 14) for _ in range(n)]


@pytest.fixture(scope="module")
def cal(tiny):
    model, _ = tiny
    return calibrate(model, _workload(4, seed=9)[0], progress=False)


def test_plan_spends_one_budget_three_ways(tiny, cal):
    model, _ = tiny
    per, fixed = C.block_bytes(model, "fp16", 4)
    assert fixed == 0
    budget = 3 * (MAX_LEN // 4) * per + 100  # three static slabs and change
    static = C.plan(model, "static FP16", budget, MAX_LEN, block_size=4)
    assert (static.seats, static.num_blocks, static.max_num_seqs, static.prefix_caching) == (3, 48, 3, False)
    paged = C.plan(model, "paged FP16", budget, MAX_LEN, block_size=4)
    assert (paged.num_blocks, paged.seats, paged.prefix_caching) == (48, None, True)
    int8 = C.plan(model, "paged INT8", budget, MAX_LEN, block_size=4, calibration=cal)
    per8, fixed8 = C.block_bytes(model, "int8", 4, cal)
    assert per8 * 2 == per and fixed8 > 0  # half the bytes per block; the scale table is fixed
    assert int8.num_blocks == (budget - fixed8) // per8 and int8.bytes_reserved <= budget
    for p in (static, paged, int8):
        assert p.bytes_reserved <= budget


def test_plan_rejects_bad_input(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="config must be one of"):
        C.plan(model, "paged FP8", 10**6)
    with pytest.raises(ValueError, match="holds no 64-token slab"):
        C.plan(model, "static FP16", 1000, MAX_LEN, block_size=4)
    with pytest.raises(ValueError, match="max_len must be"):
        C.plan(model, "static FP16", 10**6, 8, block_size=16)


def _serve(model, tok, name, budget, cal, prompts, outs):
    p = C.plan(model, name, budget, MAX_LEN, block_size=4, calibration=cal)
    llm = C.make_engine(model, tok, p, cal)
    return C.serve(llm, prompts, outs, p, MAX_LEN), llm


def test_four_configs_one_budget(tiny, cal):
    model, tok = tiny
    prompts, outs = _workload()
    per, _ = C.block_bytes(model, "fp16", 4)
    budget = 2 * (MAX_LEN // 4) * per
    rows = {}
    for name in C.CONFIGS:
        if C.skip_reason(name):  # the Triton one, where triton is missing (macOS, Windows)
            continue
        rows[name], llm = _serve(model, tok, name, budget, cal, prompts, outs)
        llm.block_manager.check_invariants()
        assert llm.block_manager.stats()["blocks_used"] == 0  # everything freed
    static, fp16, int8 = (rows[n] for n in C.CONFIGS[:3])
    assert static["peak_running"] <= 2 < fp16["peak_running"] <= int8["peak_running"]
    assert static["held_at_limit"] < fp16["held_at_limit"] < int8["held_at_limit"]
    # the same storage, other schedules and batch shapes: the same tokens (batched ≡ sequential)
    assert static["tokens"] == fp16["tokens"]
    # the kernels on the same INT8 pool: the same tokens as the PyTorch path
    assert rows.get("paged INT8 + Triton", int8)["tokens"] == int8["tokens"]
    assert [len(t) for t in int8["tokens"]] == outs
    assert C.agreement(static["tokens"], fp16["tokens"]) == {"identical": 10, "requests": 10, "prefix_share": 1.0}
    assert "k_clip_rate" in int8 and "k_clip_rate" not in fp16
    assert "seq limit" in C.limit(static) and "no blocks" in C.limit(fp16)
    for r in rows.values():  # "held" is the average of the per-step series over the steps the budget turned one away
        assert len(r["running"]) == len(r["limited"]) == r["steps"] and max(r["running"]) == r["peak_running"]
        at = [n for n, hit in zip(r["running"], r["limited"]) if hit]
        assert len(at) == r["limit_steps"]
        assert r["held_at_limit"] == (pytest.approx(sum(at) / len(at)) if at else r["requests"])


def test_kv_read_per_step_is_the_decode_contexts(tiny, cal):
    model, tok = tiny
    prompts, outs = _workload(4, seed=3)
    per, _ = C.block_bytes(model, "fp16", 4)
    for name in ("static FP16", "paged FP16"):
        p = C.plan(model, name, 4 * (MAX_LEN // 4) * per, MAX_LEN, block_size=4)
        llm = C.make_engine(model, tok, p)
        reads = C.DecodeReads(llm)
        from kvlab.engine import SamplingParams

        ids = llm.add_requests(prompts, [SamplingParams(max_tokens=o, ignore_eos=True) for o in outs])
        while llm.has_unfinished():
            llm.step()
        row = C.measure(llm, ids, reads, p, MAX_LEN)
        assert reads.per_step and all(reads.rows[k] >= 1 for k in reads.per_step)
        per_token = p.bytes_per_block / 4
        if name == "static FP16":  # a static cache's attention reads the whole slab of every row
            expect = sum(reads.rows[k] * MAX_LEN * per_token for k in reads.rows) / len(reads.rows)
        else:
            expect = sum(t * per_token for t in reads.per_step.values()) / len(reads.per_step)
        assert row["kv_read_per_decode_step"] == pytest.approx(expect)


def test_agreement_counts_only_up_to_the_first_difference():
    a = [[1, 2, 3, 4], [1, 2, 3, 4], [9, 2, 3, 4]]
    ref = [[1, 2, 3, 4], [1, 2, 0, 4], [1, 2, 3, 4]]
    assert C.agreement(a, ref) == {"identical": 1, "requests": 3, "prefix_share": pytest.approx((1 + 0.5 + 0) / 3)}


@pytest.mark.triton
def test_count_step_bytes_reads_at_least_the_kv_pages(tiny, cal):
    from kvlab.engine import SamplingParams

    model, tok = tiny
    prompts, _ = _workload(3, seed=4)
    p = C.plan(model, "paged INT8 + Triton", 10**6, MAX_LEN, block_size=4, calibration=cal)
    llm = C.make_engine(model, tok, p, cal)
    llm.add_requests(prompts, [SamplingParams(max_tokens=3, ignore_eos=True)] * 3)
    llm.step()  # the prompts
    n = C.count_step_bytes(llm)
    assert n["rows"] == 3 and n["context_tokens"] == sum(len(x) + 1 for x in prompts)
    kv = n["context_tokens"] * p.bytes_per_block / 4  # int8 K and V of every context token, every layer
    assert kv <= n["read"] < 2 * kv + 64 * 1024
    assert n["write"] > 0
    assert llm.on_scheduled is None  # the counting hook is gone again


# ---- the dashboard ---------------------------------------------------------------------------------------


def test_dashboard_follows_the_engine_and_replays(tiny, cal):
    from kvlab.engine import LLM, SamplingParams
    from kvlab.viz.dashboard import engine_dashboard

    model, tok = tiny
    prompts, outs = _workload(6, seed=5)
    llm = LLM(model, tok, num_blocks=30, block_size=4, max_num_seqs=4, max_num_batched_tokens=64, kv_cache_dtype="int8",
              calibration=cal)
    reads = C.DecodeReads(llm)  # chained: the dashboard's recorder sits in front of it
    box = engine_dashboard(llm, columns=10, title="tiny")
    d = box.dashboard
    llm.generate(prompts, [SamplingParams(max_tokens=o, ignore_eos=True) for o in outs])
    frames = d.recorder.frames
    assert len(frames) == len(llm.step_stats) + 1  # the frame before the run, then one per step
    assert d.step.max == len(frames) - 1 and d.step.value == d.step.max  # followed the run live
    per_token = llm.cache.bytes_per_block / 4
    expected = [reads.per_step.get(f["step"], 0) * per_token if f["batch"] else 0 for f in frames]
    assert d.kv_read == expected and max(expected) > 0
    clipped = llm.cache.saturation()
    total = int(clipped["k"]["clipped"].sum() + clipped["v"]["clipped"].sum())
    assert sum(map(sum, d.chart.data[5].z)) == total
    last_pool = [list(r) for r in d.pool.data[0].z]
    assert len(frames[d.busiest()]["running"]) == max(len(f["running"]) for f in frames)
    d.step.value = 1  # replay: the slider moves the marker, the pool and the text
    assert tuple(d.chart.data[3].x) == (1,) and "frame 1" in d.info.value
    assert [list(r) for r in d.pool.data[0].z] != last_pool


def test_dashboard_on_a_float_pool_says_nothing_clips(tiny):
    from kvlab.engine import LLM, SamplingParams
    from kvlab.viz.dashboard import engine_dashboard

    model, tok = tiny
    llm = LLM(model, tok, num_blocks=16, block_size=4)
    box = engine_dashboard(llm)
    llm.generate(_workload(2)[0], SamplingParams(max_tokens=3, ignore_eos=True))
    d = box.dashboard
    assert d.clipped[-1] is None and any("nothing clips" in a.text for a in d.chart.layout.annotations)
    assert torch.is_tensor(torch.tensor(d.kv_read)) and max(d.kv_read) > 0


def test_comparison_figure_marks_the_modelled_read():
    """The static cache's KV read is computed from its slab, not counted: its bar is hatched and says so."""
    from kvlab.viz.dashboard import comparison_figure

    rows = {n: dict(held_at_limit=4.0 + i, output_tok_s=10.0, kv_read_per_token=2048.0 * (i + 1))
            for i, n in enumerate(("static FP16", "paged FP16", "paged INT8"))}
    fig = comparison_figure(rows, "t")
    held, _, kv = fig.data
    assert list(held.x) == ["static FP16", "paged FP16", "paged INT8"] and list(held.y) == [4.0, 5.0, 6.0]
    assert list(kv.marker.pattern.shape) == ["/", "", ""] and kv.text[0] == "2 (modelled)"
    assert list(held.marker.pattern.shape) == ["", "", ""]  # counted numbers are plain bars


def test_held_figure_marks_the_limited_steps():
    """One line per configuration; markers only on the steps the budget turned a request away; the dotted
    line sits at their average, the table's "held"."""
    from kvlab.viz.dashboard import held_figure

    rows = {"static FP16": dict(running=[1, 2, 2, 2, 1], limited=[False, True, True, False, False], held_at_limit=2.0),
            "paged FP16": dict(running=[3, 4, 2], limited=[False, False, False], held_at_limit=3.0)}
    fig = held_figure(rows, "t")
    line, marks, avg, other = fig.data
    assert list(line.y) == [1, 2, 2, 2, 1] and list(marks.x) == [2, 3] and list(avg.y) == [2.0, 2.0]
    assert other.name == "paged FP16" and len(fig.data) == 4  # no limited step: no markers, no average line
