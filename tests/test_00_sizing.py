"""KV sizing: the formula, the seeds' figures, scale overheads, and the bytes caches really allocate."""

import pytest
import torch

from kvlab import sizing
from kvlab.cache import ContiguousCache, StaticCache
from kvlab.generate import greedy_generate

GiB, KiB = 2**30, 2**10


@pytest.mark.parametrize("model,per_token,at_4096", [
    ("llama-2-7b", 512 * KiB, 2 * GiB),  # the TurboQuant article: correct
    ("llama-2-70b", 320 * KiB, 1.25 * GiB),  # the KV-cache article says 1.6 MB and 6.5 GB: it ignores GQA
    ("llama-3-8b", 128 * KiB, 0.5 * GiB),
    ("qwen2.5-7b", 56 * KiB, 224 * 2**20),
    ("smollm2-135m", 23040, 23040 * 4096),
])
def test_fp16_presets(model, per_token, at_4096):
    assert sizing.kv_bytes_per_token(model, "fp16") == per_token
    assert sizing.kv_size(model, "fp16", tokens=4096).total_bytes == at_4096


def test_seed_004_context_table_for_7b():
    for tokens, gib in ((2048, 1), (8192, 4), (32768, 16), (131072, 64)):
        assert sizing.kv_size("llama-2-7b", "fp16", tokens=tokens).total_bytes == gib * GiB


def test_mla_stores_one_latent_per_layer():
    c = sizing.kv_config("deepseek-v3")
    assert c.attention == "MLA"
    assert sizing.kv_bytes_per_token(c, "bf16") == 61 * (512 + 64) * 2


def test_hf_config_object_and_dict_agree_with_preset():
    from transformers import LlamaConfig

    preset = sizing.PRESETS["llama-3-8b"]
    cfg = LlamaConfig(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                      intermediate_size=14336)
    assert sizing.kv_bytes_per_token(cfg) == sizing.kv_bytes_per_token(preset) == sizing.kv_bytes_per_token("llama-3-8b")


@pytest.mark.parametrize("scales,per_token_scales,fixed_scales", [
    ("none", 0, 0),
    ("per-tensor", 0, 2 * 32),
    ("per-head", 0, 2 * 32 * 8),
    ("per-channel", 0, 2 * 32 * 8 * 128),
    ("per-token", 2 * 32, 0),
    ("per-token-head", 2 * 32 * 8, 0),
    ("group-32", 2 * 32 * 8 * 4, 0),
])
def test_scale_overhead_per_granularity(scales, per_token_scales, fixed_scales):
    s = sizing.kv_size("llama-3-8b", "int8", tokens=100, batch=3, scales=scales)
    data = 2 * 32 * 8 * 128 * 100 * 3  # one byte per element
    assert s.data_bytes == data
    assert s.scale_bytes == 4 * (per_token_scales * 100 * 3 + fixed_scales)
    assert s.fixed_bytes == 4 * fixed_scales
    assert s.bytes_per_token == 2 * 32 * 8 * 128 + 4 * per_token_scales
    assert s.total_bytes == data + s.scale_bytes


def test_int4_packs_two_per_byte_and_zero_points_double_the_scales():
    s = sizing.kv_size("smollm2-135m", "int4", tokens=10, scales="group-32", zero_points=True, scale_dtype="fp16")
    assert s.data_bytes == 2 * 30 * 3 * 64 * 10 // 2
    assert s.scale_bytes == 2 * 30 * 3 * 2 * 10 * (2 + 2)


def test_int8_per_head_is_half_of_fp16_plus_a_tiny_table():
    fp16 = sizing.kv_size("llama-2-7b", "fp16", tokens=4096).total_bytes
    int8 = sizing.kv_size("llama-2-7b", "int8", tokens=4096, scales="per-head").total_bytes
    assert int8 - fp16 // 2 == 2 * 32 * 32 * 4  # 8 KiB of fp32 scales for 1 GiB of data


@pytest.mark.parametrize("kwargs,match", [
    (dict(dtype="int3"), "dtype must be one of"),
    (dict(tokens=-1), "tokens must be"),
    (dict(batch=0), "batch must be"),
    (dict(dtype="int8", scales="per-row"), "scales must be one of"),
    (dict(dtype="int8", scales="group-48"), "group size"),
    (dict(dtype="fp16", scales="per-head"), "stored as is"),
    (dict(dtype="int8", scale_dtype="int8"), "scale_dtype"),
])
def test_bad_input_names_the_argument(kwargs, match):
    with pytest.raises(ValueError, match=match):
        sizing.kv_size("llama-2-7b", **kwargs)


def test_unknown_preset():
    with pytest.raises(ValueError, match="unknown model preset"):
        sizing.kv_config("gpt-5")


def test_decode_step_bytes_and_crossover():
    step = sizing.decode_step_bytes("llama-2-7b", context=4096, batch=1)
    assert step["kv"] == 2 * GiB and step["weights"] == int(6.74e9 * 2)
    c = sizing.crossover_context("llama-2-7b")
    assert sizing.kv_size("llama-2-7b", tokens=c).total_bytes >= step["weights"]
    assert sizing.kv_size("llama-2-7b", tokens=c - 1).total_bytes < step["weights"]


def test_formula_matches_the_bytes_a_static_cache_allocates(tiny):
    model, _ = tiny
    cache = StaticCache.from_model(model, max_batch=3, max_seq_len=40)
    assert cache.bytes_reserved == sizing.kv_size(model, "fp32", tokens=40, batch=3).total_bytes
    half = StaticCache.from_model(model, max_batch=2, max_seq_len=8, dtype=torch.float16)
    assert half.bytes_reserved == sizing.kv_size(model, "fp16", tokens=8, batch=2).total_bytes


def test_formula_matches_the_bytes_a_growing_cache_holds(tiny):
    model, _ = tiny
    cache = ContiguousCache.from_model(model)
    g = greedy_generate(model, [[5, 6, 7], [8, 9, 10, 11, 12]], 6, cache=cache)
    stored = cache.seq_len()  # 5 prompt columns + 5 fed-back tokens
    assert stored == 5 + len(g.token_ids[0]) - 1
    assert cache.stats()["bytes_allocated"] == sizing.kv_size(model, "fp32", tokens=stored, batch=2).total_bytes


def test_fmt_bytes():
    assert sizing.fmt_bytes(512 * KiB) == "512 KiB"
    assert sizing.fmt_bytes(1.25 * GiB) == "1.25 GiB"
    assert sizing.fmt_bytes(100) == "100 B"
    assert sizing.fmt_bytes(2.5 * GiB) == "2.5 GiB" and sizing.fmt_bytes(2 * GiB) == "2 GiB"
    assert sizing.fmt_bytes(128 * GiB + 2 * KiB) == "128 GiB"  # below the last digit: no "128.00" that looks exact
