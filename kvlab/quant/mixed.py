"""Mixed precision: which layers can take fewer bits? Measure, then choose under a byte budget.

Sensitivity of a layer = mean next-token KL(FP || model) when only that layer's cache is stored in
the low-bit format. The automatic mode starts with every layer at the high format and moves the
least sensitive layers to the low one until the cache fits the byte budget (notebook 03).
"""

from __future__ import annotations

from dataclasses import replace

from kvlab.quant.formats import KVQuantConfig, TensorFormat

FP = TensorFormat("fp32")


def layer_sensitivity(model, tokens: list[int], calibration=None, fmt: TensorFormat = TensorFormat("int4"),
                      which: str = "kv", chunk: int = 32, policy: str = "static") -> list[float]:
    """KL per layer when only that layer's K (``which="k"``), V ("v") or both ("kv") use ``fmt``."""
    from kvlab.eval import evaluate
    from kvlab.sizing import kv_config

    if which not in ("k", "v", "kv"):
        raise ValueError(f"which must be 'k', 'v' or 'kv', got {which!r}")
    layers = kv_config(model).num_layers
    configs = {}
    for layer in range(layers):
        k = fmt if "k" in which else FP
        v = fmt if "v" in which else FP
        configs[layer] = KVQuantConfig(FP, FP, policy=policy, layers={layer: (k, v)})
    res = evaluate(model, tokens, configs, calibration, window=len(tokens), stride=len(tokens), chunk=chunk)
    return [res["configs"][layer]["kl"] for layer in range(layers)]


def auto_config(model, sensitivity: list[float], budget_bytes_per_token: float,
                high: KVQuantConfig, low: KVQuantConfig) -> KVQuantConfig:
    """Every layer ``high``; then the least sensitive layers become ``low`` until the budget holds.

    Raises ValueError if even all-``low`` does not fit.
    """
    from kvlab.eval import kv_bytes_per_token

    layers = len(sensitivity)
    chosen: dict[int, tuple] = {layer: high.formats(layer) for layer in range(layers)}
    cfg = replace(high, layers=dict(chosen))
    for layer in sorted(range(layers), key=lambda i: sensitivity[i]):
        if kv_bytes_per_token(model, cfg) <= budget_bytes_per_token:
            break
        chosen[layer] = low.formats(layer)
        cfg = replace(high, layers=dict(chosen))
    if kv_bytes_per_token(model, cfg) > budget_bytes_per_token:
        raise ValueError(f"budget {budget_bytes_per_token:.0f} B/token is below what the low format needs "
                         f"({kv_bytes_per_token(model, cfg):.0f} B/token)")
    return cfg
