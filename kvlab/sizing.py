"""How many bytes a KV cache takes: pure arithmetic on model configs, no tensors (notebook 00).

``bytes/token = 2 (K and V) x layers x kv_heads x head_dim x bytes/element``; GQA shrinks ``kv_heads``,
MLA stores one compressed latent per layer, quantized formats add scale (and zero-point) bytes. The
caches of later notebooks are checked against these numbers byte for byte.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Any, Mapping

from kvlab.formats import ELEMENT_FORMATS, STATIC_GRANULARITIES, TOKEN_GRANULARITIES
from kvlab.validate import is_int

# Element bits, float or not, and default granularities come from the format registry (kvlab.formats).
# How many scales a granularity keeps: "static" ones are one table for the whole cache; "per-token"
# ones (and "group-<g>") grow with every stored token.
SCALE_DTYPE_BYTES = {"fp32": 4, "fp16": 2, "bf16": 2}
MAX_COUNT = 2**53  # tokens, batch: larger counts are not exact as floats (and GiB would overflow one)

# Small config dicts (HF field names) so that nothing needs a download. Values from the models'
# published config.json files; num_params is the total parameter count.
PRESETS: dict[str, dict[str, Any]] = {
    "llama-2-7b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=32,
                       head_dim=128, max_position_embeddings=4096, num_params=6.74e9),
    "llama-2-70b": dict(num_hidden_layers=80, hidden_size=8192, num_attention_heads=64, num_key_value_heads=8,
                        head_dim=128, max_position_embeddings=4096, num_params=68.98e9),
    "llama-3-8b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=8192, num_params=8.03e9),
    "mistral-7b": dict(num_hidden_layers=32, hidden_size=4096, num_attention_heads=32, num_key_value_heads=8,
                       head_dim=128, max_position_embeddings=32768, num_params=7.24e9),
    "qwen2.5-7b": dict(num_hidden_layers=28, hidden_size=3584, num_attention_heads=28, num_key_value_heads=4,
                       head_dim=128, max_position_embeddings=32768, num_params=7.62e9),
    "smollm2-135m": dict(num_hidden_layers=30, hidden_size=576, num_attention_heads=9, num_key_value_heads=3,
                         head_dim=64, max_position_embeddings=8192, num_params=134.5e6),
    # MLA: the cache holds a 512-wide latent plus a 64-wide shared RoPE key per layer and token.
    "deepseek-v3": dict(num_hidden_layers=61, hidden_size=7168, num_attention_heads=128, num_key_value_heads=128,
                        head_dim=128, kv_lora_rank=512, qk_rope_head_dim=64, max_position_embeddings=163840,
                        num_params=671e9, active_params=37e9),  # MoE: 37B of the 671B are used per token
}


@dataclass(frozen=True)
class KVConfig:
    """The few numbers of a model config that decide its KV-cache size."""

    name: str
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int | None = None
    num_params: float | None = None
    kv_lora_rank: int | None = None  # MLA only
    rope_dim: int | None = None  # MLA only
    active_params: float | None = None  # mixture of experts: parameters one token uses

    @property
    def attention(self) -> str:
        if self.kv_lora_rank:
            return "MLA"
        if self.num_kv_heads == self.num_heads:
            return "MHA"
        return "MQA" if self.num_kv_heads == 1 else f"GQA ({self.num_heads // self.num_kv_heads} q/kv)"

    @property
    def tensors_per_layer(self) -> int:
        """2 (K and V), or 1 for MLA's single latent."""
        return 1 if self.kv_lora_rank else 2

    @property
    def scale_heads(self) -> int:
        """Heads that get their own scale: KV heads, or 1 for MLA's latent."""
        return 1 if self.kv_lora_rank else self.num_kv_heads

    @property
    def width(self) -> int:
        """Elements per token, per layer, per stored tensor and head."""
        return (self.kv_lora_rank + (self.rope_dim or 0)) if self.kv_lora_rank else self.head_dim


def mla_token_bytes(num_layers: int, kv_lora_rank: int, rope_dim: int, bytes_per_element: float) -> int:
    """Bytes one token adds to an MLA cache: per layer one latent that every head's K and V are re-created
    from, plus one RoPE key shared by all heads; no factor 2."""
    return int(num_layers * (kv_lora_rank + rope_dim) * bytes_per_element)


def _get(cfg: Any, key: str, default=None):
    if isinstance(cfg, Mapping):
        return cfg.get(key, default)
    return getattr(cfg, key, default)


def kv_config(model: Any) -> KVConfig:
    """A :class:`KVConfig` from a preset name, an HF config (object or dict) or a model with ``.config``."""
    if isinstance(model, KVConfig):
        return model
    name = "custom"
    if isinstance(model, str):
        key = model.strip().lower()
        if key not in PRESETS:
            raise ValueError(f"unknown model preset {model!r}: choose one of {sorted(PRESETS)}")
        name, cfg = key, PRESETS[key]
    elif hasattr(model, "config") and not isinstance(model, Mapping):
        cfg = model.config
        name = getattr(cfg, "name_or_path", None) or getattr(cfg, "model_type", "custom")
    else:
        cfg = model
        name = _get(cfg, "name_or_path", None) or _get(cfg, "model_type", "custom")
    layers = _get(cfg, "num_hidden_layers")
    heads = _get(cfg, "num_attention_heads")
    if not layers or not heads:
        raise ValueError("model config needs num_hidden_layers and num_attention_heads")
    kv_heads = _get(cfg, "num_key_value_heads") or heads
    hidden = _get(cfg, "hidden_size")
    head_dim = _get(cfg, "head_dim") or (hidden // heads if is_int(hidden) and is_int(heads) else None)
    for key, value in (("num_hidden_layers", layers), ("num_attention_heads", heads),
                       ("num_key_value_heads", kv_heads), ("head_dim", head_dim)):
        if not is_int(value) or value < 1:
            why = " (nor a hidden_size to derive it from)" if key == "head_dim" and value is None else ""
            raise ValueError(f"model config: {key} must be a positive integer, got {value!r}{why}")
    return KVConfig(name=str(name), num_layers=int(layers), num_heads=int(heads), num_kv_heads=int(kv_heads),
                    head_dim=int(head_dim), max_position=_get(cfg, "max_position_embeddings"),
                    num_params=_get(cfg, "num_params"), kv_lora_rank=_get(cfg, "kv_lora_rank"),
                    rope_dim=_get(cfg, "qk_rope_head_dim"), active_params=_get(cfg, "active_params"))


def dtypes() -> list[str]:
    """The element formats sizing knows (every registered one), sorted by name."""
    return sorted(ELEMENT_FORMATS)


def _check_dtype(dtype: str) -> str:
    if not isinstance(dtype, str) or dtype not in ELEMENT_FORMATS:
        raise ValueError(f"dtype must be one of {dtypes()}, got {dtype!r}")
    return dtype


def _bits(dtype: str) -> int:
    return ELEMENT_FORMATS[_check_dtype(dtype)].bits


def _scale_counts(cfg: KVConfig, scales: str) -> tuple[int, int]:
    """(scales per token, scales in fixed tables) for a granularity, over the whole model."""
    per_layer_tensor = cfg.num_layers * cfg.tensors_per_layer
    if scales == "none":
        return 0, 0
    if scales == "per-tensor":
        return 0, per_layer_tensor
    if scales == "per-head":
        return 0, per_layer_tensor * cfg.scale_heads
    if scales == "per-channel":
        return 0, per_layer_tensor * cfg.scale_heads * cfg.width
    if scales == "per-token":
        return per_layer_tensor, 0
    if scales == "per-token-head":
        return per_layer_tensor * cfg.scale_heads, 0
    if isinstance(scales, str) and scales.startswith("group-"):
        try:
            g = int(scales.split("-", 1)[1])
        except ValueError:
            g = 0
        if g <= 0 or cfg.width % g:
            raise ValueError(f"scales {scales!r}: group size must be a positive divisor of head_dim={cfg.width}")
        return per_layer_tensor * cfg.scale_heads * (cfg.width // g), 0
    raise ValueError(
        f"scales must be one of none, {', '.join(STATIC_GRANULARITIES + TOKEN_GRANULARITIES)} or group-<g>, got {scales!r}"
    )


def kv_token_bytes(num_layers: int, num_kv_heads: int, head_dim: int, bytes_per_element: float,
                   tensors: int = 2) -> float:
    """The formula itself: ``tensors`` (K and V) x layers x kv_heads x head_dim x bytes per element."""
    return tensors * num_layers * num_kv_heads * head_dim * bytes_per_element


def kv_bytes_per_token(model: Any, dtype: str = "fp16") -> int:
    """Data bytes one token adds to the cache (no scales): 2 x layers x kv_heads x head_dim x bytes."""
    cfg = kv_config(model)
    nbytes = _bits(dtype) / 8
    return math.ceil(kv_token_bytes(cfg.num_layers, cfg.scale_heads, cfg.width, nbytes, cfg.tensors_per_layer))


@dataclass(frozen=True)
class KVSize:
    model: str
    dtype: str
    scales: str
    tokens: int
    batch: int
    bytes_per_token: int  # data + per-token scales/zero-points for one token
    data_bytes: int
    scale_bytes: int  # all scales and zero points, per-token and fixed tables
    fixed_bytes: int  # scale tables that do not grow with tokens (per-tensor/head/channel)
    total_bytes: int

    def as_dict(self) -> dict:
        d = asdict(self)
        d["total_gib"] = self.total_bytes / 2**30
        d["bytes_per_token_kib"] = self.bytes_per_token / 2**10
        return d


def kv_size(model: Any, dtype: str = "fp16", tokens: int = 1, batch: int = 1, scales: str | None = None,
            scale_dtype: str = "fp32", zero_points: bool = False) -> KVSize:
    """Exact bytes of a KV cache of ``tokens`` tokens x ``batch`` sequences; ``scales`` (the granularity)
    defaults to none for floats, per-head for int8, per-tensor for fp8, group-32 for int4, and
    ``zero_points`` adds one per scale (asymmetric)."""
    cfg = kv_config(model)
    _check_dtype(dtype)
    if not is_int(tokens) or not 0 <= tokens <= MAX_COUNT:
        raise ValueError(f"tokens must be an integer from 0 to 2**53, got {tokens!r}")
    if not is_int(batch) or not 1 <= batch <= MAX_COUNT:
        raise ValueError(f"batch must be an integer from 1 to 2**53, got {batch!r}")
    if not isinstance(scale_dtype, str) or scale_dtype not in SCALE_DTYPE_BYTES:
        raise ValueError(f"scale_dtype must be one of {sorted(SCALE_DTYPE_BYTES)}, got {scale_dtype!r}")
    if not isinstance(zero_points, bool):
        raise ValueError(f"zero_points must be True or False, got {zero_points!r}")
    scales = ELEMENT_FORMATS[dtype].default_granularity if scales is None else scales
    if not ELEMENT_FORMATS[dtype].quantized and scales != "none":
        raise ValueError(f"{dtype} is stored as is: scales must be 'none', got {scales!r}")
    per_token_scales, fixed_scales = _scale_counts(cfg, scales)
    per_scale = SCALE_DTYPE_BYTES[scale_dtype] * (2 if zero_points else 1)
    data = math.ceil(kv_bytes_per_token(cfg, dtype) * tokens) * batch
    scale_bytes = per_token_scales * per_scale * tokens * batch + fixed_scales * per_scale
    return KVSize(model=cfg.name, dtype=dtype, scales=scales, tokens=tokens, batch=batch,
                  bytes_per_token=kv_bytes_per_token(cfg, dtype) + per_token_scales * per_scale,
                  data_bytes=data, scale_bytes=scale_bytes, fixed_bytes=fixed_scales * per_scale,
                  total_bytes=data + scale_bytes)


def weight_bytes(model: Any, dtype: str = "fp16") -> int:
    """Bytes of the weights, which every decode step also reads once (needs num_params)."""
    cfg = kv_config(model)
    if not cfg.num_params:
        raise ValueError(f"model {cfg.name!r} has no num_params; pass a preset or a dict with num_params")
    return _param_bytes(cfg.num_params, dtype)


def _param_bytes(num_params: float, dtype: str) -> int:
    return math.ceil(num_params * _bits(dtype) / 8)


def decode_step_bytes(model: Any, context: int, batch: int = 1, kv_cache_dtype: str = "fp16",
                      weight_dtype: str = "fp16") -> dict:
    """Bytes one decode step reads: the weights once for the batch, and every sequence's whole KV cache."""
    if not is_int(context) or context < 0:
        raise ValueError(f"context must be an integer >= 0 (cached tokens), got {context!r}")
    w = weight_read_bytes(model, batch, weight_dtype)
    kv = kv_size(model, kv_cache_dtype, tokens=context, batch=batch).total_bytes
    return {"weights": w, "kv": kv, "total": w + kv}


def weight_read_bytes(model: Any, batch: int = 1, dtype: str = "fp16") -> int:
    """Weight bytes one decode step reads: all of them once, or for a mixture of experts ``active x batch``
    capped at all, an upper bound (tokens that pick the same experts share those reads)."""
    cfg = kv_config(model)
    total = weight_bytes(model, dtype)
    if not cfg.active_params:
        return total
    return min(total, batch * _param_bytes(cfg.active_params, dtype))


def crossover_context(model: Any, batch: int = 1, kv_cache_dtype: str = "fp16", weight_dtype: str = "fp16") -> int:
    """Context length at which the KV cache read per step outweighs the weights."""
    per_token = kv_size(model, kv_cache_dtype, tokens=1, batch=batch).total_bytes
    return math.ceil(weight_read_bytes(model, batch, weight_dtype) / per_token)


def fmt_bytes(n: float) -> str:
    """Binary units, as GPU memory is sold, to two decimals without trailing zeros: 512 KiB, 74.51 GiB."""
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if abs(n) >= size:
            return f"{n / size:.2f}".rstrip("0").rstrip(".") + f" {unit}"
    return f"{int(n)} B"
