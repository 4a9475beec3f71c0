"""Naive caches: token-identical to HF's DynamicCache (tiny model), honest counters, safe errors."""

import pytest
import torch
from transformers import DynamicCache

from kvlab.cache import ContiguousCache, StaticCache
from kvlab.generate import greedy_generate, hf_generate, left_pad
from kvlab.hf import CACHE_KWARG, KVLabCache, _query_length

PROMPTS = [
    [[5, 6, 7, 8, 9, 10, 11]],
    [[5, 6, 7, 8, 9, 10, 11], [40, 41, 42], [100] * 12],  # batch of 3, different lengths
    [[200 + i % 50 for i in range(60)], [3], [17, 18, 19, 20]],
]


@pytest.mark.parametrize("prompts", PROMPTS)
@pytest.mark.parametrize("new_tokens", [1, 5, 24])
@pytest.mark.parametrize("cache", ["none", "dynamic", "static"])
def test_greedy_tokens_match_hf_dynamic_cache(tiny, prompts, new_tokens, cache):
    model, _ = tiny
    ref = hf_generate(model, prompts, new_tokens)
    assert greedy_generate(model, prompts, new_tokens, cache=cache).token_ids == ref


@pytest.mark.parametrize("store", ["dynamic", "static"])
def test_hf_generate_runs_through_kvlab_caches(tiny, store):
    """The caches plug into model.generate() itself, not only into our loop."""
    model, _ = tiny
    prompts = PROMPTS[1]
    ref = hf_generate(model, prompts, 16)
    s = ContiguousCache.from_model(model) if store == "dynamic" else StaticCache.from_model(model, 3, 64)
    assert hf_generate(model, prompts, 16, cache=KVLabCache(s)) == ref
    assert s.seq_len() == 12 + 16 - 1  # longest prompt + fed-back tokens, padding included


def test_kv_tensors_equal_hf_dynamic_cache(tiny):
    """The stored post-RoPE K/V are exactly HF's, layer by layer."""
    model, _ = tiny
    ids, mask = left_pad(PROMPTS[1], 0)
    hf, ours = DynamicCache(config=model.config), ContiguousCache.from_model(model)
    with torch.inference_mode():
        # cache= from transformers 5.24, past_key_values= before (kvlab.hf's shim knows which)
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{CACHE_KWARG: hf})
        model(input_ids=ids, attention_mask=mask, use_cache=True, **{CACHE_KWARG: KVLabCache(ours)})
    for layer in range(model.config.num_hidden_layers):
        assert torch.equal(hf.layers[layer].keys, ours.keys[layer])
        assert torch.equal(hf.layers[layer].values, ours.values[layer])


def test_eos_stops_rows_like_hf(tiny):
    model, _ = tiny
    prompts = PROMPTS[1]
    free = greedy_generate(model, prompts, 20).token_ids
    eos = free[0][3]  # a token row 0 emits early: rows stop at different steps
    ref = hf_generate(model, prompts, 20, eos_token_id=eos)
    for cache in ("none", "dynamic", "static"):
        g = greedy_generate(model, prompts, 20, cache=cache, eos_token_id=eos)
        assert g.token_ids == ref, cache
    assert ref[0] == free[0][: free[0].index(eos) + 1]


def test_static_cache_counts_tokens_padding_and_empty_slots(tiny):
    model, _ = tiny
    prompts = PROMPTS[1]  # lengths 7, 3, 12: left padding 5, 9, 0
    cache = StaticCache.from_model(model, max_batch=4, max_seq_len=50)
    g = greedy_generate(model, prompts, 10, cache=cache)
    s = cache.stats()
    assert s["seq_len"] == 12 + 9
    assert s["tokens_stored"] == (7 + 9) + (3 + 9) + (12 + 9)
    assert s["padding_slots"] == 5 + 9
    assert s["empty_slots"] == 4 * 50 - 3 * 21
    assert s["utilization"] == pytest.approx(s["tokens_stored"] / 200)
    assert s["tokens_stored"] + s["padding_slots"] + s["empty_slots"] == s["slots_reserved"]
    assert len(g.token_ids[0]) == 10


def test_static_cache_padding_after_eos_is_not_counted_as_tokens(tiny):
    model, _ = tiny
    prompts = PROMPTS[1]
    eos = greedy_generate(model, prompts, 20).token_ids[0][3]
    cache = StaticCache.from_model(model, max_batch=3, max_seq_len=40)
    g = greedy_generate(model, prompts, 20, cache=cache, eos_token_id=eos)
    steps_fed = max(len(t) for t in g.token_ids) - 1
    expected = sum(len(p) + min(len(t), steps_fed) for p, t in zip(prompts, g.token_ids))
    assert cache.stats()["tokens_stored"] == expected
    assert cache.stats()["padding_slots"] > 5 + 9  # row 0 keeps receiving pads after its EOS


def test_static_cache_overflow_is_refused_and_leaves_state_intact(tiny):
    model, _ = tiny
    cache = StaticCache.from_model(model, max_batch=2, max_seq_len=8)
    k = torch.randn(2, 2, 6, 16)
    cache.update(0, k, k)
    before = cache.k_cache[0].clone()
    with pytest.raises(ValueError, match="max_seq_len=8"):
        cache.update(0, k[:, :, :3], k[:, :, :3])
    assert cache.seq_len(0) == 6 and torch.equal(cache.k_cache[0], before)
    with pytest.raises(ValueError, match="max_batch=2"):
        cache.update(1, torch.randn(3, 2, 1, 16), torch.randn(3, 2, 1, 16))
    with pytest.raises(ValueError, match="heads"):
        cache.update(1, torch.randn(2, 3, 1, 16), torch.randn(2, 3, 1, 16))
    with pytest.raises(ValueError, match="layer_idx"):
        cache.update(7, k, k)
    assert cache.seq_len(1) == 0


def test_prompt_longer_than_static_cache_is_a_clear_error(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="longer than the static cache's max_seq_len=4"):
        greedy_generate(model, [[5] * 10], 3, cache="static", max_seq_len=4)


def test_static_cache_stops_when_full(tiny):
    model, _ = tiny
    g = greedy_generate(model, [[5, 6, 7]], 50, cache="static", max_seq_len=10)
    assert len(g.token_ids[0]) == 8  # 3 prompt + 7 fed-back tokens fill 10 slots; the 8th is never stored
    assert g.token_ids == hf_generate(model, [[5, 6, 7]], 8)


@pytest.mark.parametrize("kwargs,match", [
    (dict(max_new_tokens=0), "max_new_tokens"),
    (dict(max_new_tokens=-2), "max_new_tokens"),
    (dict(prompts=[[]]), "prompt 0 is empty"),
    (dict(prompts=[]), "non-empty list"),
    (dict(cache="paged-ish"), "cache must be one of"),
])
def test_bad_generate_arguments(tiny, kwargs, match):
    model, _ = tiny
    args = dict(prompts=[[5, 6]], max_new_tokens=3) | kwargs
    with pytest.raises(ValueError, match=match):
        greedy_generate(model, args.pop("prompts"), args.pop("max_new_tokens"), **args)


def test_growing_cache_counts_the_bytes_it_copies(tiny):
    model, _ = tiny
    cache = ContiguousCache.from_model(model)
    greedy_generate(model, [[5, 6, 7, 8]], 5, cache=cache)
    # per layer, K and V: each of the 4 decode appends copies the old (B=1, H=2, T, D=16) fp32 tensors
    per_token = 2 * 2 * 16 * 4
    layers = model.config.num_hidden_layers
    assert cache.stats()["bytes_copied"] == layers * per_token * sum(range(4, 8))


def test_shim_accepts_both_mask_size_arguments():
    assert _query_length(5) == 5
    assert _query_length(torch.arange(3, 10)) == 7  # an older cache_position tensor
