"""The catalog of claims (notebook 06): every numeric claim of the three source articles, in table order.

One :class:`Claim` per sentence: which article says it and where, in English, the notebook section
that measures it at full size, and the function that measures it now. The measuring functions live
by topic: :mod:`kvlab.claims.memory` (byte arithmetic), :mod:`kvlab.claims.serving` (paged blocks and
batching), :mod:`kvlab.claims.quality` (INT8 quantization quality).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from kvlab.claims import arithmetic as A
from kvlab.claims.memory import (c_7b_1mb, c_7b_table, c_7b_weights, c_12_7ms, c_16ms, c_22ms, c_24_to_16, c_39pct,
                                 c_70b, c_a100_half, c_decode_1ms, c_fits, c_int4_quarter, c_int8_half, c_unfused)
from kvlab.claims.quality import (c_first_last, c_granularity, c_k_over_v, c_negligible, c_p999, c_ppl_000, c_ppl_004,
                                  c_rounding, c_saturation, c_three_bits, c_window_documents, c_zero_guard)
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
    quote: str = ""  # a few words of the article, verbatim (Chinese), to find the sentence


CLAIMS: tuple[Claim, ...] = (
    Claim("kv-7b", "004", "§2.1", "7B (32 layers, d=4096, MHA) FP16: ~512 KB per token; 2K/8K/32K/128K -> 1/4/16/64 GB",
          "00_memory_wall", "3. Checking the source articles", c_7b_table, quote="32 层就是 512KB。也就是每个 token 大约 512KB 的显存开销"),
    Claim("weights-7b", "004", "§2.1", "7B weights are 14 GB in FP16; a 32K cache outgrows them",
          "00_memory_wall", "4. A decode step reads everything", c_7b_weights,
          quote="7B 模型权重本身才 14GBFP16结果 32K 上下文的 KV Cache 就比权重还大"),
    Claim("kv-1mb", "000", "§1", "7B FP16: ~1 MB per token, 4 GB for one 4,096-token request",
          "00_memory_wall", "3. Checking the source articles", c_7b_1mb,
          quote="拿 7B 模型来说FP16 精度下每个 token 的 KV Cache 占约 1MB 显存。序列长度到 4096 时单个请求的 KV Cache 就得 4GB"),
    Claim("a100-half", "000", "§1", "on an 80 GB A100, 10 such requests take half the memory",
          "00_memory_wall", "3. Checking the source articles", c_a100_half, quote="A100 80GB 显存配置下并发 10 个请求就占了一半"),
    Claim("kv-70b", "003", "§2", "Llama-2-70B: ~1.6 MB per token, ~6.5 GB at 4,096 tokens",
          "00_memory_wall", "3. Checking the source articles", c_70b,
          quote="每个 token 的 KV Cache 大小约为 1.6MB，对于 4096 token 的上下文，单条请求就需要约 6.5GB 显存"),
    Claim("decode-1ms", "004", "§2.2", "a 4K-token cache is ~2 GB: reading it takes a little over 1 ms at 2 TB/s, every step",
          "00_memory_wall", "4. A decode step reads everything", c_decode_1ms,
          quote="每生成一个 token 读 2GB如果显存带宽是 2TB/s那光读 KV 就要 1 毫秒多"),
    Claim("int8-half", "004", "§5.2", "INT8 halves the KV memory: 4K/8K/16K contexts 2/4/8 GB -> 1/2/4 GB",
          "03_int8_quantization", "1. The bytes, exactly", c_int8_half,
          quote="4K2GB1GB50%8K4GB2GB50%16K8GB4GB50%这个结果符合预期位宽减半显存占用减半"),
    Claim("int4-quarter", "003", "§4", "INT4 cuts the KV memory to 1/4",
          "03_int8_quantization", "1. The bytes, exactly", c_int4_quarter, quote="FP16 → INT4：内存降至 1/4"),
    Claim("24-to-16gb", "004", "§5.2", "7B FP16 at 4K context needs a 24 GB card; with INT8 KV a 16 GB card will do",
          "00_memory_wall", "2. Real models", c_24_to_16,
          quote="以 7B FP16 模型 4K 上下文为例原来 24GB 显存能跑量化 KV 之后 16GB 显存也能跑"),
    Claim("b32-16k-fits", "004", "§5.1, §5.3", "benchmark: batch 32 x 16K context, 7B FP16, one A100 80 GB",
          "00_memory_wall", "4. A decode step reads everything", c_fits,
          quote="16K 上下文、batch size 32、生成 256 token 的测试"),
    Claim("22ms-step", "004", "§5.3", "that benchmark: ~22 ms per decode step with an FP16 cache",
          "00_memory_wall", "4. A decode step reads everything", c_22ms, quote="FP16 KV Cache约 22ms/token"),
    Claim("16ms-step", "004", "§5.3", "... and ~16 ms per decode step with an INT8 cache",
          "00_memory_wall", "4. A decode step reads everything", c_16ms, quote="INT8 KV Cache约 16ms/token"),
    Claim("12-7ms", "004", "§5.3", "profiler: the attention's memory reads fell from 12 ms to 7 ms",
          "00_memory_wall", "4. A decode step reads everything", c_12_7ms, quote="注意力算子里显存读取耗时从原来的 12ms 降到了 7ms"),
    Claim("int8-39pct", "004", "§5.3", "INT8 KV: decode throughput +39 % (1,450 -> 2,020 tok/s)",
          "05_fused_triton_kernel", "4. The bytes story, and what a GPU measured", c_39pct, quote="约 2020吞吐提升约 39%"),
    Claim("unfused", "004", "§4.3, §6.2", "dequantizing into a temporary FP16 copy erases the bandwidth gain",
          "05_fused_triton_kernel", "4. The bytes story, and what a GPU measured", c_unfused,
          quote="不要先把整个缓存反量化成一个临时 FP16 张量再算那等于白省了一轮带宽"),
    Claim("static-30", "003", "§2", "static pre-allocation: real use often below 30 %",
          "02_paged_blocks", "1. Where contiguous reservations go", c_static_30,
          quote="为每条请求预分配最大长度的连续内存块，实际利用率往往低于 30%"),
    Claim("static-50", "000", "§2.1", "pre-allocating the maximum length uses less than 50 %",
          "02_paged_blocks", "1. Where contiguous reservations go", c_static_50, quote="显存浪费预分配最大长度实际使用不足50%"),
    Claim("paged-90", "003", "§3", "PagedAttention: memory use from ~30 % to ~90 %+",
          "02_paged_blocks", "1. Where contiguous reservations go", c_paged_90, quote="内存利用率从传统方式的 ~30% 提升到 ~90%+"),
    Claim("frag-5-10", "000", "§4.3", "blocks of 16, ~50-token sequences: internal fragmentation 5-10 %",
          "02_paged_blocks", "7. The block-size trade-off", c_frag_50, quote="在短序列场景如单轮问答平均长度 50 token碎片率约为 5-10%"),
    Claim("prefix-40-60", "003", "§5", "a shared system prompt saves 40-60 % of the cache",
          "02_paged_blocks", "5. Prefix sharing", c_prefix,
          quote="多用户共享系统提示：开启 Shared Prefix KV Cache，可节省 40%~60% 的缓存空间"),
    Claim("util-30-80", "000", "§5", "continuous batching: GPU utilization from 30-40 % (static) to 80 %+",
          "04_continuous_batching", "1. Static batching's idle seats", c_utilization,
          quote="连续批处理将 GPU 利用率从静态批处理的 30-40% 提升至 80% 以上"),
    Claim("10-30ms", "000", "§4.2", "as the batch grows a decode step may jump from 10 ms to 30 ms",
          "04_continuous_batching", "5. Chunked prefill: time to first token and jitter", c_10_30ms,
          quote="因为批次变大单步延迟从 10ms 可能跳升到 30ms"),
    Claim("cache-5-20x", "003", "§1", "the KV cache speeds inference up 5-20x",
          "01_naive_cache", "2. Recompute vs cache, measured", c_5_20x, quote="这一优化可将推理吞吐量提升 5~20 倍"),
    Claim("zero-guard", "000", "§3", "zero guard: scale 1.0 when a head's abs-max < 1e-6",
          "03_int8_quantization", "2. The per-head quantizer, step by step", c_zero_guard,
          quote="防止除零当Head全为零时缩放因子设为1.0"),
    Claim("round-even", "004", "§4.3", "round half to even, never truncate: truncation biases the cache",
          "03_int8_quantization", "2. The per-head quantizer, step by step", c_rounding,
          quote="这里的 round 要采用 round-half-to-even不能用 truncate否则会有统计偏差"),
    Claim("granularity", "004", "§3.2", "precision, the article's table: per-head \"better\", per-channel \"medium\", "
          "per-tensor \"poor\"", "03_int8_quantization", "Granularities compared", c_granularity,
          quote="Per-Channel中中等一般场景可接受精度损失Per-Head较好中等偏低推荐"),
    Claim("3-bits", "000", "§4.1", "long-tailed key heads keep fewer than 3 effective bits after INT8",
          "03_int8_quantization", "Granularities compared", c_three_bits, quote="长尾分布量化后的有效位数不足 3 bit"),
    Claim("p999", "004", "§4.1", "99.9th-percentile scales work much better than abs-max",
          "03_int8_quantization", "3. Calibration and clipping", c_p999,
          quote="我实测用的是 99.9 百分位超出范围的值直接 clamp效果比纯 max 好很多"),
    Claim("ppl-0.1", "004", "§5.4", "INT8: perplexity 9.61 -> 9.70 (under +0.1)",
          "03_int8_quantization", "7. The articles' quality claims", c_ppl_004,
          quote="量化后 perplexity 从 9.61 涨到 9.70涨幅 0.09"),
    Claim("ppl-0.5-1.5", "000", "§3.1", "INT8 KV degrades perplexity by 0.5-1.5 % on a 7B model",
          "03_int8_quantization", "7. The articles' quality claims", c_ppl_000,
          quote="INT8 KV Cache 量化导致的困惑度Perplexity退化约为 0.5-1.5%"),
    Claim("negligible", "003", "§4", "FP16 -> INT8: accuracy loss negligible for most tasks",
          "03_int8_quantization", "7. The articles' quality claims", c_negligible,
          quote="FP16 → INT8：内存减半，对大多数任务精度损失可忽略不计"),
    Claim("k-over-v", "000", "§3.1", "key errors matter more than value errors (004 §3.3, §7: K8V4 possible)",
          "03_int8_quantization", "5. K vs V, layers, and mixed precision", c_k_over_v, quote="Key 向量的误差对注意力权重的影响更显著"),
    Claim("first-last", "000", "§3.2", "the first and last layers are precision-sensitive: keep them FP16",
          "03_int8_quantization", "5. K vs V, layers, and mixed precision", c_first_last,
          quote="对于对精度敏感的层如第一层和最后一层的注意力可以保留 FP16 精度"),
    Claim("saturation", "004", "§6.1", "saturated static scales turn long contexts into garbage; widening fixes it",
          "03_int8_quantization", "4. Saturation: when static scales go wrong", c_saturation,
          quote="检测到 int8 值大量集中在 ±127 两端说明饱和了临时改用更大的 scale"),
    # settled by arithmetic on sizes, or by reasoning (kvlab/claims/arithmetic.py)
    Claim("decode-memory-bound", "000", "§1", "decode is limited by memory bandwidth, not by compute (7B, batch 1, 4K context)",
          "00_memory_wall", "4. A decode step reads everything", A.c_decode_memory_bound, quote="往往不是算力不够而是显存带宽扛不住"),
    Claim("prefill-compute-bound", "000", "§1", "prefill processes the prompt in parallel and is compute-bound",
          "00_memory_wall", "4. A decode step reads everything", A.c_prefill_compute_bound, quote="预填充Prefill阶段并行处理输入 prompt计算密集"),
    Claim("l2-threshold", "000", "§1", "once the KV cache exceeds the L2 cache, every step reads HBM: the bandwidth bottleneck arrives",
          "00_memory_wall", "4. A decode step reads everything", A.c_l2_threshold, quote="KV Cache 一旦超过 L2 缓存容量"),
    Claim("zero-fragmentation", "000", "§2.1", "paged blocks: zero fragmentation, blocks of different requests interleave",
          "02_paged_blocks", "1. Where contiguous reservations go", A.c_zero_fragmentation, quote="零碎片不同请求的 Block 可以交错存放"),
    Claim("per-block-scales-50", "000", "§3 code", "INT8 with per-block, per-head scales cuts the cache memory by 50 %",
          "03_int8_quantization", "1. The bytes, exactly", A.c_per_block_scales, quote="动态量化为INT8减少50%显存占用"),
    Claim("deferred-quant", "000", "§3 code", "deferred quantization (only when a block is swapped out of HBM) saves the 50 %",
          "03_int8_quantization", "1. The bytes, exactly", A.c_deferred_quant, quote="延迟量化仅在Block换出HBM时执行量化"),
    Claim("low-concurrency", "000", "§4.4", "with ample memory and low concurrency, KV quantization is not worth it",
          "00_memory_wall", "4. A decode step reads everything", A.c_low_concurrency, quote="显存充裕且并发度低的场景"),
    Claim("no-cache-realtime", "003", "§1", "without a KV cache, long conversations can hardly respond in real time",
          "01_naive_cache", "2. Recompute vs cache, measured", A.c_no_cache_realtime, quote="没有 KV Cache，长对话场景几乎不可能做到实时响应"),
    Claim("kv-linear-batch", "003", "§2", "under high concurrency the KV memory multiplies (linear in the batch)",
          "00_memory_wall", "3. Checking the source articles", A.c_kv_linear_batch, quote="在高并发场景下，这一数字会成倍放大"),
    Claim("70b-one-card", "003", "§4", "vllm serve Llama-2-70B with --gpu-memory-utilization 0.9 and no tensor parallelism",
          "00_memory_wall", "2. Real models", A.c_70b_needs_tp, quote="meta-llama/Llama-2-70b-chat-hf"),
    Claim("swa-caps-memory", "003", "§5", "for long documents, INT8 plus sliding-window attention caps the peak memory",
          "00_memory_wall", "3. Checking the source articles", A.c_sliding_window_cap, quote="搭配 INT8 量化 + Sliding Window Attention"),
    Claim("swa-documents", "003", "§5", "for long-document tasks (document analysis), a sliding window is the "
          "memory control to pair with INT8", "07_beyond_one_engine", "4. What eviction forgets: a pass key",
          c_window_documents, quote="长上下文任务（如文档分析）：搭配 INT8 量化 + Sliding Window Attention，控制显存峰值"),
    Claim("spec-ttft", "003", "§5", "speculative decoding with a small draft model lowers the time to first token",
          "04_continuous_batching", "5. Chunked prefill: time to first token and jitter", A.c_speculative_ttft, quote="降低首 token 延迟"),
    Claim("mla-smaller", "003", "§5", "MLA (DeepSeek) shrinks the cache fundamentally by compressing the KV dimension",
          "00_memory_wall", "Task 2 — what does MLA store?", A.c_mla_smaller, quote="通过压缩 KV 的维度从根本上减少了缓存体积"),
    Claim("8k-16k-need-quant", "004", "§1", "8K, 16K and longer contexts basically cannot run without quantization (7B)",
          "00_memory_wall", "2. Real models", A.c_long_context_fits, quote="8K、16K 以上的长上下文场景没有量化之前基本跑不动"),
    Claim("int8-bigger-batch", "004", "§1", "with INT8 the same memory holds longer contexts and bigger batches",
          "00_memory_wall", "2. Real models", A.c_int8_doubles_batch, quote="在相同显存下装下更长的上下文、更大的 batch"),
    Claim("layer-16kb", "004", "§2.1", "per token and layer, K and V take 2 x d x 2 bytes in FP16: about 16 KB (7B)",
          "00_memory_wall", "1. What one token costs", A.c_layer_16kb, quote="K 和 V 两份 × d × 2 字节"),
    Claim("bandwidth-linear", "004", "§2.2", "with several concurrent requests the bandwidth pressure grows linearly",
          "00_memory_wall", "4. A decode step reads everything", A.c_bandwidth_linear, quote="如果并发放多个请求带宽压力线性增长"),
    Claim("test-model-shape", "004", "§5.1", "the test model: 7B parameters, 32 layers, 32 heads, head_dim 128",
          "00_memory_wall", "3. Checking the source articles", A.c_test_model_consistent, quote="7B 参数规模32 层32 头head_dim 128"),
    Claim("latency-throughput", "004", "§5.3", "~22 ms/token -> ~1,450 tok/s and ~16 ms -> ~2,020 tok/s (batch 32)",
          "00_memory_wall", "4. A decode step reads everything", A.c_latency_throughput, quote="约 22ms/token约 1450"),
    Claim("saved-is-transfer", "004", "§5.3", "the time saved (22 -> 16 ms) is basically the saved transfer time (12 -> 7 ms)",
          "00_memory_wall", "4. A decode step reads everything", A.c_saved_reads_sum, quote="这个时间基本就是省下来的传输时间"),
    Claim("gate-1pct", "004", "§5.4", "gate INT8 on the business eval set at a 1 % threshold",
          "03_int8_quantization", "7. The articles' quality claims", A.c_gate_1pct, quote="业务评测集按 1% 阈值卡"),
    Claim("unfused-fp16-copy", "004", "§6.2", "the unfused read (.float(), then x scale) builds a full temporary copy (the article: FP16)",
          "05_fused_triton_kernel", "4. The bytes story, and what a GPU measured", A.c_unfused_temp_fp32, quote="先float()再乘 scale"),
    Claim("pool-halves", "004", "§6.3", "with an INT8 KV cache the (vLLM) pool's occupancy halves too",
          "04_continuous_batching", "6. INT8 blocks: twice the requests in the same bytes", A.c_pool_bytes_fixed, quote="改 KV Cache 为 int8 后这个池子的占用也减半"),
    Claim("gain-above-4k", "004", "§7", "above 4K context and more than a handful of concurrent requests the gain is plain to see",
          "00_memory_wall", "4. A decode step reads everything", A.c_gain_above_4k, quote="上下文长度超过 4K、并发请求数超过个位数"),
    Claim("k8v4-lower", "004", "§7", "K8V4 (V in INT4, where validation allows) lowers the bandwidth further",
          "03_int8_quantization", "6. INT4 and rotation", A.c_k8v4_lower, quote="V 在验证集允许的前提下尝试 INT4"),
    Claim("finer-scales-cost", "004", "§7", "finer scales (per token): a higher accuracy ceiling, at the cost of a finer implementation",
          "03_int8_quantization", "1. The bytes, exactly", A.c_finer_scales_cost, quote="代价是实现要更细"),
)
