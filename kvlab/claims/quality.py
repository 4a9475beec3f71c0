"""The claims about INT8 quantization quality (notebook 03): the quantizer and SmolLM2's cache.

The per-head quantizer's zero guard and rounding, granularities and effective bits on SmolLM2's
keys and values, and the quality claims (perplexity, KL, top-1, K vs V, sensitive layers,
saturated static scales) from the measurements the :class:`~kvlab.claims.lab.Lab` shares. Each
``c_...`` function returns ``(measured, verdict, why)``.
"""

from __future__ import annotations

import statistics

import torch

from kvlab.claims.rules import cost_range, elsewhere, truth
from kvlab.quant import core


def c_zero_guard(lab):
    q, scale = core.int8_roundtrip(torch.zeros(4, 2, 8), "per-head")
    ok = bool(torch.all(scale == 1.0)) and bool(torch.all(q == 0))
    return f"all-zero head: scale {scale.flatten().tolist()}, q all 0: {bool(torch.all(q == 0))}", truth(ok), "no 0/0"


def c_rounding(lab):
    k = lab.kv[0][5]
    q, scale = core.int8_roundtrip(k, "per-head")
    rounded = core.error_metrics(k, core.dequantize_int8(q, scale))
    trunc = torch.clamp(torch.trunc(k / scale), -127, 127) * scale
    t = core.error_metrics(k, trunc)
    return (f"SNR round-half-even {rounded['snr_db']:.1f} dB, truncation {t['snr_db']:.1f} dB (layer 5 keys)",
            truth(rounded["snr_db"] > t["snr_db"] + 3), "truncation moves every value towards zero")


def c_three_bits(lab):
    keys, _ = lab.kv
    worst = (float("inf"), 0, 0)
    for layer, k in enumerate(keys):
        for h in range(k.shape[1]):
            x = k[:, h:h + 1]
            snr = core.error_metrics(x, core.dequantize_int8(*core.int8_roundtrip(x, "per-head")))["snr_db"]
            worst = min(worst, (snr, layer, h))
    snr, layer, h = worst
    bits = (snr - 1.76) / 6.02  # effective bits from the SNR of a uniform quantizer
    return (f"worst key head (layer {layer}, head {h}): SNR {snr:.1f} dB = {bits:.1f} effective bits of 8",
            truth(bits < 3), f"effective bits = (SNR - 1.76 dB) / 6.02 dB: the worst head's tails cost it "
            f"{8 - bits:.1f} of its 8 bits")


def _snr(tensors, gran) -> float:
    return statistics.mean(core.error_metrics(x, core.dequantize_int8(*core.int8_roundtrip(x, gran)))["snr_db"]
                           for x in tensors)


def c_granularity(lab):
    keys, values = lab.kv
    snr = {w: {g: _snr(t, g) for g in ("per-tensor", "per-head", "per-channel")} for w, t in (("K", keys), ("V", values))}
    ok = all(s["per-head"] > s["per-channel"] > s["per-tensor"] for s in snr.values())
    return ("SNR dB K/V: " + ", ".join(f"{g} {snr['K'][g]:.1f}/{snr['V'][g]:.1f}" for g in snr["K"]), truth(ok),
            "keys have outlier channels: a per-channel scale fits them best")


def c_p999(lab):
    c = lab.quality["configs"]
    return (f"KL p99.9 {c['int8 p99.9']['kl']:.4f} vs abs-max {c['int8']['kl']:.4f}",
            truth(c["int8 p99.9"]["kl"] < c["int8"]["kl"]), "clipping outliers hurts when the outliers matter")


def c_ppl_004(lab):
    q = lab.quality
    d = q["configs"]["int8"]["delta_ppl_pct"]
    return (f"ppl {q['ppl_fp']:.2f} -> {q['configs']['int8']['ppl']:.2f} ({d:+.2f} %) on {q['scored']} tokens",
            elsewhere(truth(d <= 100 * (9.70 / 9.61 - 1)), claimed_for="the article's 7B"),
            "an upper bound (their +0.09 is +0.94 %), and ours is below it; per-head abs-max INT8, calibrated")


def c_ppl_000(lab):
    c = lab.quality["configs"]["int8"]
    d, (lo, hi) = c["delta_ppl_pct"], c["delta_ppl_ci95"]
    return (f"{d:+.2f} % [{lo:+.2f}, {hi:+.2f}] on {lab.quality['scored']} SmolLM2 tokens (KL {c['kl']:.4f})",
            elsewhere(cost_range(0.5, 1.5, d, (lo, hi)), claimed_for="a 7B model"),
            "claimed for a 7B model; on SmolLM2 the cost is below the range. Perplexity on a few hundred tokens "
            "is a blunt tool; the damage shows in the KL")


def c_negligible(lab):
    c = lab.quality["configs"]["int8"]
    return (f"top-1 agreement {c['top1']:.1%}, KL {c['kl']:.4f}", truth(c["top1"] >= 0.99),
            "the next token rarely changes")


def c_k_over_v(lab):
    c = lab.quality["configs"]
    return (f"KL K4V8 {c['k4v8']['kl']:.3f} vs K8V4 {c['k8v4']['kl']:.3f}", truth(c["k4v8"]["kl"] > c["k8v4"]["kl"]),
            "a key error is multiplied by q and goes through the softmax")


def c_first_last(lab):
    sens = lab.sensitivity
    n = len(sens)
    ranked = sorted(range(n), key=lambda i: -sens[i])  # most sensitive first
    rank = {i: ranked.index(i) + 1 for i in (0, n - 1)}
    says = {i: "among the most sensitive" if r <= n // 3 else "not" for i, r in rank.items()}
    return (f"layers 0 and {n - 1} rank {rank[0]} and {rank[n - 1]} of {n} (most sensitive: {ranked[:3]})",
            truth(all(r <= n // 3 for r in rank.values())),
            f"rule: both in the most sensitive third. Layer 0: {says[0]}; layer {n - 1}: {says[n - 1]}. "
            "Measure per model before keeping layers in FP16")


def c_saturation(lab):
    s, good = lab.saturation["configs"], lab.quality["configs"]["int8"]
    bad, fixed = s["static"], s["corrected"]
    ok = bad["kl"] > 10 * good["kl"] and fixed["kl"] < 2 * good["kl"]
    return (f"scales 4x too small: K clip {bad['k_clip_rate']:.1%}, KL {bad['kl']:.3f}, top-1 {bad['top1']:.0%} "
            f"(calibrated: KL {good['kl']:.4f}); with the 1.2x rule KL {fixed['kl']:.4f}", truth(ok),
            "quality falls off a cliff and the counters light up; the correction restores it")
