"""Notebook 00's answers in the tasks' own signatures (``check.solution`` prints them). kvlab's sizing
(:mod:`kvlab.sizing`) takes only what it needs; the tasks hand over the distractors a config also holds
(query heads, hidden size), so these ignore them. tests/test_check.py holds them to kvlab.sizing."""

from __future__ import annotations


def kv_token_bytes(num_layers, num_heads, num_kv_heads, head_dim, hidden_size, bytes_per_element):
    """K and V (2), in every layer, for every KV head (not query head), head_dim values each."""
    return 2 * num_layers * num_kv_heads * head_dim * bytes_per_element


def mla_bytes_per_token(num_layers, num_heads, kv_lora_rank, rope_dim, bytes_per_element):
    """MLA caches one compressed latent and one shared RoPE key per layer: no K/V pair, no heads."""
    return num_layers * (kv_lora_rank + rope_dim) * bytes_per_element
