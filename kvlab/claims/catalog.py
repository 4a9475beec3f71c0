"""The catalog of claims (notebook 06): every numeric claim of the three source articles, in table order.

One :class:`Claim` per sentence: which article says it and where, in English, the notebook section
that measures it at full size, and the function that measures it now. The measuring functions live
by topic: :mod:`kvlab.claims.memory` (byte arithmetic), :mod:`kvlab.claims.serving` (paged blocks and
batching), :mod:`kvlab.claims.quality` (INT8 quantization quality).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvlab.claims.memory import (c_7b_1mb, c_7b_table, c_7b_weights, c_12_7ms, c_16ms, c_22ms, c_24_to_16, c_39pct,
                                 c_70b, c_a100_half, c_decode_1ms, c_fits, c_int4_quarter, c_int8_half, c_unfused)
from kvlab.claims.quality import (c_first_last, c_granularity, c_k_over_v, c_negligible, c_p999, c_ppl_000, c_ppl_004,
                                  c_rounding, c_saturation, c_three_bits, c_zero_guard)
from kvlab.claims.serving import (c_5_20x, c_10_30ms, c_frag_50, c_paged_90, c_prefix, c_static_30, c_static_50,
                                  c_utilization)


@dataclass(frozen=True)
class Claim:
    """An article's sentence and the function that measures it: the verdict comes from the measurement."""

    id: str
    article: str  # "000" the inference-engine article, "003" the KV-cache article, "004" the TurboQuant article
    where: str  # the article's section
    text: str  # what the article says, in English
    notebook: str  # the notebook whose section measures it at full size
    section: str  # that section's heading, without the leading #'s
    measure: Callable  # (Lab) -> (measured: str, verdict: str, why: str)


CLAIMS: tuple[Claim, ...] = (
    Claim("kv-7b", "004", "§2.1", "7B (32 layers, d=4096, MHA) FP16: ~512 KB per token; 2K/8K/32K/128K -> 1/4/16/64 GB",
          "00_memory_wall", "3. Checking the source articles", c_7b_table),
    Claim("weights-7b", "004", "§2.1", "7B weights are 14 GB in FP16; a 32K cache outgrows them",
          "00_memory_wall", "4. A decode step reads everything", c_7b_weights),
    Claim("kv-1mb", "000", "§1", "7B FP16: ~1 MB per token, 4 GB for one 4,096-token request",
          "00_memory_wall", "3. Checking the source articles", c_7b_1mb),
    Claim("a100-half", "000", "§1", "on an 80 GB A100, 10 such requests take half the memory",
          "00_memory_wall", "3. Checking the source articles", c_a100_half),
    Claim("kv-70b", "003", "§2", "Llama-2-70B: ~1.6 MB per token, ~6.5 GB at 4,096 tokens",
          "00_memory_wall", "3. Checking the source articles", c_70b),
    Claim("decode-1ms", "004", "§2.2", "a 4K-token cache is ~2 GB: reading it takes ~1 ms at 2 TB/s, every step",
          "00_memory_wall", "4. A decode step reads everything", c_decode_1ms),
    Claim("int8-half", "004", "§5.2", "INT8 halves the KV memory: 4K/8K/16K contexts 2/4/8 GB -> 1/2/4 GB",
          "03_int8_quantization", "1. The bytes, exactly", c_int8_half),
    Claim("int4-quarter", "003", "§4", "INT4 cuts the KV memory to 1/4",
          "03_int8_quantization", "1. The bytes, exactly", c_int4_quarter),
    Claim("24-to-16gb", "004", "§5.2", "7B FP16 at 4K context needs a 24 GB card; with INT8 KV a 16 GB card will do",
          "00_memory_wall", "2. Real models", c_24_to_16),
    Claim("b32-16k-fits", "004", "§5.1, §5.3", "benchmark: batch 32 x 16K context, 7B FP16, one A100 80 GB",
          "00_memory_wall", "4. A decode step reads everything", c_fits),
    Claim("22ms-step", "004", "§5.3", "that benchmark: ~22 ms per decode step with an FP16 cache",
          "00_memory_wall", "4. A decode step reads everything", c_22ms),
    Claim("16ms-step", "004", "§5.3", "... and ~16 ms per decode step with an INT8 cache",
          "00_memory_wall", "4. A decode step reads everything", c_16ms),
    Claim("12-7ms", "004", "§5.3", "profiler: the attention's memory reads fell from 12 ms to 7 ms",
          "00_memory_wall", "4. A decode step reads everything", c_12_7ms),
    Claim("int8-39pct", "004", "§5.3", "INT8 KV: decode throughput +39 % (1,450 -> 2,020 tok/s)",
          "05_fused_triton_kernel", "4. The bytes story, and what a GPU measured", c_39pct),
    Claim("unfused", "004", "§4.3, §6.2", "dequantizing into a temporary FP16 copy erases the bandwidth gain",
          "05_fused_triton_kernel", "4. The bytes story, and what a GPU measured", c_unfused),
    Claim("static-30", "003", "§2", "static pre-allocation: real use often below 30 %",
          "02_paged_blocks", "1. Where contiguous reservations go", c_static_30),
    Claim("static-50", "000", "§2.1", "pre-allocating the maximum length uses less than 50 %",
          "02_paged_blocks", "1. Where contiguous reservations go", c_static_50),
    Claim("paged-90", "003", "§3", "PagedAttention: memory use from ~30 % to ~90 %+",
          "02_paged_blocks", "1. Where contiguous reservations go", c_paged_90),
    Claim("frag-5-10", "000", "§4.3", "blocks of 16, ~50-token sequences: internal fragmentation 5-10 %",
          "02_paged_blocks", "7. The block-size trade-off", c_frag_50),
    Claim("prefix-40-60", "003", "§5", "a shared system prompt saves 40-60 % of the cache",
          "02_paged_blocks", "5. Prefix sharing", c_prefix),
    Claim("util-30-80", "000", "§5", "continuous batching: GPU utilization from 30-40 % (static) to 80 %+",
          "04_continuous_batching", "1. Static batching's idle seats", c_utilization),
    Claim("10-30ms", "000", "§4.2", "as the batch grows a decode step jumps from 10 ms to 30 ms",
          "04_continuous_batching", "5. Chunked prefill: time to first token and jitter", c_10_30ms),
    Claim("cache-5-20x", "003", "§1", "the KV cache speeds inference up 5-20x",
          "01_naive_cache", "2. Recompute vs cache, measured", c_5_20x),
    Claim("zero-guard", "000", "§3", "zero guard: scale 1.0 when a head's abs-max < 1e-6",
          "03_int8_quantization", "2. The per-head quantizer, step by step", c_zero_guard),
    Claim("round-even", "004", "§4.3", "round half to even, never truncate: truncation biases the cache",
          "03_int8_quantization", "2. The per-head quantizer, step by step", c_rounding),
    Claim("granularity", "004", "§3.2", "per-head beats per-channel beats per-tensor",
          "03_int8_quantization", "Granularities compared", c_granularity),
    Claim("3-bits", "000", "§4.1", "long-tailed key heads keep fewer than 3 effective bits after INT8",
          "03_int8_quantization", "Granularities compared", c_three_bits),
    Claim("p999", "004", "§4.1", "99.9th-percentile scales work much better than abs-max",
          "03_int8_quantization", "3. Calibration and clipping", c_p999),
    Claim("ppl-0.1", "004", "§5.4", "INT8: perplexity 9.61 -> 9.70 (under +0.1)",
          "03_int8_quantization", "7. The articles' quality claims", c_ppl_004),
    Claim("ppl-0.5-1.5", "000", "§3.1", "INT8 KV degrades perplexity by 0.5-1.5 % on a 7B model",
          "03_int8_quantization", "7. The articles' quality claims", c_ppl_000),
    Claim("negligible", "003", "§4", "FP16 -> INT8: accuracy loss negligible for most tasks",
          "03_int8_quantization", "7. The articles' quality claims", c_negligible),
    Claim("k-over-v", "000", "§3.1", "key errors matter more than value errors (004 §3.3, §7: K8V4 possible)",
          "03_int8_quantization", "5. K vs V, layers, and mixed precision", c_k_over_v),
    Claim("first-last", "000", "§3.2", "the first and last layers are precision-sensitive: keep them FP16",
          "03_int8_quantization", "5. K vs V, layers, and mixed precision", c_first_last),
    Claim("saturation", "004", "§6.1", "saturated static scales turn long contexts into garbage; widening fixes it",
          "03_int8_quantization", "4. Saturation: when static scales go wrong", c_saturation),
)
