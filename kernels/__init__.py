"""kvlab.kernels: the lab's Triton kernels (notebook 05), shipped as ``kvlab.kernels`` so that a bare
``import kernels`` does not shadow Hugging Face's ``kernels``. Files: ``pool`` (K/V as the kernels see them),
``write`` (quantize-on-write), ``decode`` (paged decode attention), ``skeleton`` (the build tasks' kernel),
``answers`` (kvlab's answers to them),
``convert`` (conversion variants), ``traffic`` (bytes per launch), ``ptx`` (sm_90 instructions, no GPU).
Every kernel runs compiled on a GPU and interpreted on a CPU. Triton installs on Linux only; elsewhere
:func:`available` is False and the rest of kvlab runs as usual."""

from __future__ import annotations

import functools
import os
from importlib import metadata

import torch

from kvlab.formats import ELEMENT_FORMATS

#: why the kernels cannot run on this machine; shown by skipped notebook cells, tests and errors
WHY_NO_TRITON = ("the Triton kernels need triton, which installs on Linux only (pip install triton==3.7.1); "
                 "on a Mac or Windows run them on a Linux machine or in a Linux container (e.g. Docker; "
                 "WSL 2 on Windows); everything else in kvlab runs without it")

#: a comment line at the top of a notebook cell that needs triton (the kernels, or a result of theirs)
CELL_MARKER = "# needs triton"
#: what such a cell prints instead of running, where triton is missing
SKIPPED_CELL = ("skipped: this cell needs triton, which installs on Linux only (run it on Linux or in a Linux "
                "container; README, 'On a Mac or Windows')")
#: a cell that counts bytes through Triton's interpreter (``traffic.count_traffic``); it also needs triton
INTERPRETER_MARKER = "# needs triton's interpreter"
#: what such a cell prints instead of running, where the kernels run compiled (a GPU)
SKIPPED_COMPILED = ("skipped: this cell counts bytes through Triton's interpreter, and here the kernels run "
                    "compiled; restart with TRITON_INTERPRET=1 set to count them (the byte model needs no kernel)")


@functools.cache
def _triton_imports() -> bool:
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


#: below this compute capability ``tl.dot`` falls back to FMA (Triton 3.2+, triton-lang/triton#5066): correct,
#: slower; Triton supports 8.0+ officially, Colab's free T4 (7.5) runs the kernels unofficially
TENSOR_CORES = (8, 0)


def gpu_capability() -> tuple[int, int] | None:
    """This machine's CUDA compute capability, or None without a GPU (the interpreter runs every format)."""
    return tuple(torch.cuda.get_device_capability()) if torch.cuda.is_available() else None


def _capability(capability) -> tuple[int, int] | None:
    """``capability`` as a tuple, else this machine's when the kernels compile (the interpreter runs all)."""
    if capability is not None:
        return tuple(capability)
    return gpu_capability() if triton_mode() == "compiled" else None


def why_not(fmt: str, capability: tuple[int, int] | None = None) -> str | None:
    """None when the kernels run ``fmt`` here (or on ``capability``), else one line saying why not."""
    if fmt not in ELEMENT_FORMATS:
        raise ValueError(f"fmt must be one of {tuple(ELEMENT_FORMATS)}, got {fmt!r}")
    if not _triton_imports():
        return WHY_NO_TRITON
    el = ELEMENT_FORMATS[fmt]
    if not el.kernel:
        return f"the Triton kernels do not read {fmt} pages; attn_backend='torch' runs them on any device"
    cap = _capability(capability)
    if cap is not None and cap < el.gpu_capability:
        need = "".join(map(str, el.gpu_capability))
        return (f"{fmt} pages need compute capability {el.gpu_capability[0]}.{el.gpu_capability[1]} (sm_{need}) in the "
                f"Triton kernels; this GPU is sm_{cap[0]}{cap[1]}: use attn_backend='torch' or another storage format")
    return None


def available(fmt: str | None = None, capability: tuple[int, int] | None = None) -> bool:
    """Whether triton imports here; with ``fmt``, whether the kernels run that format (:func:`why_not`)."""
    if fmt is None and capability is None:
        return _triton_imports()
    if fmt is None:
        raise ValueError("capability needs fmt: available(fmt, capability)")
    return why_not(fmt, capability) is None


def formats_available(capability: tuple[int, int] | None = None) -> dict[str, str]:
    """Each element format -> "runs", "runs, without tensor cores (...)" or :func:`why_not`'s line."""
    cap = _capability(capability)
    out = {}
    for name in ELEMENT_FORMATS:
        reason = why_not(name, capability)
        if reason is not None:
            out[name] = reason
        elif cap is not None and cap < TENSOR_CORES:
            out[name] = (f"runs, without tensor cores: tl.dot falls back to FMA below sm_80 (this GPU is "
                         f"sm_{cap[0]}{cap[1]}; Triton supports it unofficially)")
        else:
            out[name] = "runs" + (" (interpreter, CPU)" if cap is None else "")
    return out


def require_triton(what: str) -> None:
    """ImportError saying why, where triton is missing; the kernel modules call it before ``import triton``."""
    if not available():
        raise ImportError(f"{what}: {WHY_NO_TRITON}", name="triton")


def triton_mode() -> str:
    """"interpreter" under ``TRITON_INTERPRET=1`` (kvlab sets it without a GPU), else "compiled"."""
    return "interpreter" if os.environ.get("TRITON_INTERPRET", "0") == "1" else "compiled"


def triton_version() -> str | None:
    """Installed triton version, or None where triton is not installed (e.g. macOS)."""
    try:
        return metadata.version("triton")
    except metadata.PackageNotFoundError:
        return None


def _skip_if_marked(lines: list[str]) -> list[str]:
    """IPython input transformer: a marked cell whose need is unmet prints why it is skipped instead."""
    for line in lines:
        text = line.strip().lower()
        if text and not text.startswith("#"):
            break  # only the comments above the first statement count
        if text.startswith(CELL_MARKER) and not available():
            return [f"print({SKIPPED_CELL!r})\n"]
        if text.startswith(INTERPRETER_MARKER) and triton_mode() == "compiled":
            return [f"print({SKIPPED_COMPILED!r})\n"]
    return lines


def skip_cells_without_triton(shell=None) -> bool:
    """Make marked notebook cells print why they are skipped instead of failing (``kvlab.setup()`` calls
    this); returns whether it is on."""
    if available() and triton_mode() == "interpreter":
        return False
    if shell is None:
        try:
            from IPython import get_ipython  # IPython is there only in a notebook or an IPython shell
        except ImportError:
            return False
        shell = get_ipython()
    if shell is None or not hasattr(shell, "input_transformers_cleanup"):
        return False  # not in a notebook or IPython
    if _skip_if_marked not in shell.input_transformers_cleanup:
        shell.input_transformers_cleanup.append(_skip_if_marked)
    return True


# kernel names load on first use: without triton (macOS) the byte model still draws the bandwidth story
_LAZY = {
    "paged_decode": "decode", "online_softmax_update": "decode", "convert_all_values": "decode",
    "write_kv": "write", "round_half_even": "write", "cast_demo": "write",
    "Operand": "pool", "skeleton_decode": "skeleton",
}


def __getattr__(name):
    import importlib  # the kernel modules import triton: loaded on first use, where it exists
    if name in _LAZY:
        return getattr(importlib.import_module(f"kvlab.kernels.{_LAZY[name]}"), name)
    if name in ("traffic", "decode", "write", "pool", "convert", "ptx", "skeleton", "answers"):
        return importlib.import_module(f"kvlab.kernels.{name}")
    raise AttributeError(f"module 'kvlab.kernels' has no attribute {name!r}")


__all__ = ["available", "formats_available", "gpu_capability", "why_not", "TENSOR_CORES", "WHY_NO_TRITON", "CELL_MARKER", "SKIPPED_CELL", "require_triton", "skip_cells_without_triton",
           "triton_mode", "triton_version", *_LAZY]
