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
