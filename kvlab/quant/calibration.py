"""Calibration data: what ranges do K and V actually take, per layer and head? (notebook 03)

Static scales are a statistic of post-RoPE |K|, |V| over qmax; a percentile below 100 clips the rarest
outliers on purpose, for finer steps everywhere else. Saved as one safetensors file, JSON metadata.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvlab.files import FileError, read_bytes, write_atomic
from kvlab.quant.core import scale_from_absmax
from kvlab.validate import cdiv

PERCENTILES = (99.0, 99.9, 99.99)
STATS = ("absmax",) + tuple(f"p{p:g}" for p in PERCENTILES)
TENSORS = ("k", "v", "k_rot")  # k_rot: keys after the Hadamard rotation (see kvlab.quant.rotation)


def _quantile(x: torch.Tensor, q: torch.Tensor, dim=None) -> torch.Tensor:
    # torch.quantile refuses inputs over 2**24 elements; subsample evenly if needed (stats only)
    if dim is None:
        x = x.flatten()
        if x.numel() > 2**24:
            x = x[::cdiv(x.numel(), 2**24)]
    return torch.quantile(x.float(), q, dim=dim)


@dataclass
class Calibration:
    """``stats[tensor][granularity][stat]``: per-tensor (L,), per-head (L, H), per-channel (L, H, D)."""

    stats: dict
    meta: dict = field(default_factory=dict)

    @property
    def num_layers(self) -> int:
        return self.stats["k"]["per-head"]["absmax"].shape[0]

    def scales(self, tensor: str = "k", stat: str = "absmax", granularity: str = "per-head",
               qmax: float = 127.0) -> list[torch.Tensor]:
        """One static scale tensor per layer, shaped to broadcast over (T, H, D)."""
        if tensor not in TENSORS:
            raise ValueError(f"tensor must be one of {TENSORS}, got {tensor!r}")
        if granularity not in ("per-tensor", "per-head", "per-channel"):
            raise ValueError(f"granularity must be one of ('per-tensor', 'per-head', 'per-channel') (static scales), "
                             f"got {granularity!r}")
        if stat not in STATS:
            raise ValueError(f"stat must be one of {STATS}, got {stat!r}")
        table = self.stats[tensor][granularity][stat]
        out = []
        for layer in range(self.num_layers):
            t = table[layer]
            shape = {"per-tensor": (1, 1, 1), "per-head": (1, -1, 1), "per-channel": (1, *t.shape)}[granularity]
            out.append(scale_from_absmax(t.reshape(shape), qmax))
        return out

    def shrunk(self, factor: float) -> "Calibration":
        """Statistics over ``factor``: as if traffic drifted that far past calibration (notebook 03)."""
        if isinstance(factor, bool) or not isinstance(factor, (int, float)) or not 0 < factor < float("inf"):
            raise ValueError(f"factor must be a finite number > 0, got {factor!r}")
        stats = {t: {g: {s: v / factor for s, v in ss.items()} for g, ss in gs.items()} for t, gs in self.stats.items()}
        return Calibration(stats, dict(self.meta, note=f"statistics / {factor:g}"))

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(layers, KV heads, head_dim)`` of the model it was taken on."""
        return tuple(self.stats["k"]["per-channel"]["absmax"].shape)

    def check_model(self, num_layers: int, num_kv_heads: int, head_dim: int, source: str = "calibration") -> None:
        """Refuse scales taken on another model: they would not even broadcast."""
        if self.shape != (num_layers, num_kv_heads, head_dim):
            got = " x ".join(map(str, self.shape))
            raise ValueError(f"{source} was taken on a model with {got} (layers x KV heads x head_dim), this model has "
                             f"{num_layers} x {num_kv_heads} x {head_dim}: calibrate this model (kvlab calibrate "
                             f"--model ...)")

    def save(self, path: str | Path) -> Path:
        """Write one safetensors file atomically."""
        from safetensors.torch import save  # only saving and loading need safetensors

        flat = {f"{t}.{g}.{s}": v.contiguous() for t, gs in self.stats.items() for g, ss in gs.items()
                for s, v in ss.items()}
        return write_atomic(path, save(flat, metadata={"kvlab": json.dumps(self.meta)}), "calibration file")

    @classmethod
    def load(cls, path: str | Path) -> "Calibration":
        """Read a ``kvlab calibrate`` file; anything else is a one-line :class:`~kvlab.files.FileError`."""
        from safetensors import SafetensorError  # only saving and loading need safetensors
        from safetensors.torch import load  # only saving and loading need safetensors

        data = read_bytes(path, "calibration file")
        where = f"calibration file {str(path)!r}"
        try:
            tensors = load(data)
            header_len = int.from_bytes(data[:8], "little")
            header = json.loads(data[8:8 + header_len])
            meta = json.loads((header.get("__metadata__") or {}).get("kvlab", "{}"))
        except (SafetensorError, ValueError, TypeError) as e:
            raise FileError(f"{where} is not a safetensors file ({str(e).splitlines()[0]}); "
                            "write one with `kvlab calibrate --out FILE`") from None
        stats: dict = {}
        for key, tensor in tensors.items():
            parts = key.split(".", 2)
            if len(parts) != 3:
                raise FileError(f"{where} is not a kvlab calibration file (tensor {key!r})")
            t, g, s = parts
            stats.setdefault(t, {}).setdefault(g, {})[s] = tensor
        missing = [f"{t}.{g}.absmax" for t in TENSORS for g in ("per-tensor", "per-head", "per-channel")
                   if "absmax" not in stats.get(t, {}).get(g, {})]
        if missing:
            raise FileError(f"{where} is not a kvlab calibration file (missing {missing[0]}"
                            f"{f' and {len(missing) - 1} more' if len(missing) > 1 else ''})")
        cal = cls(stats, meta if isinstance(meta, dict) else {})
        if len(cal.shape) != 3:
            raise FileError(f"{where} is damaged: k.per-channel.absmax should be (layers, KV heads, head_dim), "
                            f"got shape {cal.shape}")
        L, H, D = cal.shape
        want = {"per-tensor": (L,), "per-head": (L, H), "per-channel": (L, H, D)}
        for t in TENSORS:
            for g, shape in want.items():
                for s, x in stats[t][g].items():
                    if tuple(x.shape) != shape or not x.is_floating_point() or not bool(torch.isfinite(x).all()) \
                            or bool((x < 0).any()):
                        raise FileError(f"{where} is damaged: {t}.{g}.{s} should be {len(shape)}-d non-negative "
                                        f"finite floats of shape {shape}, got {tuple(x.shape)} {x.dtype}")
        return cal


def summarize(samples: list[torch.Tensor], percentiles=PERCENTILES) -> dict:
    """Stats of |x| from per-layer samples, each (T, H, D)."""
    q = torch.tensor([p / 100 for p in percentiles])
    names = [f"p{p:g}" for p in percentiles]
    out = {"per-tensor": {}, "per-head": {}, "per-channel": {}}
    per_tensor, per_head, per_channel = [], [], []
    for x in samples:
        a = x.abs().float()  # (T, H, D)
        t, h, d = a.shape
        per_tensor.append(torch.cat([a.max().reshape(1), _quantile(a, q)]))  # (1 + P,)
        heads = a.permute(1, 0, 2).reshape(h, t * d)  # (H, T*D)
        per_head.append(torch.cat([heads.max(1).values[:, None], _quantile(heads, q, dim=1).T], dim=1))  # (H, 1+P)
        per_channel.append(torch.cat([a.max(0).values[..., None], _quantile(a, q, dim=0).permute(1, 2, 0)], -1))
    for gran, rows in (("per-tensor", per_tensor), ("per-head", per_head), ("per-channel", per_channel)):
        stacked = torch.stack(rows)  # (L, ..., 1 + P)
        out[gran]["absmax"] = stacked[..., 0].contiguous()
        for i, name in enumerate(names):
            out[gran][name] = stacked[..., i + 1].contiguous()
    return out
