"""Claims that arithmetic on sizes settles, and claims that reasoning settles (notebook 06).

Each ``c_...`` function measures from :mod:`kvlab.sizing` and returns ``(measured, verdict, why)``; its
keyword arguments are the quantities it measures, so a test can plant others and see the verdict flip.
"""

from __future__ import annotations

from kvlab import sizing
from kvlab.bench.vllm_peer import kv_cache_options
from kvlab.cache import simulate
from kvlab.claims.memory import A100_BW, A100_BYTES, GiB, KiB, kv_bytes
from kvlab.cache.paged import BlockManager
from kvlab.claims.rules import margin, parts, ratio, shown, truth, worst
from kvlab.kernels.pool import kernel_kind
from kvlab.kernels.traffic import (COMPUTE_CAPABILITY, FP8_MIN_CAPABILITY, GPU_BANDWIDTH, GPU_CORES, PIPE_RATE,
                                   SMEM_BYTES_PER_CLOCK)
from kvlab.sizing import fmt_bytes

A100_FLOPS = GPU_CORES["A100"][2]  # dense fp16 tensor-core FLOP/s
A100_RIDGE = A100_FLOPS / A100_BW  # FLOP per byte read below which a kernel is memory-bound
A100_L2 = 40 * 2**20  # bytes of L2 (datasheet)
H200_HBM = 143_771 * 2**20  # bytes: the "141 GB" card reports 143,771 MiB (140.4 GiB)
_7B = "llama-2-7b"


def _params(model=_7B) -> float:
    return sizing.kv_config(model).num_params


def _max_speedup(context: int, batch: int, model=_7B) -> float:
    """The most an INT8 cache can speed a decode step whose time is its bytes: FP16 bytes / INT8 bytes."""
    return (sizing.decode_step_bytes(model, context, batch)["total"]
            / sizing.decode_step_bytes(model, context, batch, kv_cache_dtype="int8")["total"])


# ---- where the time goes ---------------------------------------------------------------------------

def c_decode_memory_bound(lab, batch: int = 1, context: int = 4096):
    """FLOPs per byte of a decode step against the A100's ridge point (peak FLOP/s / peak B/s)."""
    step = sizing.decode_step_bytes(_7B, context, batch)["total"]
    intensity = 2 * _params() * batch / step
    return (f"batch {batch} x {context}: {intensity:.1f} FLOP per byte read; the A100 needs {A100_RIDGE:.0f} to be "
            "compute-bound", truth(intensity < A100_RIDGE),
            "2 FLOPs per parameter per token over weights + KV read once per step; decode stays memory-bound "
            "until the batch shares each weight read among ~150 tokens (and attention over the KV never does)")


def c_prefill_compute_bound(lab, prompt: int = 512):
    intensity = 2 * _params() * prompt / sizing.weight_bytes(_7B)
    return (f"a {prompt}-token prefill: {intensity:.0f} FLOP per weight byte (A100 ridge {A100_RIDGE:.0f})",
            truth(intensity > A100_RIDGE), "all prompt tokens share one read of every weight")


def c_l2_threshold(lab, weights: int | None = None, l2: int = A100_L2):
    weights = sizing.weight_bytes(_7B) if weights is None else weights
    tokens = l2 / sizing.kv_bytes_per_token(_7B, "fp16")
    return (f"the A100's {l2 / 2**20:.0f} MiB L2 holds {tokens:.0f} tokens of 7B KV; the weights are "
            f"{weights / l2:.0f}x the L2",
            parts(tokens < 4096, weights < l2, "that a real cache outgrows the L2",
                  "that the L2 marks a threshold (below it, no HBM bottleneck)"),
            "the sentence draws a threshold (「一旦超过…显存带宽瓶颈就来了」: once past it, the bandwidth "
            "bottleneck arrives); a 7B cache does pass the L2 after ~80 tokens, but the threshold marks nothing: "
            "every decode step reads HBM whatever the cache's size, since the weights alone overflow the L2")


def c_no_cache_realtime(lab, context: int = 4096, interactive_tok_s: float = 10.0):
    flops = 2 * _params() * context  # every step re-runs the whole context
    tok_s = A100_FLOPS / flops
    return (f"without a cache one step at {context} tokens is {flops / 1e12:.0f} TFLOP: at most {tok_s:.1f} tok/s "
            f"on an A100 at peak", truth(tok_s < interactive_tok_s),
            f"rule: real time = at least {interactive_tok_s:g} tok/s (a reader's pace); the peak is never reached")


def c_low_concurrency(lab, batch: int = 1, context: int = 4096):
    best = _max_speedup(context, batch)
    step = sizing.decode_step_bytes(_7B, context, batch)
    return (f"7B, batch {batch} x {context}: the KV is {step['kv'] / step['total']:.0%} "
            f"of a step's bytes, so INT8 speeds it at most {best:.2f}x", truth(best < 1.1),
            "the weights dominate a lone short request; what INT8 saves there is memory nobody needs")


def c_gain_above_4k(lab, context: int = 4096, batch: int = 10, measured: float | None = None):
    """``measured``: a step speed-up measured at that setting on a GPU (the lab has none for a 7B)."""
    big, alone = _max_speedup(context, batch), _max_speedup(context, 1)
    return (f"7B at {context}: the bytes allow INT8 to speed a step up to {big:.2f}x at batch {batch}, "
            f"{alone:.2f}x alone" + (f"; measured {measured:.2f}x" if measured else ""),
            shown(big >= 1.3 and alone < 1.1, measured is not None and measured >= 1.3, "a GPU serving a 7B"),
            "rule: 'plain to see' = at least 1.3x; the bytes allow it above 4K with ten requests and not alone, "
            "but a bound is not a gain: a kernel must reach it")


def c_bandwidth_linear(lab, batches=(1, 2, 8, 32), context: int = 4096, steps=None):
    steps = steps or [sizing.decode_step_bytes(_7B, context, b) for b in batches]
    per = steps[0]["kv"] / batches[0]
    ok = all(s["kv"] == b * per and s["weights"] == steps[0]["weights"] for s, b in zip(steps, batches))
    return (f"KV read per step at {context}: " + ", ".join(f"b={b} {s['kv'] / GiB:.0f} GiB" for s, b in zip(steps, batches))
            + f"; weights {steps[0]['weights'] / GiB:.1f} GiB at every batch", truth(ok),
            "affine in the batch: the KV part is linear, the weights are read once whatever the batch")


def c_kv_linear_batch(lab, batches=(1, 4, 16, 64), tokens: int = 2048, sizes=None):
    sizes = sizes or [kv_bytes(tokens=tokens, batch=b) for b in batches]
    return (f"7B FP16 at {tokens:,} tokens each: " + ", ".join(f"batch {b}: {s / GiB:g} GiB" for b, s in zip(batches, sizes)),
            truth(all(s == b * sizes[0] for b, s in zip(batches, sizes))),
            "each sequence holds its own cache (without prefix sharing)")


def c_saved_reads_sum(lab, step_ms: float = 22.0, reads_before: float = 12.0, reads_after: float = 7.0,
                      claimed_ms: float = 16.0):
    saved, transfer = step_ms - claimed_ms, reads_before - reads_after
    return (f"the step saves {step_ms:g} - {claimed_ms:g} = {saved:g} ms; the reads save {reads_before:g} - "
            f"{reads_after:g} = {transfer:g} ms", ratio(saved, transfer),
            f"the article's own numbers: the transfer explains {transfer:g} of the {saved:g} ms saved; 'basically' "
            "is held to the ±15 % every approximate figure of the table gets (约 'about' included), and the part "
            f"the transfer leaves unexplained is {abs(saved - transfer) / saved:.0%} of the saving")


# ---- what fits ----------------------------------------------------------------------------------------

def c_long_context_fits(lab, context: int = 16384, card: int = 24 * GiB):
    need = sizing.weight_bytes(_7B) + kv_bytes(tokens=context)
    a100_tokens = (A100_BYTES - sizing.weight_bytes(_7B)) // sizing.kv_bytes_per_token(_7B, "fp16")
    roomy = int(0.9 * A100_BYTES - sizing.weight_bytes(_7B)) // kv_bytes(tokens=context)
    return (f"7B FP16, one {context}-token request: {fmt_bytes(need)} of weights + KV ({need / card:.0%} of a "
            f"{fmt_bytes(card)} card); an 80 GB A100 holds {a100_tokens // context} such requests to the last byte, "
            f"{roomy} with 10 % left for activations and the runtime", margin(need, card),
            f"the claim is that 8K-16K cannot run without quantization; at batch 1 it fits a 24 GB card with room to "
            f"spare, and an 80 GB A100 holds {a100_tokens / 1000:.0f}K FP16 tokens beside the weights: quantization "
            f"buys batch, not the ability to run")


def c_int8_doubles_batch(lab, context: int = 16384, hbm: int = A100_BYTES, int8: int | None = None):
    free = hbm - sizing.weight_bytes(_7B)
    fp16 = free // kv_bytes(tokens=context)
    int8 = free // kv_bytes(tokens=context, dtype="int8") if int8 is None else int8
    return (f"7B at {context} on an 80 GB A100: {fp16} requests fit with FP16 KV, {int8} with INT8",
            truth(int8 >= 2 * fp16 - 1), "tokens that fit = free bytes / bytes per token; INT8 halves the latter")


def c_70b_needs_tp(lab, weights: int | None = None, hbm: float = 80 * GiB, utilization: float = 0.9):
    weights = sizing.weight_bytes("llama-2-70b") if weights is None else weights
    budget = utilization * hbm
    return (f"Llama-2-70B FP16 weights {weights / GiB:.0f} GiB; --gpu-memory-utilization {utilization} of one "
            f"80 GB card is {budget / GiB:.0f} GiB (of an H200, {utilization * H200_HBM / GiB:.0f} GiB)",
            margin(budget, weights),
            "the command has no --tensor-parallel-size: the weights alone do not fit one card; it needs TP >= 2")


def c_pool_bytes_fixed(lab, budget: int = 16 * GiB, block_tokens: int = 16, sized_by: str = "bytes"):
    """vLLM sizes the pool by bytes; ``sized_by="tokens"`` plants a pool of fixed tokens (INT8 halves it)."""
    per_block = {d: block_tokens * sizing.kv_bytes_per_token(_7B, d) for d in ("fp16", "int8")}
    fp16 = budget // per_block["fp16"]
    int8 = budget // per_block["int8"] if sized_by == "bytes" else fp16
    bytes_fp16, bytes_int8 = fp16 * per_block["fp16"], int8 * per_block["int8"]
    return (f"a {fmt_bytes(budget)} pool: {fp16:,} FP16 blocks or {int8:,} INT8 blocks, {fmt_bytes(bytes_fp16)} vs "
            f"{fmt_bytes(bytes_int8)}", truth(bytes_int8 <= 0.55 * bytes_fp16),
            "the article's next clause (「空闲显存可能被其他模块吃掉」: the freed memory may be eaten by other "
            "modules) means the pool's reserved bytes; vLLM sizes the pool by gpu_memory_utilization, so an INT8 "
            "cache doubles the blocks and the bytes stay the same")


def c_sliding_window_cap(lab, window: int = 4096, context: int = 32768):
    capped = kv_bytes(model="mistral-7b", tokens=min(context, window), dtype="int8")
    full = kv_bytes(model="mistral-7b", tokens=context, dtype="int8")
    return (f"Mistral-7B v0.1 (window {window}), INT8: {fmt_bytes(capped)} per sequence at {context:,} tokens "
            f"with the window, {fmt_bytes(full)} without", truth(capped < full),
            "only for models trained with a window (Mistral); on others a window changes the model. The cap is "
            "real only if the cache frees the blocks that fall out of the window: kvlab's paged cache does with "
            "eviction=SlidingWindow (notebook 07), not by default")


# ---- formats and scales ------------------------------------------------------------------------------

def c_layer_16kb(lab, hidden: int = 4096, per_layer: float | None = None):
    if per_layer is None:
        per_layer = sizing.kv_bytes_per_token(_7B, "fp16") / sizing.kv_config(_7B).num_layers
    return (f"7B: {fmt_bytes(per_layer)} per token per layer = 2 x {hidden} x 2 B", ratio(16 * KiB, per_layer),
            "true for multi-head attention (KV width = hidden size); under GQA the width is KV heads x head_dim: "
            "SmolLM2's 192, not its hidden 576")


def c_per_block_scales(lab, head_dim: int = 64, block: int = 16):
    data = block * head_dim  # int8 bytes of one block of one head
    saving = 1 - (data + 4) / (2 * data)  # + one fp32 scale per (block, head)
    return (f"one fp32 scale per block of {block} tokens and head (head_dim {head_dim}): saves {saving:.1%}",
            ratio(0.5, saving, tol=0.02), "4 bytes of scale per 1 KiB of INT8 data")


def c_finer_scales_cost(lab, model: str = "smollm2-135m", extra: float | None = None, finer: str = "per-token-head"):
    head = sizing.kv_size(model, "int8", tokens=4096, scales="per-head")
    tok = sizing.kv_size(model, "int8", tokens=4096, scales=finer)
    extra = tok.total_bytes / head.total_bytes - 1 if extra is None else extra
    # a finer implementation: scales the kernel must load (and the writer compute) per token, not once per head
    loads = (tok.scale_bytes - head.scale_bytes) / 4096
    return (f"SmolLM2, INT8 at 4K: {finer} scales add {extra:.1%} to the cache and {loads:,.0f} B of scales to "
            "load and compute per token (per-head: a fixed table)",
            parts(loads > 0, extra == 0, "that finer scales cost a finer implementation",
                  "that the implementation is their cost (「代价是」): they also cost memory and bandwidth"),
            "the sentence names one cost as the cost" + ("; the bytes add a second, the scales themselves" if extra else ""))


def c_k8v4_lower(lab, model: str = _7B, k8v4: float | None = None):
    int8, fp16 = kv_bytes(model=model, tokens=4096, dtype="int8"), kv_bytes(model=model, tokens=4096)
    if k8v4 is None:  # K as INT8, V as INT4: half of each cache
        k8v4 = int8 / 2 + kv_bytes(model=model, tokens=4096, dtype="int4") / 2
    return (f"K8V4 {k8v4 / fp16:.1%} of FP16, INT8 {int8 / fp16:.1%}",
            truth(k8v4 < int8), "INT4 values with fp32 scales per group of 32: 4 + 1 bits per value")


def c_unfused_temp_fp32(lab, temp_bytes: int = 4):
    moved = 1 + temp_bytes + temp_bytes  # read INT8, write the temporary, read it back
    return (f"computed: `.float()` makes a {temp_bytes}-byte temporary: {moved} B moved per value against FP16's 2",
            truth(moved > 2), "understated: the temporary erases the gain, and more so than the article says, "
            "since .float() is FP32 (4 bytes), not the FP16 copy it names")


def c_mla_smaller(lab, mla: int | None = None):
    mla = sizing.kv_bytes_per_token("deepseek-v3", "fp16") if mla is None else mla
    c = sizing.kv_config("deepseek-v3")
    per_head = (c.head_dim + c.rope_dim) + c.head_dim  # a key of 128 + 64 RoPE dims, a value of 128 (notebook 00)
    mha = c.num_layers * c.num_heads * per_head * 2
    gqa8 = c.num_layers * 8 * per_head * 2
    return (f"DeepSeek-V3: {fmt_bytes(mla)}/token with MLA, {fmt_bytes(mha)} as MHA, {fmt_bytes(gqa8)} with 8 GQA heads",
            truth(mla < gqa8 < mha), "one 512-wide latent + one 64-wide RoPE key per layer, shared by all heads and K/V")


# ---- settled by reasoning ------------------------------------------------------------------------------

def c_zero_fragmentation(lab, lengths=None, block: int = 16, refused: dict | None = None):
    lengths = list(range(1, 2049)) if lengths is None else list(lengths)
    waste = sum((-n) % block for n in lengths) / len(lengths)
    ext = refused or simulate.external_fragmentation(block_size=block)["refused_with_room"]
    return (f"requests refused although the free memory would have held them (400 ShareGPT-like requests "
            f"coming and going, 4,096 slots): paged {ext['paged']}, contiguous first-fit {ext['contiguous']}; "
            f"inside each sequence's last block {waste:.1f} slots stay empty on average (lengths 1-2048)",
            truth(ext["paged"] == 0 and waste == 0),
            "「零碎片」 says zero; paging ends external fragmentation (the sentence's second half, blocks of "
            "different requests interleave, is true), but each sequence's last block keeps empty slots, the "
            "internal fragmentation the same article's §4.3 describes (5-10 %)")


def c_deferred_quant(lab, resident: str = "fp16", claimed: float = 0.5):
    """The article's code (000 §3, its doc comment's design point 3) quantizes a block only when it is swapped
    out of HBM: the blocks in HBM are kept as ``resident`` (its FP16 input), their bytes against FP16's."""
    saving = 1 - kv_bytes(tokens=4096, dtype=resident) / kv_bytes(tokens=4096)
    return (f"7B, 4,096 tokens in HBM as {resident}: {saving:.1%} of the FP16 cache saved there (claimed {claimed:.0%})",
            truth(abs(saving / claimed - 1) <= 0.15),
            "from the article's own code: design point 3 (延迟量化：仅在Block换出HBM时执行量化) keeps every block in HBM "
            "as it came, FP16, so neither memory nor decode bandwidth is saved there; only swapped-out blocks shrink")


def c_speculative_ttft(lab, prompt: int = 1024, draft_params: float = 68e6, with_draft: float | None = None):
    target = 2 * _params() * prompt
    if with_draft is None:
        with_draft = target + 2 * draft_params * prompt  # the draft model must prefill the prompt too
    return (f"TTFT is the target's prefill ({target / 1e12:.1f} TFLOP for {prompt} tokens); with a draft model "
            f"{with_draft / 1e12:.2f} TFLOP", truth(with_draft < target),
            "speculation speeds the tokens after the first (inter-token latency); the first still needs the "
            "target's whole prefill, plus the draft's")


def c_test_model_consistent(lab, layers: int = 32, heads: int = 32, head_dim: int = 128, d: int = 4096):
    return (f"{heads} heads x {head_dim} = {heads * head_dim} = the d of §2.1 ({d}); {layers} layers as Llama-2-7B",
            truth(heads * head_dim == d and layers == sizing.kv_config(_7B).num_layers),
            "the benchmark model is shaped like Llama-2-7B")


def c_latency_throughput(lab, batch: int = 32, ms=(22.0, 16.0), tok_s=(1450.0, 2020.0)):
    implied = [batch * 1e3 / m for m in ms]
    verdicts = [ratio(t, i) for t, i in zip(tok_s, implied)]
    return (f"batch {batch}: {ms[0]:g} ms/token -> {implied[0]:,.0f} tok/s (claimed {tok_s[0]:,.0f}), {ms[1]:g} ms -> "
            f"{implied[1]:,.0f} (claimed {tok_s[1]:,.0f})", next((v for v in verdicts if v != "holds"), "holds"),
            "per-request latency x batch = throughput: the two tables agree (22 -> 16 ms is +37.5 %, the throughputs "
            "+39 %: within rounding)")


def c_gate_1pct(lab, rise: float = 0.09 / 9.61, gate: float = 0.01):
    return (f"the article's own perplexity rise {rise:.2%} against its {gate:.0%} gate (000 §3.1's 0.5-1.5 % would "
            "fail it in its upper half)", truth(rise < gate), "the gate passes the article's own INT8, barely")


# ---- settled by datasheets and documented defaults ----------------------------------------------------

#: vLLM's KV-cache dtypes and default block size are read from the peer (:func:`kvlab.bench.vllm_peer.kv_cache_options`)
#: TensorRT-LLM's KV-cache quantization (its docs: ``kv_cache_quant_algo``): INT8 and FP8
TRTLLM_KV_CACHE_DTYPES = ("fp16", "bf16", "int8", "fp8")


def c_hbm_sram(lab, gpu: str = "A100", hbm: float | None = None):
    sms, clock, _, _ = GPU_CORES[gpu]
    sram = sms * SMEM_BYTES_PER_CLOCK * clock
    hbm = GPU_BANDWIDTH[gpu] if hbm is None else hbm
    return (f"{gpu}: HBM {hbm / 1e12:.2f} TB/s; shared memory {sms} SMs x {SMEM_BYTES_PER_CLOCK} B/clock x "
            f"{clock / 1e9:.2f} GHz = {sram / 1e12:.1f} TB/s ({sram / hbm:.1f}x)",
            worst([ratio(2e12, hbm), ratio(19e12, sram)]),
            "the datasheet's HBM (80 GB SXM) and the shared memory's bank width x clock; the article's pair is the "
            "FlashAttention paper's")


def c_block_16(lab, vllm: dict | None = None):
    o = _vllm(vllm)
    default = o["default_block_size"]
    return (f"vLLM {o['source']}: default --block-size {default}; kvlab's BlockManager default "
            f"{BlockManager.__init__.__defaults__[0]}", truth(default == 16),
            "'usually' read as the default; the size is a setting (vLLM: 1-128 tokens, kvlab: any)")


def _vllm(planted: dict | None) -> dict:
    """vLLM's KV-cache options, read from the installed peer (else its recorded pin); ``planted`` overrides."""
    return {**kv_cache_options(), **(planted or {})}


def _int8_choices(options: dict) -> list[str]:  # vLLM's --kv-cache-dtype choices that store INT8
    return [d for d in options["kv_cache_dtypes"] if d.startswith("int8")]


def c_kv_dtype_per_layer(lab, vllm: dict | None = None):
    o = _vllm(vllm)
    return (f"vLLM {o['source']}: --kv-cache-dtype is one value for the {o['dtype_scope']}; "
            + ("--kv-cache-dtype-skip-layers keeps the layers it lists (indices or attention types) unquantized"
               if o["skip_layers"] else "no option keeps a layer unquantized"),
            parts(o["dtype_scope"] == "layer", o["skip_layers"], "that it sets a precision per layer",
                  "that layers can differ (some kept unquantized)"),
            ("the quantized layers share one dtype; " if o["dtype_scope"] == "engine" else "")
            + ("a second option exempts layers " if o["skip_layers"] else "no option exempts a layer ")
            + "(kvlab's KVQuantConfig(layers=...) sets any format per layer, notebook 03)")


#: instructions per value to dequantize (after loading the integer): convert, then the scale (and zero point)
DEQUANT_OPS = {"symmetric": ("cvt", "mul"),  # q * s
               "asymmetric": ("cvt", "fma")}  # (q - z) * s = q * s + (-z * s), the bias computed once


def c_symmetric_one_multiply(lab, ops: dict | None = None):
    ops = DEQUANT_OPS if ops is None else ops
    return (", ".join(f"{k}: {' + '.join(v)}" for k, v in ops.items()) + " per value",
            parts(ops["symmetric"].count("mul") == 1, len(ops["asymmetric"]) > len(ops["symmetric"]),
                  "that symmetric dequantization is one multiply",
                  "that this sets it apart from asymmetric (also one fused multiply-add)"),
            "symmetric's real savings are elsewhere: no zero point stored, and integer dot products need no "
            "correction term")


def c_first_last_saving(lab, layers: int = 32, kept: int = 2, claimed: float = 0.5, middle: str = "int8"):
    per = {d: kv_bytes(tokens=4096, dtype=d) / 32 for d in ("fp16", middle)}  # one of Llama-2-7B's 32 layers
    saved = 1 - (kept * per["fp16"] + (layers - kept) * per[middle]) / (layers * per["fp16"])
    layer_half = abs(per[middle] / per["fp16"] - claimed) <= 0.01 * claimed
    return (f"{layers} layers, {kept} kept in FP16, the rest {middle} ({per[middle] / per['fp16']:.2%} of an FP16 "
            f"layer): {saved:.1%} of the KV bytes saved",
            parts(layer_half, abs(saved - claimed) <= 0.01 * claimed, "that the INT8 layers halve",
                  f"that the cache halves (the summary's {claimed:.0%}, within 1 % as int8-half)"),
            f"the kept layers cost their share: {kept} of {layers} layers at full size")


def c_kv_heads(lab, model: str = "smollm2-135m", tokens: int = 4096):
    c = sizing.kv_config(model)
    per = sizing.kv_bytes_per_token(model, "fp16")
    per_query_heads = per * c.num_heads // c.num_kv_heads
    twice = kv_bytes(tokens=2 * tokens, model=model) / kv_bytes(tokens=tokens, model=model)
    deeper = sizing.kv_token_bytes(2 * c.num_layers, c.num_kv_heads, c.head_dim, 2) / per
    return (f"{model}: twice the tokens {twice:g}x, twice the layers {deeper:g}x the bytes; {per:,} B per token from "
            f"{c.num_kv_heads} KV heads, counting its {c.num_heads} attention heads would give {per_query_heads:,} B",
            parts(twice == deeper == 2, c.num_heads == c.num_kv_heads,
                                                   "with sequence length and layers",
                                                   "with attention heads (under GQA it is the KV heads)"),
            "2 x layers x KV heads x head_dim x bytes per token; multi-head models have as many KV heads as "
            "attention heads, GQA and MQA fewer")


def c_no_cache_quadratic(lab, tokens: int = 4096, cached: bool = False):
    def total(n):  # FLOPs to produce n tokens one by one: step i re-runs i tokens without a cache, 1 with it
        return sum(2 * _params() * (1 if cached else i) for i in range(1, n + 1))
    growth = total(2 * tokens) / total(tokens)
    return (f"7B: {'with' if cached else 'without'} a cache, doubling the tokens from {tokens:,} multiplies the "
            f"work by {growth:.2f}", ratio(4.0, growth),
            "each step re-runs the whole context, so n steps cost ~n²/2 token passes (the attention's own n² per "
            "step adds a cubic term past ~26K tokens)")


def c_int8_in_frameworks(lab, vllm: dict | None = None, trtllm=None):
    o = _vllm(vllm)
    trtllm = TRTLLM_KV_CACHE_DTYPES if trtllm is None else trtllm
    int8 = _int8_choices(o)
    return (f"KV-cache dtypes: vLLM {o['source']}: {', '.join(int8) or 'no int8'} among "
            f"{len(o['kv_cache_dtypes'])} choices; TensorRT-LLM {', '.join(trtllm)}",
            parts("int8" in trtllm, bool(int8), "for TensorRT-LLM", "for vLLM"),
            "both quantize the KV cache to one byte in production; vLLM's FP8 takes calibrated scales (kvlab "
            "export-vllm, notebook 06)" + (f", its {int8[0]} computes a scale per token and head as it writes"
                                          if int8 else ""))


def c_fp8_flag(lab, flag: str = "fp8", vllm: dict | None = None):
    o = _vllm(vllm)
    int8 = _int8_choices(o)
    return (f"the article's command line (003 §4): --kv-cache-dtype {flag}; vLLM {o['source']} lists INT8 as "
            f"{', '.join(int8) or 'nothing'}", truth(flag in int8),
            "read from the article's code: its comment says INT8, its flag enables FP8 e4m3, the same byte per "
            "value, another format (a floating grid; without calibrated scales vLLM uses 1.0)")


def c_fp8_native(lab, gpus=("H100", "H200")):
    caps = {g: COMPUTE_CAPABILITY[g] for g in gpus}
    return (", ".join(f"{g} sm_{a}{b}" for g, (a, b) in caps.items()) + f"; FP8 needs sm_{''.join(map(str, FP8_MIN_CAPABILITY))}",
            truth(all(c >= FP8_MIN_CAPABILITY for c in caps.values())),
            "Hopper (and Ada) have FP8 tensor cores; the A100 (sm_80) and the T4 (sm_75) do not")


def c_ttft_quant(lab, prompt: int = 4096, extra_per_token: float | None = None):
    prefill = 2 * _params() * prompt / A100_FLOPS  # seconds at the A100's peak
    if extra_per_token is None:  # unfused: write the FP16 K/V, read it back, write INT8
        extra_per_token = sizing.kv_bytes_per_token(_7B, "fp16") * 2.5
    extra = prompt * extra_per_token / A100_BW
    return (f"7B, a {prompt:,}-token prompt on an A100: prefill >= {prefill * 1e3:.0f} ms of compute; quantizing its "
            f"KV even unfused moves {prompt * extra_per_token / 2**30:.1f} GiB more, {extra * 1e3:.1f} ms "
            f"({extra / prefill:.1%})", truth(extra / prefill > 0.05),
            "rule: 'slower' = at least 5 % of the prefill; prefill is compute-bound and quantizing is a few "
            "operations per value on the way to memory")


def c_int4_half_again(lab, group: int = 128, scale_dtype: str = "fp16"):
    int8 = kv_bytes(tokens=4096, dtype="int8")
    int4 = kv_bytes(tokens=4096, dtype="int4", scales=f"group-{group}", scale_dtype=scale_dtype)
    ours = kv_bytes(tokens=4096, dtype="int4", scales="group-32", scale_dtype="fp32")
    return (f"INT4 with one {scale_dtype} scale per {group} values saves {1 - int4 / int8:.1%} of INT8's bytes; "
            f"kvlab's own (fp32 per 32) {1 - ours / int8:.1%}", ratio(0.5, 1 - int4 / int8),
            "as int4-quarter, on the leanest common layout of each format; scales are part of the bytes")


def c_dequant_one_fma(lab, ops: dict | None = None):
    ops = kernel_kind("int8").cost["cast"] if ops is None else ops
    rate = PIPE_RATE["A100"]
    return (f"kvlab's INT8 kernel per value: " + ", ".join(f"{n} {p}" for p, n in ops.items())
            + f" (the scale folded after the dot product); the cvt pipe runs {rate['cvt']} results per clock per SM, "
            f"fp16 {rate['fp16']}", truth(not ops.get("cvt") and sum(ops.values()) <= 1),
            "the multiply can even leave the loop; what stays is the int8 -> fp16 conversion, on a pipe 16x slower "
            "than fp16 arithmetic (notebook 05, 4b: a candidate cause of the INT8 kernel's missing speed-up)")
