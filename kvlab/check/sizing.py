"""Notebook 00's exercises: the bytes one token adds to a KV cache, and what MLA caches instead."""

from __future__ import annotations

from typing import Callable

from kvlab import sizing
from kvlab.check.core import run_task


def _kv_bytes_cases():
    """The first case (Llama-3-8B in FP32) keeps the factors a mistake drops or adds apart, so each mistake
    gives its own number."""
    cases = []
    for name in ("llama-3-8b", "qwen2.5-7b", "llama-2-70b", "llama-2-7b", "smollm2-135m"):
        c = sizing.kv_config(name)
        for dtype, nbytes in (("fp32", 4), ("fp16", 2), ("int8", 1)):  # fp32 first: 4 bytes is not the K-and-V 2
            args = (c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, c.num_heads * c.head_dim, nbytes)
            cases.append((args, sizing.kv_bytes_per_token(name, dtype)))
    # a Gemma-7B-like shape, where hidden_size (3072) is not num_heads x head_dim (16 x 256 = 4096)
    cases.insert(3, ((28, 16, 16, 256, 3072, 2), sizing.kv_token_bytes(28, 16, 256, 2)))
    return cases


def kv_token_bytes(fn: Callable[[int, int, int, int, int, int], int]) -> bool:
    """``fn(num_layers, num_heads, num_kv_heads, head_dim, hidden_size, bytes_per_element) -> bytes one
    token adds``. Two of the sizes do not belong in the answer; the hints name them when used."""
    def hint(args, got, expected):
        layers, heads, kv_heads, dim, hidden, nbytes = args
        if heads != kv_heads and got == expected * heads / kv_heads:
            return ("that counts query heads (num_heads, or hidden_size = num_heads x head_dim): K and V are "
                    "stored per KV head (num_kv_heads); with GQA several query heads share one")
        for wrong, why in ((expected / 2, "a key AND a value are stored per head"),
                           (expected * 2, "the factor 2 is K and V, counted once"),
                           (expected / layers, "every layer keeps its own K and V for the token"),
                           (expected / kv_heads, "every KV head stores its own head_dim values"),
                           (expected / dim, "each KV head stores head_dim values for the token: multiply by head_dim"),
                           (expected / nbytes, "that counts values: multiply by the bytes per element")):
            if got == wrong:
                return why
        return None
    return run_task("kv_token_bytes", fn, _kv_bytes_cases(), hint=hint)


def mla_bytes_per_token(fn: Callable[[int, int, int, int, int], int]) -> bool:
    """``fn(num_layers, num_heads, kv_lora_rank, rope_dim, bytes_per_element)``: bytes per token of an MLA
    cache (DeepSeek-V2/V3): a latent and a RoPE key per layer, shared by all heads and by K and V."""
    shapes = [(2, 3, 8, 4, 4),  # a toy first
              (61, 128, 512, 64, 2),  # DeepSeek-V3 (and R1), fp16
              (27, 16, 512, 64, 2),  # DeepSeek-V2-Lite
              (60, 128, 512, 64, 1)]  # DeepSeek-V2, an 8-bit cache
    cases = [((layers, heads, rank, rope, b), sizing.mla_token_bytes(layers, rank, rope, b))
             for layers, heads, rank, rope, b in shapes]
    def hint(args, got, expected):
        layers, heads, rank, rope, b = args
        if got == 2 * expected:
            return "K and V are not stored separately: both are re-created from the one latent"
        if got in (expected * heads, 2 * expected * heads):
            return "the latent is not per head: one per layer serves all heads"
        if got == layers * (rank + heads * rope) * b:
            return "the RoPE key is shared by all heads, not one per head"
        if got == layers * rank * b:
            return "the decoupled RoPE key is cached too"
        return None
    return run_task("mla_bytes_per_token", fn, cases, hint=hint)
