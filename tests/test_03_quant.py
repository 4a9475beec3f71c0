"""Quantization: rounding, clamping, zero guard, packing, byte accounting, calibration files,
saturation counters, NaN/Inf refusal, correction, rotation, quantized attention, evaluation."""

import json

import pytest
import torch

from kvlab import sizing
from kvlab.attention import paged_attention, quantized_paged_attention
from kvlab.cache import BlockManager, PagedKVCache, QuantizedPagedKVCache
from kvlab.calibrate import calibrate
from kvlab.files import FileError
from kvlab.quant import Calibration, KVQuantConfig, TensorFormat, core, hadamard, named_config, rotate


def test_round_half_to_even_not_truncation():
    x = torch.tensor([0.5, 1.5, 2.5, -0.5, -1.5, -2.5, 0.9, -0.9]).view(-1, 1, 1)
    q = core.quantize_int8(x, torch.tensor(1.0))
    assert q.flatten().tolist() == [0, 2, 2, 0, -2, -2, 1, -1]


def test_clamp_to_127_never_128():
    x = torch.tensor([1000.0, -1000.0, 127.4, -127.6]).view(-1, 1, 1)
    assert core.quantize_int8(x, torch.tensor(1.0)).flatten().tolist() == [127, -127, 127, -127]


def test_zero_guard():
    x = torch.zeros(4, 2, 8)
    x[:, 1] = torch.randn(4, 8)
    q, scale = core.int8_roundtrip(x, "per-head")
    assert scale[0, 0, 0] == 1.0 and scale[0, 1, 0] > 0
    assert (q[:, 0] == 0).all()
    assert core.scale_from_absmax(torch.tensor([5e-7]))[0] == 1.0


@pytest.mark.parametrize("gran,shape", [("per-tensor", (1, 1, 1)), ("per-head", (1, 3, 1)), ("per-channel", (1, 3, 8)),
                                        ("per-token", (5, 1, 1)), ("per-token-head", (5, 3, 1))])
def test_granularity_scale_shapes_and_error(gran, shape):
    torch.manual_seed(0)
    x = torch.randn(5, 3, 8) * torch.tensor([1.0, 10.0, 0.1]).view(1, 3, 1)
    q, scale = core.int8_roundtrip(x, gran)
    assert scale.shape == shape
    err = (core.dequantize_int8(q, scale) - x).abs()
    assert (err <= scale / 2 + 1e-6).all()  # never more than half a step
    with pytest.raises(ValueError, match="granularity must be one of"):
        core.absmax(x, "per-row")


def test_per_head_beats_per_tensor_when_heads_differ():
    torch.manual_seed(0)
    x = torch.randn(64, 3, 16) * torch.tensor([1.0, 30.0, 0.05]).view(1, 3, 1)
    errs = {g: core.error_metrics(x, core.dequantize_int8(*core.int8_roundtrip(x, g)))["snr_db"]
            for g in ("per-tensor", "per-head", "per-token-head")}
    assert errs["per-tensor"] < errs["per-head"] < errs["per-token-head"]


@pytest.mark.parametrize("symmetric", [True, False])
@pytest.mark.parametrize("group", [8, 32, 64])
def test_int4_pack_roundtrip_and_bytes(symmetric, group):
    torch.manual_seed(1)
    x = torch.randn(7, 3, 64)
    t = core.quantize_int4(x, group, symmetric)
    assert t.packed.shape == (7, 3, 32) and t.packed.dtype == torch.uint8
    vals = torch.randint(0, 16, (5, 10), dtype=torch.uint8)
    assert torch.equal(core.unpack_int4(core.pack_int4(vals)), vals)
    err = (core.dequantize_int4(t) - x).abs().reshape(7, 3, 64 // group, group)
    # symmetric: half a step; asymmetric: the rounded zero point can shift the edges by up to half a step more
    assert (err <= t.scale * (0.5 if symmetric else 1.0) + 1e-5).all()
    one_layer = dict(num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=3, head_dim=64)
    expected = sizing.kv_size(one_layer, "int4", tokens=7, scales=f"group-{group}", zero_points=not symmetric)
    assert 2 * t.nbytes == expected.total_bytes  # K and V


def test_fp8_saturates_instead_of_overflowing():
    x = torch.tensor([1e6, -1e6, 1.0]).view(-1, 1, 1)
    q = core.quantize_fp8(x, torch.tensor(1.0))
    assert q.float().flatten().tolist() == [448.0, -448.0, 1.0]


@pytest.mark.parametrize("name,gran", [("int8", "per-head"), ("int8", "per-token-head"), ("int8", "per-channel"),
                                       ("fp8", "per-tensor"), ("int4", None), ("k8v4", "per-head"), ("fp16", None)])
def test_pool_bytes_match_sizing(name, gran):
    cfg = named_config(name, granularity=gran, policy="dynamic")
    pool = QuantizedPagedKVCache(num_layers=2, num_blocks=6, block_size=4, num_kv_heads=3, head_dim=64, config=cfg)
    tokens = 6 * 4
    model = dict(num_hidden_layers=1, num_attention_heads=3, num_key_value_heads=3, head_dim=64)
    expected = 0
    for fmt in cfg.formats(0):  # both layers alike; K and V may differ (k8v4)
        s = sizing.kv_size(model, fmt.dtype, tokens=tokens, scales=fmt.sizing_scales,
                           zero_points=fmt.dtype == "int4" and not fmt.symmetric)
        expected += s.total_bytes // 2  # kv_size counts K and V with this format; we need one of them
    if cfg.k.static_scales and cfg.policy == "dynamic":
        pool.write(0, torch.randn(1, 3, 64), torch.randn(1, 3, 64), torch.tensor([0]))
        pool.write(1, torch.randn(1, 3, 64), torch.randn(1, 3, 64), torch.tensor([0]))
    assert pool.bytes_reserved == 2 * expected


@pytest.mark.parametrize("name,gran", [("int8", "per-head"), ("int8", "per-token-head"), ("fp8", "per-tensor"),
                                       ("k8v4", "per-head"), ("fp16", None)])
def test_a_read_into_buffers_equals_a_fresh_read_to_the_bit(name, gran):
    """The torch backend reads a step's blocks into buffers it reuses for every layer (``out``): the same
    values as a read that allocates, to the bit; a format that cannot fill one (int4) returns its own."""
    cfg = named_config(name, granularity=gran, policy="dynamic")
    pool = QuantizedPagedKVCache(num_layers=1, num_blocks=6, block_size=4, num_kv_heads=3, head_dim=64, config=cfg)
    g = torch.Generator().manual_seed(0)
    pool.write(0, 3 * torch.randn(20, 3, 64, generator=g), torch.randn(20, 3, 64, generator=g), torch.arange(20))
    ids = torch.tensor([4, 0, 2, 2])
    fresh = pool.read(0, ids)
    out = (torch.full((4, 4, 3, 64), float("nan")), torch.full((4, 4, 3, 64), float("nan")))
    into = pool.read(0, ids, out=out)
    for a, b, buf, fmt in zip(fresh, into, out, cfg.formats(0)):
        assert torch.equal(a, b), fmt.label()
        assert (b.data_ptr() == buf.data_ptr()) == (fmt.dtype != "int4"), fmt.label()


def test_nan_and_inf_are_rejected_before_anything_is_written():
    pool = QuantizedPagedKVCache(1, 2, 4, 2, 8, named_config("int8", granularity="per-token-head", policy="dynamic"))
    before = pool.k[0].data.clone()
    bad = torch.randn(3, 2, 8)
    bad[1, 0, 3] = float("nan")
    with pytest.raises(ValueError, match="NaN/Inf"):
        pool.write(0, bad, torch.randn(3, 2, 8), torch.tensor([0, 1, 2]))
    bad[1, 0, 3] = float("inf")
    with pytest.raises(ValueError, match="values .*NaN/Inf"):
        pool.write(0, torch.randn(3, 2, 8), bad, torch.tensor([0, 1, 2]))
    assert torch.equal(pool.k[0].data, before)


def _calibration_with(absmax_k: float, absmax_v: float, layers=1, heads=2, d=8) -> Calibration:
    def table(v):
        per_head = torch.full((layers, heads), v)
        return {"per-tensor": {s: torch.full((layers,), v) for s in ("absmax", "p99.9")},
                "per-head": {s: per_head.clone() for s in ("absmax", "p99.9")},
                "per-channel": {s: torch.full((layers, heads, d), v) for s in ("absmax", "p99.9")}}
    return Calibration({"k": table(absmax_k), "v": table(absmax_v), "k_rot": table(absmax_k)}, {"test": True})


def test_saturation_counters_on_constructed_input():
    cal = _calibration_with(127.0, 127.0)  # scale 1.0 per head
    pool = QuantizedPagedKVCache(1, 4, 4, 2, 8, KVQuantConfig(policy="static"), cal)
    k = torch.zeros(2, 2, 8)
    k[0, 0, :3] = torch.tensor([127.0, 200.0, -128.0])  # head 0: one at 127, two clipped
    k[1, 1, 0] = 126.6  # head 1: rounds to 127 (at qmax) without clipping
    pool.write(0, k, torch.zeros(2, 2, 8), torch.tensor([0, 1]))
    sat = pool.saturation()["k"]
    assert sat["clipped"][0].tolist() == [2, 0]
    assert sat["at_qmax"][0].tolist() == [3, 1]
    assert sat["values"][0].tolist() == [16, 16]
    assert pool.saturation()["v"]["clipped"].sum() == 0


def test_dynamic_correction_widens_only_the_offending_head():
    cal = _calibration_with(127.0, 127.0)
    pool = QuantizedPagedKVCache(1, 4, 4, 2, 8, KVQuantConfig(policy="corrected"), cal)
    first = torch.full((1, 2, 8), 50.0)
    pool.write(0, first, first, torch.tensor([0]))
    spike = torch.zeros(1, 2, 8)
    spike[0, 0, 0] = 1.1 * 127  # within 1.2x: clipped, no correction
    spike[0, 1, 0] = 300.0  # beyond 1.2x: head 1's scale widens, its stored values are re-quantized
    pool.write(0, spike, torch.zeros(1, 2, 8), torch.tensor([1]))
    sat = pool.saturation()["k"]
    assert sat["corrections"][0].tolist() == [0, 1]
    assert sat["clipped"][0].tolist() == [1, 0]
    assert pool.k[0].scale[0, :, 0].tolist() == [1.0, pytest.approx(300 / 127)]
    back = pool.k[0].read(torch.tensor([0]))[0]  # slots 0 and 1
    assert back[0, 0].tolist() == pytest.approx([50.0] * 8)  # head 0 untouched
    assert back[0, 1] == pytest.approx(torch.full((8,), 50.0), abs=300 / 127 / 2 + 1e-4)  # re-quantized
    assert back[1, 1, 0] == pytest.approx(300.0)


def test_static_policy_needs_calibration():
    with pytest.raises(ValueError, match="needs a calibration"):
        QuantizedPagedKVCache(1, 2, 4, 2, 8, KVQuantConfig(policy="static"))


def test_calibration_save_load_roundtrip(tmp_path, tiny):
    model, _ = tiny
    cal = calibrate(model, [[5, 6, 7, 8, 9] * 4, [40, 41, 42] * 5], progress=False, meta={"text": "unit"})
    path = cal.save(tmp_path / "scales.safetensors")
    back = Calibration.load(path)
    assert back.meta["text"] == "unit" and back.meta["tokens"] == 35
    for t in ("k", "v", "k_rot"):
        for g in ("per-tensor", "per-head", "per-channel"):
            for s in ("absmax", "p99", "p99.9", "p99.99"):
                assert torch.equal(back.stats[t][g][s], cal.stats[t][g][s])
    ph = cal.stats["k"]["per-head"]
    assert (ph["p99"] <= ph["p99.9"]).all() and (ph["p99.99"] <= ph["absmax"]).all()
    assert cal.scales("k", "absmax", "per-head")[0].shape == (1, 2, 1)
    (tmp_path / "bad.safetensors").write_bytes(b"not a file")
    with pytest.raises(FileError, match=r"bad\.safetensors'? is not a safetensors file .*kvlab calibrate --out"):
        Calibration.load(tmp_path / "bad.safetensors")


def test_hadamard_is_orthonormal_and_keeps_dot_products():
    h = hadamard(16)
    assert torch.allclose(h @ h.T, torch.eye(16), atol=1e-6)
    q, k = torch.randn(5, 16), torch.randn(7, 16)
    assert torch.allclose(rotate(q) @ rotate(k).T, q @ k.T, atol=1e-5)
    with pytest.raises(ValueError, match="power of two"):
        hadamard(12)


def test_rotation_spreads_an_outlier_channel():
    torch.manual_seed(0)
    x = torch.randn(256, 1, 64)
    x[..., 5] *= 40  # one outlier channel, as keys have
    err = lambda t: core.error_metrics(t, core.dequantize_int4(core.quantize_int4(t, 32)))["mse"]  # noqa: E731
    assert err(rotate(x)) < 0.5 * err(x)


def _pool_and_tables(cfg, cal=None, bs=4, h=2, d=16, lengths=(5, 9)):
    bm = BlockManager(16, bs)
    pool = QuantizedPagedKVCache(1, 16, bs, h, d, cfg, cal)
    ref = PagedKVCache(1, 16, bs, h, d)
    torch.manual_seed(3)
    for i, n in enumerate(lengths):
        bm.allocate(i, list(range(n)))
        k, v = torch.randn(n, h, d), torch.randn(n, h, d)
        slots = torch.tensor(bm.slot_mapping(i))
        pool.write(0, k, v, slots)
        ref.write(0, k, v, slots)
    return bm, pool, ref


@pytest.mark.parametrize("rotate_k", [False, True])
def test_quantized_attention_with_float_storage_equals_reference(rotate_k):
    cfg = KVQuantConfig(TensorFormat("fp32"), TensorFormat("fp32"), rotate_k=rotate_k)
    bm, pool, ref = _pool_and_tables(cfg)
    tables = [bm.block_table(0), bm.block_table(1)]
    ctx, ql = [5, 9], [1, 3]
    q = torch.randn(4, 4, 16)
    # the new tokens' own K/V are the last ones stored; pass them as the chunk
    k_new = torch.cat([ref.gather(0, tables[0], 5)[0][-1:], ref.gather(0, tables[1], 9)[0][-3:]])
    v_new = torch.cat([ref.gather(0, tables[0], 5)[1][-1:], ref.gather(0, tables[1], 9)[1][-3:]])
    out = quantized_paged_attention(q, k_new, v_new, pool, 0, tables, ctx, ql, scale=0.25, tile_blocks=1)
    expected = paged_attention(q, ref.k_cache[0], ref.v_cache[0], tables, ctx, ql, scale=0.25)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("feat", [{}, {"window": 4}, {"softcap": 5.0}])
def test_a_chunk_as_decodes_equals_its_tokens_decoded_one_by_one(feat):
    """as_decodes: each new token sees the earlier ones as stored and only itself at full precision, which
    is what a token-by-token decode over the same pool sees (eviction_quality and teacher_forced score
    forced text this way)."""
    bm, pool, ref = _pool_and_tables(named_config("int8", granularity="per-token-head", policy="dynamic"))
    table = bm.block_table(1)  # 9 tokens stored; the last 4 are the chunk
    k_all, v_all = ref.gather(0, table, 9)
    q = torch.randn(4, 4, 16)
    chunk = quantized_paged_attention(q, k_all[-4:], v_all[-4:], pool, 0, [table], [9], [4], scale=0.25,
                                      as_decodes=True, **feat)
    one_by_one = torch.cat([quantized_paged_attention(q[t:t + 1], k_all[5 + t:6 + t], v_all[5 + t:6 + t], pool, 0,
                                                      [table], [6 + t], [1], scale=0.25, **feat) for t in range(4)])
    torch.testing.assert_close(chunk, one_by_one, atol=1e-5, rtol=1e-5)
    prefill = quantized_paged_attention(q, k_all[-4:], v_all[-4:], pool, 0, [table], [9], [4], scale=0.25, **feat)
    assert not torch.allclose(prefill[1:], one_by_one[1:], atol=1e-4)  # a plain chunk sees its own at full precision


def test_int8_attention_is_close_to_float():
    bm, pool, ref = _pool_and_tables(named_config("int8", granularity="per-token-head", policy="dynamic"))
    tables = [bm.block_table(1)]
    k_all, v_all = ref.gather(0, tables[0], 9)
    q = torch.randn(1, 4, 16)
    out = quantized_paged_attention(q, k_all[-1:], v_all[-1:], pool, 0, tables, [9], [1], scale=0.25)
    expected = paged_attention(q, ref.k_cache[0], ref.v_cache[0], tables, [9], [1], scale=0.25)
    assert (out - expected).abs().max() < 0.02


def test_evaluate_scores_every_target_once_and_fp_matches_itself(tiny):
    from kvlab.eval import evaluate

    model, _ = tiny
    tokens = [(7 * i) % 250 + 3 for i in range(150)]
    res = evaluate(model, tokens, {"fp32": KVQuantConfig(TensorFormat("fp32"), TensorFormat("fp32")),
                                   "int8": named_config("int8", granularity="per-token-head", policy="dynamic")},
                   window=64, stride=24, chunk=8)
    assert res["scored"] == 149
    assert res["configs"]["fp32"]["ppl"] == pytest.approx(res["ppl_fp"], rel=1e-6)
    assert res["configs"]["fp32"]["kl"] == pytest.approx(0, abs=1e-9) and res["configs"]["fp32"]["top1"] == 1
    assert res["configs"]["int8"]["kl"] > 0
    assert res["configs"]["fp32"]["delta_ppl_ci95"] == pytest.approx((0, 0), abs=1e-9)  # no difference, no width
    lo, hi = res["configs"]["int8"]["delta_ppl_ci95"]
    assert lo < res["configs"]["int8"]["delta_ppl_pct"] < hi and hi - lo > 0
    from kvlab.eval.quality import _windows

    fed = sum(end - start - 1 for start, end, _ in _windows(150, 64, 24))  # every window's tokens but its last
    sat = res["configs"]["int8"]["saturation"]["k"]
    assert int(sat["values"].sum()) == fed * 3 * 2 * 16  # summed over all windows: layers x KV heads x head_dim


def test_evaluate_refuses_a_chunk_that_never_reads_the_cache(tiny):
    from kvlab.eval import evaluate

    model, _ = tiny
    tokens = list(range(3, 51))
    with pytest.raises(ValueError, match="never be read"):  # one chunk per window: KL would be 0 for any format
        evaluate(model, tokens, {"int4": named_config("int4")}, window=48, stride=48, chunk=48)


def test_greedy_generation_through_a_quantized_pool(tiny):
    from kvlab.eval import greedy_agreement

    model, _ = tiny
    agree = greedy_agreement(model, [[5, 6, 7, 8], [9, 10]], named_config("int8", granularity="per-token-head",
                                                                       policy="dynamic"), max_new_tokens=8)
    assert 0 < agree <= 1


def test_greedy_comparison_finds_the_first_divergence(tiny):
    from kvlab.eval import greedy_comparison

    model, _ = tiny
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13]]
    same = greedy_comparison(model, prompts, named_config("fp32"), max_new_tokens=8)
    assert same["first_divergence"] == [None] * 3 and same["identical"] == 3 and same["position_share"] == 1
    int4 = KVQuantConfig(TensorFormat("int4", group_size=8), TensorFormat("int4", group_size=8))
    cmp = greedy_comparison(model, prompts, int4, max_new_tokens=8)
    ref, got = cmp["token_ids"]
    for r, g, d in zip(ref, got, cmp["first_divergence"]):  # the index really is the first difference
        if d is None:
            assert r == g
        else:
            assert r[:d] == g[:d] and (d == min(len(r), len(g)) or r[d] != g[d])


def test_cli_ppl_and_calibrate_on_tiny(tmp_path, capsys):
    from kvlab.cli import main

    text = tmp_path / "t.txt"
    text.write_text("It was the best of times, it was the worst of times. " * 8)
    out = tmp_path / "tiny.safetensors"
    assert main(["calibrate", "--model", "tiny", "--file", str(text), "--tokens", "200", "--chunk", "100",
                 "--out", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["tokens"] == 200
    assert main(["ppl", "--model", "tiny", "--kv-cache-dtype", "int8", "--scales", "per-head", "--calib", "p99.9",
                 "--scales-file", str(out), "--file", str(text), "--tokens", "120", "--window", "64",
                 "--stride", "32", "--chunk", "16", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert {"ppl", "ppl_fp", "kl", "top1"} <= res.keys() and res["scored"] == 119
    assert main(["ppl", "--model", "tiny", "--file", str(tmp_path / "missing.txt")]) == 2
    assert "missing.txt' does not exist" in capsys.readouterr().err


def test_cli_ppl_without_scales_file_calibrates_once_and_caches(tmp_path, monkeypatch, capsys):
    from kvlab.cli import main

    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    args = ["ppl", "--model", "tiny", "--kv-cache-dtype", "int8", "--tokens", "80", "--window", "40", "--stride", "20",
            "--chunk", "10", "--json"]
    assert main(args) == 0
    first = json.loads(capsys.readouterr().out)
    cached = list((tmp_path / "calibration").glob("tiny-*.safetensors"))
    assert len(cached) == 1
    stamp = cached[0].stat().st_mtime_ns
    assert main(args) == 0
    assert json.loads(capsys.readouterr().out)["ppl"] == first["ppl"]
    assert cached[0].stat().st_mtime_ns == stamp  # loaded, not recomputed


def test_granularity_explorer_switches_statistic(tiny):
    from kvlab.calibrate import collect_kv
    from kvlab.viz.quant import granularity_explorer

    model, _ = tiny
    chunks = [[5, 6, 7, 8, 9] * 6]
    keys, values = collect_kv(model, chunks, progress=False)
    cal = calibrate(model, chunks, progress=False)
    w = granularity_explorer(keys, values, cal)
    which, gran, stat = w.children[0].children
    fig = w.children[1]
    stat.value = "p99"
    assert max(fig.data[1].y) > 0  # a percentile below 100 clips something
    stat.value = "this data's abs-max"
    assert max(fig.data[1].y) == 0 and min(fig.data[0].y) > 20
    opened = granularity_explorer(keys, values, cal, start="p99")  # opens where something clips
    assert opened.children[0].children[2].value == "p99" and max(opened.children[1].data[1].y) > 0
    with pytest.raises(ValueError, match="start"):
        granularity_explorer(keys, values, cal, start="p50")


def test_channel_spread_sees_outlier_channels():
    x = torch.ones(8, 2, 16)
    assert core.channel_spread(x) == pytest.approx(1.0)
    x[:, :, 3] = 10.0  # one outlier channel in every head
    assert core.channel_spread(x) == pytest.approx(10.0)


def test_shrunk_calibration_divides_every_statistic_and_refuses_bad_factors():
    cal = _calibration_with(127.0, 63.5)
    small = cal.shrunk(4)
    assert float(small.scales("k")[0].flatten()[0]) == 0.25 and float(small.scales("v")[0].flatten()[0]) == 0.125
    assert float(cal.scales("k")[0].flatten()[0]) == 1.0  # the original is untouched
    assert small.meta["note"] == "statistics / 4"
    for bad in (0, -2, float("inf"), True, "4"):
        with pytest.raises(ValueError, match="factor must be"):
            cal.shrunk(bad)


def test_teacher_forced_predicts_greedy_generation(tiny):
    """Fed the full-precision answers, the quantized pool's first disagreement is where its own greedy
    generation first departs from them (one sequence at a time: no batching to flip a near-tie)."""
    from kvlab.eval import greedy_comparison, teacher_forced

    model, _ = tiny
    int4 = KVQuantConfig(TensorFormat("int4", group_size=8), TensorFormat("int4", group_size=8))
    prompts = [[5, 6, 7, 8], [9, 10], [11, 12, 13], [20, 3, 40, 7, 9]]
    firsts = [greedy_comparison(model, [p], int4, max_new_tokens=10)["first_divergence"][0] for p in prompts]
    answers = [greedy_comparison(model, [p], named_config("fp32"), max_new_tokens=10)["token_ids"][0][0]
               for p in prompts]
    tf = teacher_forced(model, [p + a for p, a in zip(prompts, answers)], [len(p) for p in prompts], int4)
    # the last answer token is only a target: a divergence at index 9 is still seen, at index 10 there is none
    assert tf["first_miss"] == firsts and tf["intact"] == sum(f is None for f in firsts)
    assert tf["top1_fp32"] == 1 and tf["positions"] == 4 * 10 and 0 <= tf["top1"] <= 1
    assert any(f is not None for f in firsts)  # the test means something only if int4 departs somewhere
    with pytest.raises(ValueError, match="starts must give"):
        teacher_forced(model, [prompts[0] + answers[0]], [], int4)
    with pytest.raises(ValueError, match="each start"):
        teacher_forced(model, [prompts[0] + answers[0]], [0], int4)


def test_evaluate_takes_a_calibration_per_config(tiny):
    """A dict of calibrations gives each config its own scales against one FP run: the same numbers as
    one evaluate per calibration (notebook 03's shrunk-scales sweep); a dict that misses a config is refused."""
    from kvlab.calibrate import calibrate
    from kvlab.eval import evaluate
    from kvlab.quant import named_config
    model, _ = tiny
    ids = [3 + (13 * i) % 250 for i in range(70)]
    cal = calibrate(model, [ids[:24]], progress=False)
    configs = {("static", f): named_config("int8", policy="static") for f in (2, 8)}
    together = evaluate(model, ids, configs, {k: cal.shrunk(k[1]) for k in configs}, window=70, stride=70, chunk=16)
    for key in configs:
        alone = evaluate(model, ids, {"s": configs[key]}, cal.shrunk(key[1]), window=70, stride=70, chunk=16)
        for field in ("kl", "top1", "k_clip_rate", "delta_ppl_pct"):
            assert together["configs"][key][field] == pytest.approx(alone["configs"]["s"][field], rel=1e-9, abs=1e-12)
    assert together["configs"][("static", 8)]["k_clip_rate"] > together["configs"][("static", 2)]["k_clip_rate"]
    with pytest.raises(ValueError, match="one entry per config"):
        evaluate(model, ids, configs, {("static", 2): cal}, window=70, stride=70, chunk=16)


def test_evaluate_takes_the_layers_under_a_config_s_quantized_one_from_the_fp_run(tiny, monkeypatch):
    """A config that quantizes layer l alone (layer_sensitivity's) computes the layers under l exactly as the
    FP run does (full-precision K/V, the same input): evaluate hands them the FP run's outputs instead of
    running them again. The numbers are those of running every layer, to the bit, and layers are skipped."""
    from kvlab.calibrate import calibrate
    from kvlab.eval import evaluate, quality
    model, _ = tiny
    ids = [3 + (13 * i) % 250 for i in range(70)]
    cal = calibrate(model, [ids[:24]], progress=False)
    layers = quality._decoder_layers(model)
    fp, int8 = TensorFormat("fp32"), named_config("int8").k
    configs = {n: KVQuantConfig(fp, fp, layers={n: (int8, int8)}) for n in range(len(layers))}
    configs["rotated"] = named_config("int8", rotate_k=True)  # every layer quantized: nothing to reuse
    quality.paged_attention_spec(model)  # its one probing forward (cached), before anything is counted
    calls = []
    hook = layers[0].mlp.register_forward_hook(lambda *_: calls.append(1))  # runs only when the layer computes
    try:
        reused = evaluate(model, ids, configs, cal, window=70, stride=70, chunk=16)
        skipping = len(calls)
        monkeypatch.setattr(quality, "_decoder_layers", lambda m: None)  # every config runs every layer
        calls.clear()
        every = evaluate(model, ids, configs, cal, window=70, stride=70, chunk=16)
        computing = len(calls)
        monkeypatch.undo()  # windows that overlap: context-only chunks, a fresh pool per window
        windows = evaluate(model, ids, configs, cal, window=40, stride=20, chunk=8)
        monkeypatch.setattr(quality, "_decoder_layers", lambda m: None)
        windows_every = evaluate(model, ids, configs, cal, window=40, stride=20, chunk=8)
    finally:
        hook.remove()
    fields = ("kl", "top1", "ppl", "delta_ppl_pct", "delta_ppl_ci95", "k_clip_rate", "v_clip_rate")
    for n in configs:
        assert [reused["configs"][n][f] for f in fields] == [every["configs"][n][f] for f in fields], n
        assert [windows["configs"][n][f] for f in fields] == [windows_every["configs"][n][f] for f in fields], n
    chunks = 5  # 69 positions in chunks of 16
    assert (skipping, computing) == (3 * chunks, (len(configs) + 1) * chunks)  # layer 0 in FP, config 0, rotated
