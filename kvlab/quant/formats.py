"""How K and V are stored, layer by layer: formats, scale policies, mixed precision (notebook 03).

A :class:`TensorFormat` describes one of K or V in one layer (dtype, scale granularity, INT4 group
size and symmetry). A :class:`KVQuantConfig` gives every layer its K and V formats (mixed
precision: per-layer overrides, K8V4), the scale policy and the Hadamard option.

Scale policies:

* ``static``: calibrated scales (per-tensor / per-head / per-channel), fixed forever;
* ``dynamic``: scales computed on write — per token for per-token granularities (always exact),
  and from the *first write* for the static granularities (what engines that estimate scales from
  the first batch do: fine until later traffic is larger);
* ``corrected``: static, but when a value exceeds 1.2x the static range its scale is widened
  and only the data under that scale is re-quantized (seed 004's 1.2× correction).
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace

from kvlab.quant.calibration import STATS

FLOAT_FORMATS = ("fp32", "fp16", "bf16")
STORAGE_DTYPES = FLOAT_FORMATS + ("int8", "int4", "fp8")
STATIC_GRANULARITIES = ("per-tensor", "per-head", "per-channel")
TOKEN_GRANULARITIES = ("per-token", "per-token-head")
POLICIES = ("static", "dynamic", "corrected")
CORRECTION_FACTOR = 1.2


@dataclass(frozen=True)
class TensorFormat:
    dtype: str = "int8"
    granularity: str = "per-head"  # int8 / fp8; int4 always uses per-token-head groups
    group_size: int = 32  # int4 only
    symmetric: bool = True  # int4 only

    def __post_init__(self):
        if self.dtype not in STORAGE_DTYPES:
            raise ValueError(f"dtype must be one of {STORAGE_DTYPES}, got {self.dtype!r}")
        if self.dtype in ("int8", "fp8") and self.granularity not in STATIC_GRANULARITIES + TOKEN_GRANULARITIES:
            raise ValueError(f"granularity must be one of {STATIC_GRANULARITIES + TOKEN_GRANULARITIES}, "
                             f"got {self.granularity!r}")
        if isinstance(self.group_size, bool) or not isinstance(self.group_size, int) or self.group_size < 1:
            raise ValueError(f"group_size must be an integer >= 1, got {self.group_size!r}")
        if not isinstance(self.symmetric, bool):
            raise ValueError(f"symmetric must be True or False, got {self.symmetric!r}")

    @property
    def quantized(self) -> bool:
        return self.dtype not in FLOAT_FORMATS

    @property
    def static_scales(self) -> bool:
        return self.dtype in ("int8", "fp8") and self.granularity in STATIC_GRANULARITIES

    @property
    def sizing_scales(self) -> str:
        """The matching ``kvlab.sizing`` granularity name."""
        if not self.quantized:
            return "none"
        if self.dtype == "int4":
            return f"group-{self.group_size}"
        return self.granularity

    def label(self) -> str:
        if not self.quantized:
            return self.dtype
        if self.dtype == "int4":
            return f"int4 g{self.group_size}{'' if self.symmetric else ' asym'}"
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

    def with_layers(self, overrides: dict) -> "KVQuantConfig":
        return replace(self, layers={**self.layers, **overrides})

    def needs_calibration(self, num_layers: int) -> bool:
        return self.policy in ("static", "corrected") and any(
            f.static_scales for layer in range(num_layers) for f in self.formats(layer))

    def label(self) -> str:
        k, v = self.k.label(), self.v.label()
        base = k if k == v else f"K {k} / V {v}"
        if self.layers:
            from collections import Counter

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


def named_config(name: str, **kw) -> KVQuantConfig:
    """Short names for the formats the lab compares: fp16, int8, fp8, int4, k8v4 (K INT8 per-head, V INT4)."""
    table = {
        "fp32": (TensorFormat("fp32"), TensorFormat("fp32")),
        "fp16": (TensorFormat("fp16"), TensorFormat("fp16")),
        "int8": (TensorFormat("int8"), TensorFormat("int8")),
        "fp8": (TensorFormat("fp8", "per-tensor"), TensorFormat("fp8", "per-tensor")),
        "int4": (TensorFormat("int4"), TensorFormat("int4")),
        "k8v4": (TensorFormat("int8"), TensorFormat("int4")),
    }
    if not isinstance(name, str) or name not in table:
        raise ValueError(f"kv format must be one of {sorted(table)}, got {name!r}")
    k, v = table[name]
    gran = kw.pop("granularity", None)
    if gran is not None:
        k = replace(k, granularity=gran) if k.dtype in ("int8", "fp8") else k
        v = replace(v, granularity=gran) if v.dtype in ("int8", "fp8") else v
    return KVQuantConfig(k, v, **kw)
