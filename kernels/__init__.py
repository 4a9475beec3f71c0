"""kvlab.kernels: the lab's Triton kernels (notebook 05).

This folder sits at the top of the repository and ships as ``kvlab.kernels`` (see pyproject's
``package-dir``), because a bare ``import kernels`` would shadow Hugging Face's ``kernels``
package, which transformers probes for.

| file          | what                                                                        |
|---------------|-----------------------------------------------------------------------------|
| `pool.py`     | a pool's K or V as the kernels see it (data, format, scales)                |
| `write.py`    | quantize-on-write: new K/V -> their slots, round half to even, counters     |
| `decode.py`   | paged decode attention: block-table walk, online softmax, GQA, fused dequant, split-KV |
| `ops.py`      | the kernels applied to kvlab's caches (the engine's ``attn_backend="triton"``) |
| `traffic.py`  | bytes per launch, predicted and counted; projections per GPU                |
| `bench.py`    | ``kvlab bench kernels``                                                     |

Every kernel runs compiled on a GPU and interpreted on the CPU (``TRITON_INTERPRET=1``).
"""

from __future__ import annotations

import os


def triton_mode() -> str:
    """``"interpreter"`` when kernels run on the CPU through Triton's interpreter, else ``"compiled"``.

    ``import kvlab`` sets ``TRITON_INTERPRET=1`` on machines without a GPU before triton loads.
    """
    return "interpreter" if os.environ.get("TRITON_INTERPRET", "0") == "1" else "compiled"


def triton_version() -> str | None:
    """Installed triton version, or None where triton is not installed (e.g. macOS)."""
    from importlib import metadata

    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None


# The kernels import triton; the byte model (``traffic``) and the operand descriptions do not, so a
# machine without triton (macOS) can still draw the bandwidth story. Kernel names load on first use.
_LAZY = {
    "paged_decode": "decode", "online_softmax_update": "decode",
    "write_kv": "write", "round_half_even": "write", "cast_demo": "write",
    "write_to_cache": "ops", "decode_from_cache": "ops",
    "Operand": "pool", "operands": "pool", "check_cache_supported": "pool", "KERNEL_FORMATS": "pool",
}


def __getattr__(name):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(f"kvlab.kernels.{_LAZY[name]}"), name)
    if name in ("traffic", "decode", "write", "ops", "pool", "bench"):
        return importlib.import_module(f"kvlab.kernels.{name}")
    raise AttributeError(f"module 'kvlab.kernels' has no attribute {name!r}")


__all__ = ["triton_mode", "triton_version", *_LAZY]
