"""What a KV format is, declared once (notebooks 00, 03, 05): every other part reads these registries.

:data:`ELEMENT_FORMATS` says how one tensor (K or V of a layer) is stored; :data:`KV_CACHE_DTYPES` names
the (K, V) pairs ``kv_cache_dtype=`` takes (``k8v4``: K INT8, V INT4). Adding a format is one
:func:`register` call, a quantizer only if its ``kind`` is new, and a test.

| kind       | codes                                                         | formats          |
|------------|---------------------------------------------------------------|------------------|
| ``float``  | stored as they are                                            | fp32, fp16, bf16 |
| ``int``    | ``round_half_even(x / scale)`` clamped to ``[-qmax, qmax]``   | int8             |
| ``fp8``    | ``x / scale`` clamped to ``[-qmax, qmax]``, cast to e4m3      | fp8              |
| ``packed`` | ``qmax``-level integers in groups of one token-head, two a byte | int4           |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KINDS = ("float", "int", "fp8", "packed")
#: one scale per tensor / KV head / channel of a layer, fixed after calibration
STATIC_GRANULARITIES = ("per-tensor", "per-head", "per-channel")
#: one scale per token (all heads) / per token and head, computed as each token is written
TOKEN_GRANULARITIES = ("per-token", "per-token-head")
GRANULARITIES = STATIC_GRANULARITIES + TOKEN_GRANULARITIES


@dataclass(frozen=True)
class ElementFormat:
    """How one of K or V is stored. ``clip_slack``: how far past ``qmax`` a value may land and still
    round to it (half a step: 0.5 for integers, 16 for e4m3 near 448); packed formats hold ``8 // bits``
    codes per byte."""

    name: str
    bits: int
    storage: torch.dtype
    kind: str
    qmax: float | None = None
    clip_slack: float = 0.0
    granularities: tuple[str, ...] = ()
    default_granularity: str = "none"
    kernel: bool = False
    #: the least CUDA compute capability the Triton kernels need for it (kvlab.kernels.available)
    gpu_capability: tuple[int, int] = (7, 5)
    description: str = ""

    def __post_init__(self):
        if not isinstance(self.name, str) or not self.name:
            raise ValueError(f"name must be a non-empty string, got {self.name!r}")
        if self.kind not in KINDS:
            raise ValueError(f"kind must be one of {KINDS}, got {self.kind!r}")
        if self.kind != "float" and not (isinstance(self.qmax, (int, float)) and self.qmax > 0):
            raise ValueError(f"a quantized format needs qmax > 0, got {self.qmax!r}")
        bad = [g for g in self.granularities if g not in GRANULARITIES]
        if bad:
            raise ValueError(f"granularities must be among {GRANULARITIES}, got {bad}")

    @property
    def quantized(self) -> bool:
        return self.kind != "float"

    @property
    def codes_per_storage_element(self) -> int:
        """Codes in one element of the page tensor: 2 for int4 in uint8, else 1."""
        return 8 * self.storage.itemsize // self.bits if self.kind == "packed" else 1

    @property
    def clip_limit(self) -> float:
        """|x / scale| beyond which a value is clipped, not rounded: qmax plus half a step."""
        return float(self.qmax) + self.clip_slack


#: element formats by name
ELEMENT_FORMATS: dict[str, ElementFormat] = {}
#: kv_cache_dtype name -> (K element format, V element format)
KV_CACHE_DTYPES: dict[str, tuple[str, str]] = {}


def register(fmt: ElementFormat, kv_cache_dtype: bool = True) -> ElementFormat:
    """Add an element format, and a kv_cache_dtype of the same name unless ``kv_cache_dtype=False``; a name
    already taken is an error."""
    if not isinstance(fmt, ElementFormat):
        raise TypeError(f"fmt must be an ElementFormat, got {type(fmt).__name__}")
    if fmt.name in ELEMENT_FORMATS or fmt.name in KV_CACHE_DTYPES:
        raise ValueError(f"format {fmt.name!r} is already registered")
    ELEMENT_FORMATS[fmt.name] = fmt
    if kv_cache_dtype:
        KV_CACHE_DTYPES[fmt.name] = (fmt.name, fmt.name)
    return fmt


def register_pair(name: str, k: str, v: str) -> None:
    """A kv_cache_dtype that stores K and V in different element formats (``k8v4``)."""
    for which, f in (("k", k), ("v", v)):
        element_format(f, which)
    if name in KV_CACHE_DTYPES or name in ELEMENT_FORMATS:
        raise ValueError(f"format {name!r} is already registered")
    KV_CACHE_DTYPES[name] = (k, v)


def unregister(name: str) -> None:
    """Take a format out again (tests that register a toy format clean up with this)."""
    ELEMENT_FORMATS.pop(name, None)
    for n in [n for n, (k, v) in KV_CACHE_DTYPES.items() if name in (n, k, v)]:
        del KV_CACHE_DTYPES[n]


def element_format(name: str, argument: str = "dtype") -> ElementFormat:
    """The element format called ``name``, or a ValueError naming ``argument`` and the choices."""
    if not isinstance(name, str) or name not in ELEMENT_FORMATS:
        raise ValueError(f"{argument} must be one of {tuple(ELEMENT_FORMATS)}, got {name!r}")
    return ELEMENT_FORMATS[name]


def kv_cache_dtype(name: str, argument: str = "kv_cache_dtype") -> tuple[ElementFormat, ElementFormat]:
    """The (K, V) element formats of a kv_cache_dtype name, or a ValueError listing the names."""
    if not isinstance(name, str) or name not in KV_CACHE_DTYPES:
        raise ValueError(f"{argument} must be one of {tuple(KV_CACHE_DTYPES)}, got {name!r}")
    k, v = KV_CACHE_DTYPES[name]
    return ELEMENT_FORMATS[k], ELEMENT_FORMATS[v]


def engine_kv_cache_dtypes() -> tuple[str, ...]:
    """What the engine's ``kv_cache_dtype=`` takes: "auto" (the model's own dtype) or a registered name."""
    return ("auto", *KV_CACHE_DTYPES)


def kernel_names() -> tuple[str, ...]:
    """kv_cache_dtypes whose K and V the Triton kernels read and write."""
    return tuple(n for n, (k, v) in KV_CACHE_DTYPES.items() if ELEMENT_FORMATS[k].kernel and ELEMENT_FORMATS[v].kernel)


register(ElementFormat("fp32", 32, torch.float32, "float", kernel=True, description="IEEE single precision"))
register(ElementFormat("fp16", 16, torch.float16, "float", kernel=True, description="IEEE half precision"))
register(ElementFormat("bf16", 16, torch.bfloat16, "float", kernel=True, gpu_capability=(8, 0),  # no bf16 before Ampere
                       description="bfloat16"), kv_cache_dtype=False)
register(ElementFormat("int8", 8, torch.int8, "int", qmax=127.0, clip_slack=0.5, granularities=GRANULARITIES,
                       default_granularity="per-head", kernel=True,
                       description="symmetric INT8 codes, round half to even, scales beside the pages"))
register(ElementFormat("fp8", 8, torch.float8_e4m3fn, "fp8", qmax=448.0, clip_slack=16.0, granularities=GRANULARITIES,
                       default_granularity="per-tensor",
                       description="float8 e4m3 (largest finite 448; the step there is 32), scaled"))
register(ElementFormat("int4", 4, torch.uint8, "packed", qmax=7.0, clip_slack=0.5, default_granularity="group-32",
                       kernel=True, description="INT4 codes, two a byte, scales per group of one token-head"))
register_pair("k8v4", "int8", "int4")

__all__ = ["ElementFormat", "ELEMENT_FORMATS", "KV_CACHE_DTYPES", "KINDS", "GRANULARITIES", "STATIC_GRANULARITIES",
           "TOKEN_GRANULARITIES", "register", "register_pair", "unregister", "element_format", "kv_cache_dtype",
           "engine_kv_cache_dtypes", "kernel_names"]
