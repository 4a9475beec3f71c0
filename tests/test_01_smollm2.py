"""The real model: token identity with HF's DynamicCache on SmolLM2-135M (fp32, greedy)."""

import pytest

from kvlab.data import text_tokens
from kvlab.generate import encode_prompts, greedy_generate, hf_generate

pytestmark = pytest.mark.slow


def test_single_prompts_all_caches(smollm2):
    model, tok = smollm2
    for text, n in (("Once upon a time", 24), ("The capital of France is", 12)):
        prompts = encode_prompts(tok, text)
        ref = hf_generate(model, prompts, n, eos_token_id=tok.eos_token_id, pad_token_id=tok.pad_token_id)
        for cache in ("dynamic", "static"):
            g = greedy_generate(model, prompts, n, cache=cache, eos_token_id=tok.eos_token_id,
                                pad_token_id=tok.pad_token_id)
            assert g.token_ids == ref, (text, cache)


def test_batch_of_different_lengths(smollm2):
    model, tok = smollm2
    prompts = encode_prompts(tok, ["Once upon a time", "Write a haiku about the sea.",
                                   "def fibonacci(n):"]) + [text_tokens(tok, 96, offset=200)]
    ref = hf_generate(model, prompts, 16, pad_token_id=tok.pad_token_id)
    for cache in ("none", "dynamic", "static"):
        assert greedy_generate(model, prompts, 16, cache=cache, pad_token_id=tok.pad_token_id).token_ids == ref


def test_text_is_coherent(smollm2):
    model, tok = smollm2
    g = greedy_generate(model, encode_prompts(tok, "Once upon a time"), 12, cache="static")
    assert "Once upon a time" not in tok.decode(g.token_ids[0])  # generated only
    assert tok.decode(g.token_ids[0]).startswith(", ")


def test_paged_batch_and_prefix_hits_match_hf(smollm2):
    """Notebook 02's anchor on the real model: paged (block 16), batch of different lengths, and a
    second request served from the first's cached system-prompt blocks."""
    from kvlab.cache import BlockManager, PagedKVCache
    from kvlab.generate import paged_generate

    model, tok = smollm2
    prompts = encode_prompts(tok, ["Once upon a time", "Write a haiku about the sea."]) + [text_tokens(tok, 70)]
    assert paged_generate(model, prompts, 12, block_size=16).token_ids == hf_generate(model, prompts, 12)
    system = text_tokens(tok, 48, offset=500)
    bm = BlockManager(32, 16)
    cache = PagedKVCache.from_model(model, 32, 16)
    for tail in (encode_prompts(tok, " Who is speaking?")[0], encode_prompts(tok, " Where are we?")[0]):
        g = paged_generate(model, [system + tail], 10, manager=bm, cache=cache)
        assert g.token_ids == hf_generate(model, [system + tail], 10)
    assert g.cache_stats["cached_prompt_tokens"] == 48
