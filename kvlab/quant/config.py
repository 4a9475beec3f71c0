"""How K and V are stored, layer by layer: formats, scale policies, mixed precision (notebook 03).

Scale policies: ``static`` (calibrated, fixed forever); ``dynamic`` (per-token scales on write, and
static granularities from the *first write*, as engines that estimate from the first batch do: fine
until traffic grows); ``corrected`` (static, widened when a value exceeds 1.2x the range, TurboQuant's rule).
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace

from kvlab.formats import (ELEMENT_FORMATS, STATIC_GRANULARITIES, TOKEN_GRANULARITIES, ElementFormat, element_format,
                           kv_cache_dtype)
from kvlab.quant.calibration import STATS
from kvlab.validate import check_int

POLICIES = ("static", "dynamic", "corrected")
CORRECTION_FACTOR = 1.2


@dataclass(frozen=True)
class TensorFormat:
    dtype: str = "int8"
    granularity: str = "per-head"  # int8 / fp8; int4 always uses per-token-head groups
    group_size: int = 32  # int4 only
    symmetric: bool = True  # int4 only

    def __post_init__(self):
        fmt = element_format(self.dtype)  # a ValueError naming dtype and the registered formats
        if fmt.granularities and self.granularity not in fmt.granularities:
            raise ValueError(f"granularity must be one of {fmt.granularities}, got {self.granularity!r}")
        check_int("group_size", self.group_size)
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"symmetric must be True or False, got {self.symmetric!r}")

    @property
    def element(self) -> ElementFormat:
        """The registry entry of this dtype (:mod:`kvlab.formats`): bits, page dtype, qmax, kind."""
        return ELEMENT_FORMATS[self.dtype]

    @property
    def quantized(self) -> bool:
        return self.element.quantized

    @property
    def scaled(self) -> bool:
        """Codes times a scale of some granularity (int8, fp8): not a float, not packed groups."""
        return self.element.kind in ("int", "fp8")

    @property
    def static_scales(self) -> bool:
        return self.scaled and self.granularity in STATIC_GRANULARITIES

    @property
    def sizing_scales(self) -> str:
        """The matching ``kvlab.sizing`` granularity name."""
        if not self.quantized:
            return "none"
        if self.element.kind == "packed":
            return f"group-{self.group_size}"
        return self.granularity

    def label(self) -> str:
        if not self.quantized:
            return self.dtype
        if self.element.kind == "packed":
            return f"{self.dtype} g{self.group_size}{'' if self.symmetric else ' asym'}"
        return f"{self.dtype} {self.granularity}"


@dataclass(frozen=True)
class KVQuantConfig:
    """Formats for every layer's K and V, the scale policy, calibration statistic and rotation."""

    k: TensorFormat = TensorFormat()
    v: TensorFormat = TensorFormat()
    policy: str = "static"
    stat: str = "absmax"  # calibration statistic for static scales: absmax, p99, p99.9, p99.99
    rotate_k: bool = False
    layers: dict = field(default_factory=dict)  # layer -> (k TensorFormat, v TensorFormat)

    def __post_init__(self):
        for name in ("k", "v"):
            if not isinstance(getattr(self, name), TensorFormat):
                raise TypeError(f"{name} must be a TensorFormat, got {getattr(self, name)!r}")
        if self.policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {self.policy!r}")
        if self.stat not in STATS:
            raise ValueError(f"stat must be one of {STATS}, got {self.stat!r}")
        if not isinstance(self.rotate_k, bool):
            raise ValueError(f"rotate_k must be True or False, got {self.rotate_k!r}")
        if not isinstance(self.layers, dict) or any(
                not (isinstance(f, tuple) and len(f) == 2 and all(isinstance(x, TensorFormat) for x in f))
                for f in self.layers.values()):
            raise TypeError(f"layers must map a layer to a (k, v) pair of TensorFormats, got {self.layers!r}")

    def formats(self, layer: int) -> tuple[TensorFormat, TensorFormat]:
        return self.layers.get(layer, (self.k, self.v))

    def needs_calibration(self, num_layers: int) -> bool:
        return self.policy in ("static", "corrected") and any(
            f.static_scales for layer in range(num_layers) for f in self.formats(layer))

    def label(self) -> str:
        k, v = self.k.label(), self.v.label()
        base = k if k == v else f"K {k} / V {v}"
        if self.layers:
            mix = Counter(kf.label() if kf == vf else f"K {kf.label()} / V {vf.label()}"
                          for kf, vf in self.layers.values())
            if sum(mix.values()) > 1:
                base = "mixed: " + " + ".join(f"{n}x {name}" for name, n in mix.most_common())
        extras = []
        if any(f.static_scales for f in (self.k, self.v)):
            extras.append(f"{self.policy} {self.stat}" if self.policy != "dynamic" else "dynamic")
        if self.rotate_k:
            extras.append("Hadamard K")
        if len(self.layers) == 1:
            layer, (kf, vf) = next(iter(self.layers.items()))
            extras.append(f"layer {layer}: {kf.label() if kf == vf else f'K {kf.label()} / V {vf.label()}'}")
        return base + (f" ({', '.join(extras)})" if extras else "")


FP32 = KVQuantConfig(TensorFormat("fp32"), TensorFormat("fp32"))


def _default_format(fmt: ElementFormat) -> TensorFormat:
    """A registry entry as a TensorFormat at its default granularity."""
    if fmt.granularities:
        return TensorFormat(fmt.name, fmt.default_granularity)
    return TensorFormat(fmt.name)


def named_config(name: str, **kw) -> KVQuantConfig:
    """The config of a ``kv_cache_dtype`` name at default granularities (``granularity=`` overrides them)."""
    k, v = (_default_format(f) for f in kv_cache_dtype(name, "kv format"))
    gran = kw.pop("granularity", None)
    if gran is not None:
        k = replace(k, granularity=gran) if k.scaled else k
        v = replace(v, granularity=gran) if v.scaled else v
    return KVQuantConfig(k, v, **kw)
