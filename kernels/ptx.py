"""The decode kernel compiled for sm_90 without a GPU (Triton ships its own PTX assembler), counting the
instructions each conversion variant becomes (notebook 05): ``cast`` leaves one ``cvt`` per int8 value,
``magic`` and ``prmt`` none. It proves the GPU-only variants compile before a GPU is borrowed; not a timing.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys

import torch

from kvlab.formats import kernel_names
from kvlab.kernels import require_triton
from kvlab.kernels.convert import CONVERSIONS, CONVERT_CODES, MAGIC, check_convert
from kvlab.kernels.pool import INT4, INT8
from kvlab.kernels.traffic import spec_of_format
from kvlab.quant.config import named_config

require_triton("kvlab.kernels.ptx")  # where triton is missing (macOS, Windows): an ImportError that says why
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402

from kvlab.kernels import decode as D  # noqa: E402

#: PTX opcodes counted, by what they mean for the conversion story
PATTERNS = {
    "cvt from int": r"\bcvt\.[a-z.]*f(16|32)\.[su](8|16|32)\b",  # integer -> float: the conversion pipe
    "cvt float": r"\bcvt\.[a-z.]*(f16|bf16|f32|bf16x2|f16x2)\.f(16|32)\b",  # between float widths
    "prmt": r"\bprmt\.b32\b",
    "lop3/and/or/xor": r"\b(lop3\.b32|and\.b(16|32)|or\.b(16|32)|xor\.b(16|32))\b",
    "16-bit x2 arithmetic": r"\b(sub|add|mul|fma)\.(rn\.)?(f16x2|bf16x2)\b",
    "tensor core": r"\b(mma\.sync|wgmma\.mma_async)\b",
}

#: Triton's names of the page dtypes
_TYPES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16", torch.int8: "i8", torch.uint8: "u8"}


def _signature(convert: str, fmt: str) -> tuple[dict, dict]:
    """The kernel's signature and constants for kv_cache_dtype ``fmt`` (a pool at its default granularity)."""
    formats = named_config(fmt).formats(0)
    k, v = (spec_of_format(f) for f in formats)
    k_conv, v_conv = CONVERT_CODES[convert]
    # magic reads int8 pages as bytes (as paged_decode's view does)
    k_ty, v_ty = ("*u8" if conv == MAGIC and s.fmt == INT8 else "*" + _TYPES[f.element.storage]
                  for f, s, conv in zip(formats, (k, v), (k_conv, v_conv)))
    ptrs = {"q_ptr": "*fp16", "out_ptr": "*fp16", "lse_ptr": "*fp16", "k_ptr": k_ty, "v_ptr": v_ty,
            "ks_ptr": "*fp32", "vs_ptr": "*fp32", "kown_ptr": "*fp16", "vown_ptr": "*fp16", "table_ptr": "*i32",
            "ctx_ptr": "*i64", "sinks_ptr": "*fp16"}
    floats = {"sm_scale", "softcap"}
    constexprs = dict(K_FMT=k.fmt, K_SCALE=k.scale_kind, V_FMT=v.fmt, V_SCALE=v.scale_kind,
                      K_GROUP=k.group_size if k.fmt == INT4 else 1, V_GROUP=v.group_size if v.fmt == INT4 else 1,
                      HEAD_DIM=128, BLOCK_SIZE=16, PAGES=8, QPP=4, QPP_PAD=16, GQA=4, HAS_OWN=False, SPLIT=False,
                      DOT_DTYPE=tl.bfloat16 if convert == "bf16" else tl.float16, HAS_SOFTCAP=False,
                      HAS_SINKS=False, K_CONVERT=k_conv, V_CONVERT=v_conv)
    sig = {}
    for p in D.paged_decode_kernel.params:
        if p.is_constexpr:
            sig[p.name] = "constexpr"
        elif p.name in ptrs:
            sig[p.name] = ptrs[p.name]
        else:
            sig[p.name] = "fp32" if p.name in floats else "i32"
    return sig, constexprs


def count_instructions(ptx: str) -> dict[str, int]:
    """How many of each :data:`PATTERNS` family a PTX listing holds (static counts, not executions)."""
    body = "\n".join(line.split("//")[0] for line in ptx.splitlines())
    return {name: len(re.findall(pat, body)) for name, pat in PATTERNS.items()}


def _compile_here(convert: str, fmt: str, arch: int) -> dict:
    sig, constexprs = _signature(convert, fmt)
    # pointers 16-byte aligned and strides multiples of 16, as Triton assumes for the real launch
    attrs = {(i,): [["tt.divisibility", 16]] for i, p in enumerate(D.paged_decode_kernel.params)
             if not p.is_constexpr and sig[p.name] not in ("fp32",) and p.name not in ("iters_per_split", "window")}
    src = triton.compiler.ASTSource(fn=D.paged_decode_kernel, signature=sig, constexprs=constexprs, attrs=attrs)
    compiled = triton.compile(src, target=GPUTarget("cuda", arch, 32))
    ptx = compiled.asm["ptx"]
    return {"convert": convert, "format": fmt, "arch": f"sm_{arch}", "ptx_lines": len(ptx.splitlines()),
            "cubin_bytes": len(compiled.asm["cubin"]), "counts": count_instructions(ptx)}


ARCH = 90  # Hopper: the H200 the recorded run measured


def compile_variants(converts=CONVERSIONS, formats=("int8",)) -> list[dict]:
    """PTX instruction counts per (variant, format) for ``sm_90``, compiled in a child process with the
    interpreter off (a kernel under the interpreter cannot compile); ``dot8`` needs int8 K."""
    for c in converts:
        check_convert(c)
    for f in formats:
        if f not in kernel_names():
            raise ValueError(f"formats must be among {kernel_names()}, got {f!r}")
    jobs = [(c, f) for f in formats for c in converts if not (c == "dot8" and f == "fp16")]
    env = dict(os.environ, TRITON_INTERPRET="0")
    arg = json.dumps({"jobs": jobs, "arch": ARCH})
    proc = subprocess.run([sys.executable, "-m", "kvlab.kernels.ptx", arg], env=env, capture_output=True, text=True,
                          timeout=600)
    if proc.returncode:
        raise RuntimeError(f"compiling the decode kernel for sm_{ARCH} failed:\n{proc.stderr[-3000:]}")
    return json.loads(proc.stdout.splitlines()[-1])


def main(argv=None) -> None:
    args = json.loads((argv or sys.argv[1:])[0])
    print(json.dumps([_compile_here(c, f, args["arch"]) for c, f in args["jobs"]]))


if __name__ == "__main__":
    main()
