"""Reference quantizers for K/V ``(T, H, D)``: INT8 at five granularities, INT4 groups, FP8 (notebook 03).

| granularity      | scale shape | one scale per                        |
|------------------|-------------|--------------------------------------|
| per-tensor       | (1, 1, 1)   | the whole tensor                     |
| per-head         | (1, H, 1)   | KV head (the articles' "TurboQuant")    |
| per-channel      | (1, H, D)   | channel of a head                    |
| per-token        | (T, 1, 1)   | token                                |
| per-token-head   | (T, H, 1)   | token and head                       |

INT8 ``scale = absmax / 127``, 1.0 where absmax < 1e-6 so an all-zero head never divides by zero.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from kvlab.formats import GRANULARITIES, ElementFormat, element_format
from kvlab.validate import is_int

FP8_MAX = element_format("fp8").qmax  # largest finite float8_e4m3fn: 448
ZERO_GUARD = 1e-6


def _check_tensor(x, name: str) -> None:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a tensor, got {type(x).__name__}")


def check_finite(x: torch.Tensor, name: str = "tensor") -> None:
    """K/V must be finite: a NaN or Inf would silently poison a whole scale group."""
    _check_tensor(x, name)
    if not torch.isfinite(x).all():
        bad = (~torch.isfinite(x)).sum().item()
        raise ValueError(f"{name} contains {bad} NaN/Inf value(s); refusing to quantize them into the cache")


def _reduce_dims(granularity: str) -> tuple[int, ...]:
    dims = {"per-tensor": (0, 1, 2), "per-head": (0, 2), "per-channel": (0,), "per-token": (1, 2),
            "per-token-head": (2,)}
    if granularity not in dims:
        raise ValueError(f"granularity must be one of {GRANULARITIES}, got {granularity!r}")
    return dims[granularity]


def absmax(x: torch.Tensor, granularity: str) -> torch.Tensor:
    """Max |x| over the axes that share a scale, keeping dims so it broadcasts against ``x`` (T, H, D)."""
    _check_tensor(x, "x")
    if x.dim() != 3:
        raise ValueError(f"x must be a (T, H, D) tensor, got shape {tuple(x.shape)}")
    return x.abs().amax(dim=_reduce_dims(granularity), keepdim=True)


def scale_from_absmax(amax: torch.Tensor, qmax: float = 127.0) -> torch.Tensor:
    """``absmax / qmax``, with the zero guard: 1.0 where absmax < 1e-6."""
    if isinstance(qmax, bool) or not isinstance(qmax, (int, float)) or not 0 < qmax < math.inf:
        raise ValueError(f"qmax must be a finite number > 0 (127 for INT8, 448 for FP8), got {qmax!r}")
    amax = amax.float()
    # divide by a full tensor, not a Python scalar: CUDA torch turns "tensor / scalar" into a multiply by the
    # rounded reciprocal, which is not the correctly rounded quotient the CPU (and the Triton kernel) compute
    return torch.where(amax < ZERO_GUARD, torch.ones_like(amax), amax / torch.full_like(amax, qmax))


def quantize_scaled(x: torch.Tensor, scale: torch.Tensor, fmt: ElementFormat) -> torch.Tensor:
    """Codes of ``x`` under ``scale``: ``int`` rounds half to even then clamps, ``fp8`` clamps then casts."""
    _check_tensor(x, "x")
    _check_tensor(scale, "scale")
    if fmt.kind == "int":
        return torch.clamp(torch.round(x.float() / scale), -fmt.qmax, fmt.qmax).to(fmt.storage)
    if fmt.kind == "fp8":
        return torch.clamp(x.float() / scale, -fmt.qmax, fmt.qmax).to(fmt.storage)
    raise ValueError(f"{fmt.name} ({fmt.kind}) is not a scaled format: kinds 'int' and 'fp8' are")


def dequantize_scaled(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Values back from the codes of a scaled format: ``q * scale``."""
    return (q.float() * scale).to(dtype)


def quantize_int8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Round half to even (``torch.round``), then clamp to +-127. Never truncate: truncation biases
    every value towards zero (and Triton's ``.to(int8)`` truncates and wraps, see notebook 05)."""
    return quantize_scaled(x, scale, element_format("int8"))


def dequantize_int8(q: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    return dequantize_scaled(q, scale, dtype)


def int8_roundtrip(x: torch.Tensor, granularity: str = "per-head") -> tuple[torch.Tensor, torch.Tensor]:
    """Dynamic (absmax) INT8 quantization at a granularity: returns (q, scale)."""
    check_finite(x, "x")
    scale = scale_from_absmax(absmax(x, granularity))
    return quantize_int8(x, scale), scale


def quantize_per_head(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Notebook 03, Task 1: one abs-max scale per KV head, ``(1, H, 1)``, putting the head's largest
    magnitude on 127 (scale 1.0 below 1e-6); codes round half to even: returns (q int8 (T, H, D), scale)."""
    scale = scale_from_absmax(x.abs().amax(dim=(0, 2), keepdim=True))  # (1, H, 1): over tokens and channels
    return torch.clamp(torch.round(x / scale), -127, 127).to(torch.int8), scale


# ---- INT4: groups of g channels, two values per byte --------------------------------------------

def pack_int4(q: torch.Tensor) -> torch.Tensor:
    """Values 0..15 (uint8), last dim even -> bytes holding two values (low nibble first)."""
    if q.shape[-1] % 2:
        raise ValueError(f"the last dimension must be even to pack two 4-bit values per byte, got {q.shape[-1]}")
    q = q.to(torch.uint8)
    return q[..., 0::2] | (q[..., 1::2] << 4)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    lo, hi = packed & 0x0F, packed >> 4
    return torch.stack([lo, hi], dim=-1).flatten(-2)


def _groups(x: torch.Tensor, group_size: int) -> torch.Tensor:
    d = x.shape[-1]
    if not is_int(group_size) or group_size < 1 or d % group_size:
        raise ValueError(f"group_size must be a positive divisor of head_dim={d}, got {group_size}")
    return x.reshape(*x.shape[:-1], d // group_size, group_size)  # (..., G, g)


@dataclass
class Int4Tensor:
    """Packed INT4 data with its separate scales (and zero points when asymmetric)."""

    packed: torch.Tensor  # (T, H, D/2) uint8
    scale: torch.Tensor  # (T, H, D/g, 1)
    zero: torch.Tensor | None  # (T, H, D/g, 1) or None (symmetric)
    group_size: int

    @property
    def nbytes(self) -> int:
        return self.packed.nbytes + self.scale.nbytes + (self.zero.nbytes if self.zero is not None else 0)


def quantize_int4(x: torch.Tensor, group_size: int = 32, symmetric: bool = True, pack=pack_int4) -> Int4Tensor:
    """Per token, head and group of channels; ``pack`` is notebook 03's task. Asymmetric groups (a zero
    point) help skewed V but cost one more number per group."""
    check_finite(x, "x")
    if not isinstance(symmetric, bool):
        raise TypeError(f"symmetric must be True or False, got {symmetric!r}")
    g = _groups(x.float(), group_size)  # (T, H, G, g)
    if symmetric:
        scale = scale_from_absmax(g.abs().amax(-1, keepdim=True), 7.0)
        q = torch.clamp(torch.round(g / scale), -7, 7) + 8
        zero = None
    else:
        lo, hi = g.amin(-1, keepdim=True), g.amax(-1, keepdim=True)
        scale = scale_from_absmax(hi - lo, 15.0)
        zero = torch.clamp(torch.round(-lo / scale), 0, 15)
        q = torch.clamp(torch.round(g / scale) + zero, 0, 15)
    codes = q.flatten(-2).to(torch.uint8)  # (T, H, D)
    packed = pack(codes)
    if not isinstance(packed, torch.Tensor) or packed.dtype != torch.uint8 or packed.shape != (*codes.shape[:-1], codes.shape[-1] // 2):
        found = f"{packed.dtype} {tuple(packed.shape)}" if isinstance(packed, torch.Tensor) else type(packed).__name__
        raise ValueError(f"pack returned {found}, expected torch.uint8 of shape {(*codes.shape[:-1], codes.shape[-1] // 2)}")
    return Int4Tensor(packed, scale, zero, group_size)


def dequantize_int4(t: Int4Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    q = _groups(unpack_int4(t.packed).float(), t.group_size)
    x = (q - 8) * t.scale if t.zero is None else (q - t.zero) * t.scale
    return x.flatten(-2).to(dtype)


# ---- FP8 e4m3: the production baseline ----------------------------------------------------------

def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """Scaled cast to float8_e4m3fn (torch rounds to nearest even); values beyond +-448 saturate."""
    return quantize_scaled(x, scale, element_format("fp8"))


def channel_spread(x: torch.Tensor) -> float:
    """How far one scale per head stretches for outliers: max over median channel abs-max (1.0: none)."""
    per_channel = x.float().abs().amax(dim=0)  # (H, D)
    return float((per_channel.amax(-1) / per_channel.median(-1).values.clamp(min=1e-12)).mean())


# ---- error metrics ------------------------------------------------------------------------------

def error_metrics(x: torch.Tensor, x_hat: torch.Tensor) -> dict:
    """How far a reconstruction is from the original: MSE, max error, SNR (dB), cosine similarity."""
    x, x_hat = x.double().flatten(), x_hat.double().flatten()
    err = x - x_hat
    mse = err.pow(2).mean().item()
    signal = x.pow(2).mean().item()
    cos = torch.nn.functional.cosine_similarity(x, x_hat, dim=0).item()
    return {"mse": mse, "max_abs": err.abs().max().item(),
            "snr_db": 10 * math.log10(signal / mse) if mse > 0 else float("inf"), "cosine": cos}
