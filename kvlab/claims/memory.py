"""The claims about memory and bandwidth (notebooks 00, 03 §1 and 05): byte arithmetic, no model.

The INT8 speed-up is judged against the recorded H200 kernel run (notebook 05). Each ``c_...`` function
takes the :class:`~kvlab.claims.lab.Lab` (unused here) and returns ``(measured, verdict, why)``.
"""

from __future__ import annotations

from kvlab import sizing
from kvlab.bench.kernels import recorded_h200
from kvlab.claims.rules import HOLDS, Verdict, margin, ratio, shown, truth, worst
from kvlab.kernels.traffic import SHAPES, step_bytes
from kvlab.sizing import fmt_bytes

GiB, KiB = 2**30, 2**10
A100_BYTES, A100_BW = 80 * GiB, 2.039e12  # an A100 80GB: 80 GiB of HBM; bytes/s (the engine article says 2 TB/s)


def kv_bytes(tokens: int, dtype: str = "fp16", model: str = "llama-2-7b", **kw) -> int:
    """Bytes of a KV cache of ``tokens`` tokens, Llama-2-7B's unless ``model`` says (kvlab.sizing)."""
    return sizing.kv_size(model, dtype, tokens=tokens, **kw).total_bytes


def c_7b_table(lab, per: int | None = None):
    per = per or sizing.kv_bytes_per_token("llama-2-7b", "fp16")
    sizes = [t * per / GiB for t in (2048, 8192, 32768, 131072)]
    verdicts = [ratio(512 * KiB, per)] + [ratio(c, m) for c, m in zip((1, 4, 16, 64), sizes)]
    return (f"{fmt_bytes(per)}/token; " + ", ".join(f"{s:g} GiB" for s in sizes), worst(verdicts),
            "2 (K,V) x 32 layers x 4,096 x 2 bytes; the table is that times the tokens")


def c_7b_weights(lab, w: int | None = None):
    w = w or sizing.weight_bytes("llama-2-7b")
    kv = kv_bytes(32768)
    v = truth(kv > w)  # both halves: outgrown at 32K, and 14 GB
    v = ratio(14e9, w) if v == HOLDS else v
    return f"weights {w / 1e9:.1f} GB, KV at 32K {kv / 1e9:.1f} GB", v, "6.74 B parameters x 2 bytes"


def c_7b_1mb(lab, per: int | None = None):
    per = per or sizing.kv_bytes_per_token("llama-2-7b", "fp16")
    return (f"{fmt_bytes(per)}/token, {fmt_bytes(4096 * per)} at 4,096", ratio(2**20, per),
            "the same model as article 004's 512 KiB: 000 double counts")


def c_a100_half(lab, request: int | None = None):
    request = request or kv_bytes(4096)
    share = 10 * request / A100_BYTES
    return (f"10 x {fmt_bytes(request)} = {share:.0%} of the A100's 80 GiB", ratio(0.5, share),
            "follows from the 2x per-token error")


def c_70b(lab, per: int | None = None):
    per = per or sizing.kv_bytes_per_token("llama-2-70b", "fp16")
    return (f"{fmt_bytes(per)}/token, {fmt_bytes(4096 * per)} at 4,096", ratio(1.6e6, per),
            f"GQA, 8 KV heads: {fmt_bytes(per)}; even as MHA (64 KV heads) it would be "
            f"{fmt_bytes(sizing.kv_token_bytes(80, 64, 128, 2))}: 1.6 MB fits neither")


def c_decode_1ms(lab, bandwidth: float = 2e12):
    kv = kv_bytes(4096)
    ms = kv / bandwidth * 1e3
    return f"{fmt_bytes(kv)} of KV -> {ms:.2f} ms at {bandwidth / 1e12:g} TB/s", ratio(1.0, ms), "bytes / bandwidth (the weights come on top)"


def c_int8_half(lab, scales: str = "per-head"):
    s = sizing.kv_size("llama-2-7b", "int8", tokens=4096, scales=scales)
    share = s.total_bytes / kv_bytes(4096)
    return (f"{share:.4%} of FP16 (scales {fmt_bytes(s.scale_bytes)})", ratio(0.5, share, tol=0.01),
            "per-head static scales are one fp32 per layer x KV head: ~nothing")


def c_int4_quarter(lab, group: int = 128, scale_dtype: str = "fp16"):
    """INT4 on the leanest common layout (an fp16 scale per 128 values: rules.READING, as int8-half's per-head
    scales) against the claimed 1/4; kvlab's own (an fp32 per 32) beside it. ``group`` etc. plant others."""
    judged = kv_bytes(4096, "int4", scales=f"group-{group}", scale_dtype=scale_dtype)
    ours = kv_bytes(4096, "int4", scales="group-32", scale_dtype="fp32")
    share = judged / kv_bytes(4096)
    return (f"INT4 with one {scale_dtype} scale per {group} values: {share:.1%} of FP16; kvlab's own (fp32 per 32, "
            f"the one notebook 03 measures) {ours / kv_bytes(4096):.1%}; the 4-bit data alone 25%",
            ratio(0.25, share), "judged as int8-half, on the leanest common layout (the article's own advice is to "
            "group, 003 §4); every layout adds its scales to the 25 % of the data: kvlab's finer fp32 scales cost "
            f"{100 * (ours - judged) / kv_bytes(4096):.1f} points more")


def c_24_to_16(lab, context: int = 4096):
    w = sizing.weight_bytes("llama-2-7b")
    fp16, int8 = w + kv_bytes(context), w + kv_bytes(context, "int8")
    return (f"weights + KV: FP16 {fmt_bytes(fp16)}, INT8 {fmt_bytes(int8)}; a 16 GB card has 16 GiB",
            margin(fp16, 16 * GiB),
            f"FP16 leaves {fmt_bytes(16 * GiB - fp16)} for activations and the runtime, INT8 "
            f"{fmt_bytes(16 * GiB - int8)}: whether that is enough depends on the runtime, so 24 GB is the safe "
            "choice and 16 GB becomes comfortable with INT8")


def c_fits(lab, hbm: int = A100_BYTES):
    kv, kv8 = 32 * kv_bytes(16384), 32 * kv_bytes(16384, "int8")
    return (f"KV for 32 x 16K: {kv / GiB:.0f} GiB FP16, {kv8 / GiB:.0f} GiB INT8", truth(kv8 < hbm),
            "the benchmark's setting cannot fit one 80 GB A100, in either format")


def c_22ms(lab, bandwidth: float = A100_BW):
    step = sizing.decode_step_bytes("llama-2-7b", context=16384, batch=32)
    floor_ms = step["total"] / bandwidth * 1e3
    return (f"reads {step['total'] / 1e9:.0f} GB per step: >= {floor_ms:.0f} ms at {bandwidth / 1e12:.3g} TB/s", ratio(22, floor_ms),
            "22 ms would need >13 TB/s; 32 x 1/22 ms = 1,450 tok/s is at least self-consistent")


def c_16ms(lab, bandwidth: float = A100_BW):
    step = sizing.decode_step_bytes("llama-2-7b", context=16384, batch=32, kv_cache_dtype="int8")
    floor_ms = step["total"] / bandwidth * 1e3
    return (f"INT8 reads {step['total'] / 1e9:.0f} GB per step: >= {floor_ms:.0f} ms at {bandwidth / 1e12:.3g} TB/s",
            ratio(16, floor_ms), "below the memory floor, like the FP16 figure")


def c_12_7ms(lab, bandwidth: float = A100_BW):
    kv16, kv8 = 32 * kv_bytes(16384), 32 * kv_bytes(16384, "int8")
    ms16, ms8 = kv16 / bandwidth * 1e3, kv8 / bandwidth * 1e3
    return (f"reading the KV takes >= {ms16:.0f} ms (FP16) and >= {ms8:.0f} ms (INT8) at {bandwidth / 1e12:.3g} TB/s",
            ratio(12, ms16), "the ratio (0.58) is plausible, the milliseconds are not")


def c_39pct(lab, context: int = 16384, batch: int = 32, hbm: int = A100_BYTES,
            attention_speedup: float | None = None):
    """The +39 % at 32 x 16K on an 80 GB A100, a setting that cannot fit (b32-16k-fits); where one fits the
    bytes bound it and only a run confirms it (``attention_speedup``, mixed in by Amdahl's law)."""
    claimed = 2020 / 1450
    need = sizing.weight_bytes("llama-2-7b") + batch * kv_bytes(context)
    fits = need <= hbm
    fit_batch = max(0, (hbm - sizing.weight_bytes("llama-2-7b")) // kv_bytes(context))  # the biggest FP16 batch that fits
    probe = batch if fits else max(1, fit_batch)
    fp16 = sizing.decode_step_bytes("llama-2-7b", context=context, batch=probe)
    int8 = sizing.decode_step_bytes("llama-2-7b", context=context, batch=probe, kv_cache_dtype="int8")
    bound = fp16["total"] / int8["total"]
    # the article's model is a 7B with 32 KV heads (Llama-2-7B): 4x the KV per token of notebook 05's Llama-3-8B
    setting = (f"{batch} x {context // 1024}K of the article's 7B (Llama-2-7B, 32 KV heads: 4x a Llama-3-8B's KV per "
               f"token) needs {need / GiB:.0f} GiB of weights + FP16 KV on a {hbm / GiB:.0f} GiB card")
    if not fits:
        h200 = next(r["speedup_vs_fp16"]["int8"] for r in recorded_h200()["measured"]
                    if r["shape"] == "llama-3-8b" and r["batch"] == 8 and r["context"] == 16384)
        return (f"{setting}; the biggest FP16 batch that fits is {fit_batch} x {context // 1024}K, where the bytes "
                f"would allow up to {bound:.2f}x", Verdict(truth(fits), "stated at a setting that cannot run"),
                f"claimed {claimed:.2f}x at 32 x 16K, a batch that cannot fit the card (b32-16k-fits), so the figure "
                f"cannot have been measured as stated; at a batch that fits the bytes allow it, and nothing the lab "
                f"ran confirms it (its own INT8 attention kernel: {h200:.2f}x FP16 on an H200 at 8 x 16K, Llama-3-8B shape)")
    share = fp16["kv"] / fp16["total"]  # the KV's share of an FP16 step's bytes
    step = 1 / ((1 - share) + share / attention_speedup) if attention_speedup else 0.0  # Amdahl
    return (f"{setting}: it fits; the bytes allow up to {bound:.2f}x" +
            (f", a kernel at {attention_speedup:.2f}x gives the step {step:.2f}x" if attention_speedup else ""),
            shown(claimed <= bound, step >= claimed, "the article's A100 and model"),
            f"claimed {claimed:.2f}x; a bound does not confirm a gain, a run must")


def c_unfused(lab, unfused: int | None = None):
    shape = dict(zip(("num_layers", "h_q", "h_kv", "d"), SHAPES["llama-3-8b"]))
    fp16 = step_bytes("fp16", 32, 16384, **shape)
    unfused = unfused or step_bytes("int8", 32, 16384, **shape, fused=False)
    fused = step_bytes("int8", 32, 16384, **shape)
    return (f"byte model (computed, Llama-3-8B shape, 32 x 16K): unfused INT8 moves {unfused / fp16:.0%} of "
            f"FP16's bytes, fused {fused / fp16:.0%}",
            truth(unfused >= fp16 > fused), "read INT8 + write an FP16 copy + read it again")
