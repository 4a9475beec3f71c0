"""The claims about INT8 quantization quality (notebook 03): the quantizer and SmolLM2's cache, from the
measurements the :class:`~kvlab.claims.lab.Lab` shares. Each ``c_...`` returns ``(measured, verdict, why)``.
"""

from __future__ import annotations

import math
import statistics

import torch

from kvlab.claims.rules import beyond_lab, cost_range, judged_on, parts, truth
from kvlab.quant import core


def c_zero_guard(lab, threshold: float = 1e-6):
    """The article's guard: an all-zero head round-trips to zeros (not 0/0 = NaN), and a head just below
    the threshold, at scale 1.0, loses no more than the threshold itself."""
    heads = torch.zeros(3, 4, 8)
    heads[1] = 1e-7 * torch.linspace(-1, 1, 32).view(4, 8)  # below the threshold: all rounds to 0
    heads[2] = torch.linspace(-2, 2, 32).view(4, 8)  # an ordinary head
    amax = heads.abs().amax(dim=(1, 2), keepdim=True)
    scale = torch.where(amax < threshold, torch.ones_like(amax), amax / 127)  # the article's rule as written
    back = torch.clamp(torch.round(heads / scale), -127, 127) * scale
    err = (back - heads).abs().amax(dim=(1, 2))
    unguarded = heads[0] / (amax[0] / 127)
    ok = bool(torch.isfinite(back).all()) and float(err[0]) == 0.0 and float(err[1]) <= 1e-6 \
        and float(err[2]) <= float(scale[2]) / 2
    return (f"all-zero head: scale {float(scale[0]):g}, error {float(err[0]):g} (unguarded: "
            f"{'NaN' if bool(torch.isnan(unguarded).any()) else 'finite'}); a head of abs-max 1e-7: error "
            f"{float(err[1]):.0e}; an ordinary head: error {float(err[2]):.3f} <= half a step", truth(ok),
            "the rule as written: finite everywhere, and a head it catches holds nothing worth keeping")


def _rounding_bias(x: torch.Tensor, scale: torch.Tensor, how: str) -> float:
    """Mean of (|dequantized| - |x|) in quantization steps: < 0 shrinks the cache towards zero."""
    y = x / scale
    q = {"half-even": torch.round(y), "half-away": torch.sign(y) * torch.floor(y.abs() + 0.5),
         "truncate": torch.trunc(y)}[how]
    q = torch.clamp(q, -127, 127)
    return float((q.abs() - y.abs()).mean())


def c_rounding(lab, keys: torch.Tensor | None = None, tie_bias: float = 0.01):
    """Both halves: never truncate (it moves values half a step towards zero on average), and half-to-even
    over half-away, which differ only on exact ties: that matters only past ``tie_bias`` steps of bias."""
    k = lab.kv[0][5] if keys is None else keys
    scale = core.scale_from_absmax(core.absmax(k, "per-head"))
    bias = {h: _rounding_bias(k, scale, h) for h in ("half-even", "half-away", "truncate")}
    y = k / scale
    ties = float(((y - torch.floor(y)) == 0.5).float().mean())
    no_truncation = abs(bias["truncate"]) > 0.1 and abs(bias["half-even"]) < 0.1 * abs(bias["truncate"])
    even_matters = abs(bias["half-away"]) - abs(bias["half-even"]) > tie_bias
    return (f"mean |q| - |x| in steps: truncation {bias['truncate']:+.3f}, half-to-even {bias['half-even']:+.4f}, "
            f"half-away {bias['half-away']:+.4f}; exact ties {ties:.2%} of values (layer 5 keys, SmolLM2)",
            parts(no_truncation, even_matters, "'never truncate' (truncation biases, rounding does not)",
                  f"'half to even' (it would need ties to bias half-away by > {tie_bias} steps)"),
            "half-to-even and half-away differ only on exact ties, which continuous keys almost never hit, so the "
            "rule the article insists on is immaterial here; on tie-heavy data half-away would bias upwards")


def c_three_bits(lab, keys=None):
    """Bits the bulk of a long-tailed head keeps at one abs-max scale: log2(254 x median / max), on
    SmolLM2's most long-tailed key head."""
    keys = lab.kv[0] if keys is None else keys
    heads = []
    for layer, k in enumerate(keys):
        for h in range(k.shape[1]):
            a = k[:, h].abs().flatten().float()
            heads.append((math.log2(254 * float(a.median()) / float(a.max())), layer, h))
    bits, layer, h = min(heads)
    below = sum(b < 3 for b, _, _ in heads)
    return (f"bulk bits log2(254 x median / max): most long-tailed key head (layer {layer}, head {h}) "
            f"{bits:.1f} bits; {below} of {len(heads)} key heads below 3", judged_on(truth(bits < 3),
            "SmolLM2's key heads", "the article's model"),
            "the values up to the median magnitude, half of the head, share that many bits; the rest of the 8 "
            "go to the tail up to the abs-max")


def _snr(tensors, gran) -> float:
    return statistics.mean(core.error_metrics(x, core.dequantize_int8(*core.int8_roundtrip(x, gran)))["snr_db"]
                           for x in tensors)


def c_granularity(lab):
    keys, values = lab.kv
    snr = {w: {g: _snr(t, g) for g in ("per-tensor", "per-head", "per-channel")} for w, t in (("K", keys), ("V", values))}
    ok = all(s["per-head"] > s["per-channel"] > s["per-tensor"] for s in snr.values())
    return ("SNR dB K/V: " + ", ".join(f"{g} {snr['K'][g]:.1f}/{snr['V'][g]:.1f}" for g in snr["K"]),
            judged_on(truth(ok), "SmolLM2's K and V", "every model"),
            "the granularities are nested: a per-channel scale is never coarser than its head's, so with the data's "
            "own abs-max the table's precision order cannot hold; keys' outlier channels make the gap large. The "
            "heading's \"best value\" (性价比最优解) also weighs cost, where per-head wins: one scale per head, not "
            "one per channel")


def c_p999(lab):
    c = lab.quality["configs"]
    return (f"KL p99.9 {c['int8 p99.9']['kl']:.4f} vs abs-max {c['int8']['kl']:.4f}",
            judged_on(truth(c["int8 p99.9"]["kl"] < c["int8"]["kl"]), claimed_for="the article's own model"),
            "the article reports its own measurement (我实测, 'I measured'), on a model and data it does not name; on "
            "SmolLM2, clipping the outliers hurts, because they are a channel the model uses on every token")


def c_ppl_004(lab):
    q = lab.quality
    d = q["configs"]["int8"]["delta_ppl_pct"]
    return (f"ppl {q['ppl_fp']:.2f} -> {q['configs']['int8']['ppl']:.2f} ({d:+.2f} %) on {q['scored']} tokens",
            judged_on(truth(d <= 100 * (9.70 / 9.61 - 1)), claimed_for="the article's 7B"),
            "an upper bound (their +0.09 is +0.94 %), and ours is below it; per-head abs-max INT8, calibrated")


def c_ppl_000(lab):
    c = lab.quality["configs"]["int8"]
    d, (lo, hi) = c["delta_ppl_pct"], c["delta_ppl_ci95"]
    return (f"{d:+.2f} % [{lo:+.2f}, {hi:+.2f}] on {lab.quality['scored']} SmolLM2 tokens (KL {c['kl']:.4f})",
            judged_on(cost_range(0.5, 1.5, d, (lo, hi)), claimed_for="a 7B model"),
            "claimed for a 7B model; on SmolLM2 the cost is below the range. Perplexity on a few hundred tokens "
            "is a blunt tool; the damage shows in the KL")


def _served(answers: dict) -> str:  # notebook 06 passes its own run, which names no workload
    return answers.get("workload", "notebook 06's workload served in its budget")


def c_negligible(lab):
    c, a = lab.quality["configs"]["int8"], lab.answers
    return (f"top-1 agreement {c['top1']:.1%}, KL {c['kl']:.4f}; greedy answers: {a['identical']} of {a['requests']} "
            f"identical to FP16's, {a['prefix_share']:.0%} of each generated before the first difference ({_served(a)})",
            judged_on(truth(c["top1"] >= 0.99), "SmolLM2's next tokens", "task accuracy"),
            "per token the next token rarely changes (top-1 >= 99 % is the rule applied); whole answers part more "
            "often, which says they differ, not that they are worse. No task's accuracy is measured here")


def c_k_over_v(lab):
    c = lab.quality["configs"]
    return (f"KL K4V8 {c['k4v8']['kl']:.3f} vs K8V4 {c['k8v4']['kl']:.3f}",
            judged_on(truth(c["k4v8"]["kl"] > c["k8v4"]["kl"]), "SmolLM2", "every model"),
            "a key error is multiplied by q and goes through the softmax")


def c_first_last(lab):
    sens = lab.sensitivity
    n = len(sens)
    ranked = sorted(range(n), key=lambda i: -sens[i])  # most sensitive first
    rank = {i: ranked.index(i) + 1 for i in (0, n - 1)}
    says = {i: "among the most sensitive" if r <= n // 3 else "not" for i, r in rank.items()}
    return (f"layers 0 and {n - 1} rank {rank[0]} and {rank[n - 1]} of {n} (most sensitive: {ranked[:3]})",
            judged_on(truth(all(r <= n // 3 for r in rank.values())), "SmolLM2", "every model"),
            f"rule: both in the most sensitive third. Layer 0: {says[0]}; layer {n - 1}: {says[n - 1]}. "
            "Measure per model before keeping layers in FP16")


def c_saturation(lab):
    """Scales from 16 calibration tokens: "garbage" reads as top-1 agreement below 50 %, "widening fixes
    it" as the 1.2x correction bringing KL within 2x of the calibrated scales'."""
    s, good = lab.saturation["configs"], lab.quality["configs"]["int8"]
    bad, fixed = s["static"], s["corrected"]
    garbage = bad["top1"] < 0.5
    fixes = fixed["kl"] < 2 * good["kl"]
    verdict = parts(garbage, fixes, "'garbage' (top-1 below 50 %)", "'widening fixes it' (KL within 2x of calibrated)")
    return (f"scales from 16 tokens: K clip {bad['k_clip_rate']:.2%}, KL {bad['kl']:.4f}, top-1 {bad['top1']:.1%} "
            f"(1,024-token calibration: KL {good['kl']:.4f}, top-1 {good['top1']:.1%}); with the 1.2x rule KL "
            f"{fixed['kl']:.4f}, top-1 {fixed['top1']:.1%}, on {lab.quality['scored']} tokens",
            judged_on(verdict, "SmolLM2 at 384 tokens", "long contexts on a 7B"),
            "saturated in the counters, not garbage: most next tokens stay the same. Long contexts, where the "
            "article expects the worst, are not what a 384-token text tests")


def c_window_documents(lab):
    r = lab.passkey
    full, window, n = r["full"]["correct"], r["window"]["correct"], r["full"]["n"]
    return (f"a pass key early in a {r['full']['prompt_tokens']}-token document: found {full}/{n} with the full cache, "
            f"{window}/{n} with a 256-token sliding window (notebook 07)",
            beyond_lab(window >= full - 1, "SmolLM2 with a window imposed", "models trained with a window"),
            "a window imposed on a model trained without one forgets what fell out of it, the early facts a "
            "document task asks for; the article names no model, and one trained with a window (Mistral-7B "
            "v0.1, say) may carry information across its layers beyond one window, which the lab cannot run")


def c_per_channel_code(lab, reduce_dim: int = -1):
    """003 §4's example quantizer as written: abs-max over ``dim=-1`` of a [seq_len, num_heads, head_dim] tensor."""
    x = torch.ones(8, 3, 16)  # K/V in the example's layout: the scale's shape depends on the axes, not the values
    shape = tuple(x.abs().amax(dim=reduce_dim, keepdim=True).shape)
    named = next((g for g in core.GRANULARITIES if tuple(core.absmax(x, g).shape) == shape), "none of kvlab's")
    return (f"the example's scale over dim={reduce_dim} of [seq_len, num_heads, head_dim] has shape (T, H, D) -> "
            f"{'(T, H, 1)' if shape == (8, 3, 1) else shape}: {named}",
            truth(named == "per-channel"),
            "read from the article's code (003 §4, quantize_kv_int8, max(dim=-1)): the max runs over a head's "
            "channels, one scale per token and head; a per-channel scale takes it over the tokens, one per channel "
            "(notebook 03). Readers who copy it get per-token-head scales under a per-channel name")


def c_head_stable(lab, keys=None):
    """One statistic on both sides, every token's abs-max in a head: its median, from head to head of a layer
    (largest / smallest), against its spread inside a head, from token to token (p90 / p10)."""
    keys = lab.kv[0] if keys is None else keys
    across, within = [], []
    for k in keys:  # (T, H, D) per layer
        tok = k.abs().amax(dim=2)  # (T, H): every token's abs-max, per head
        q = torch.quantile(tok, torch.tensor([0.1, 0.5, 0.9]), dim=0)  # (3, H)
        across.append((q[1].max() / q[1].min()).item())
        within.append(statistics.median((q[2] / q[0]).tolist()))
    a, w = statistics.median(across), statistics.median(within)
    return (f"keys, median over {len(keys)} layers: a layer's heads differ {a:.2f}x in their typical token abs-max "
            f"(median); inside a head its tokens spread {w:.2f}x (p90 / p10)",
            judged_on(truth(a > w), "SmolLM2's keys", "every model"),
            "rule: heads must differ more than a head's own tokens do; " + (
                "they do, so one scale per head fits each head's range" if a > w else
                "here a head varies more from token to token than from head to head, and per-head scales win on "
                "cost (one per head), not on a head's stability"))


def c_seed_fp16(lab, answers: dict | None = None):
    a = lab.answers if answers is None else answers
    return (f"greedy decoding, where a seed plays no part: INT8's answers equal FP16's in {a['identical']} of "
            f"{a['requests']} ({_served(a)})", truth(a["identical"] == a["requests"]),
            "a seed fixes the random draws, not the logits INT8 changes" + (
                "; on this workload INT8 happened to change no greedy answer" if a["identical"] == a["requests"] else
                ": even greedy answers part") + ". The article's other remedy, sensitive requests on an FP16 cache, "
            "does reproduce FP16")

