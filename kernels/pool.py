"""What a kernel needs to know about one of K or V in one layer of a pool, and the one table of what
the kernels do with each kind of format (notebook 05).

The kernels take tensors, never caches: a pool's ``kernel_operands(layer)`` hands them two
:class:`Operand` s, views of the pool's pages plus how to read them.

| storage                     | data                    | scales                                  |
|-----------------------------|-------------------------|-----------------------------------------|
| fp32 / fp16 / bf16          | ``[N, bs, H, D]`` float | none                                    |
| int8, static scales         | ``[N, bs, H, D]`` int8  | ``[H, D]`` fp32 (per-tensor/head/channel, expanded) |
| int8, per-token(-head)      | ``[N, bs, H, D]`` int8  | ``[N, bs, H or 1, 1]`` fp32 pages       |
| int4 (symmetric, groups g)  | ``[N, bs, H, D/2]`` uint8 | ``[N, bs, H, D/g, 1]`` fp32 pages     |
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.formats import ELEMENT_FORMATS
from kvlab.kernels import available, why_not
from kvlab.kernels.convert import CONVERSIONS


@dataclass(frozen=True)
class KernelKind:
    """What the kernels do with the formats of one registry kind (:data:`kvlab.formats.KINDS`)."""

    code: int  # the format code the kernels branch on (a tl.constexpr)
    words: str  # what of it they take, for error messages
    #: instructions per stored value by conversion variant and pipe ("cvt", "int", "fp16" incl. bf16, "fp32")
    #: for fp16 matmuls; the compiler's byte shuffles (prmt) when packing loaded bytes are not counted
    cost: dict


#: THE table of kernel formats: a registry format with ``kernel=True`` is read as the row of its kind.
#: A new kind needs a row here, a branch in the write and decode kernels, and a test.
KERNEL_KINDS = {
    "float": KernelKind(0, "", dict.fromkeys(CONVERSIONS, {})),
    "int": KernelKind(1, " (any granularity)", {
        "cast": {"cvt": 1},  # cvt.rn.f16.s8
        "magic": {"int": 3, "fp16": 1},  # xor 0x80, widen to 16 bits, or 0x6400; subtract 1152
        "prmt": {"int": 0.75, "fp16": 1},  # per 4 values: xor + 2 prmt, 2 sub.f16x2 (4 results)
        "bf16": {"int": 1, "fp16": 1},  # Triton's own Hopper lowering, read off its sm_90 PTX (kernels/ptx.py)
        "dot8": {},  # K: never converted (int8 dot); V as magic (decode_ops)
    }),
    "packed": KernelKind(2, " (symmetric)", {
        "cast": {"int": 1, "cvt": 1.5, "fp32": 2},  # mask/shift, u8 -> f32, - 8, x scale, f32 -> f16 (2 per cvt)
        "magic": {"int": 2, "fp16": 2},  # mask/shift, or 0x6400; subtract 1032, x group scale (fp16)
        "prmt": {"int": 2, "fp16": 2},  # int4 pages take the magic path under prmt too
        "bf16": {"int": 1, "cvt": 1.5, "fp32": 2},  # as cast (the PTX shows the same u8 -> f32 cvt)
        "dot8": {"int": 2, "fp16": 2},  # dot8's V is converted as magic
    }),
}
FLOAT, INT8, INT4 = (KERNEL_KINDS[k].code for k in ("float", "int", "packed"))
# scale codes: none, one static [H, D] tensor, one scale per slot (and head, or all heads)
NO_SCALE, STATIC, PER_SLOT = 0, 1, 2


def kernel_kind(fmt: str | int) -> KernelKind:
    """The row of a registry format name (``"int8"``) or of a kernel format code (``Operand.fmt``)."""
    if isinstance(fmt, str):
        return KERNEL_KINDS[ELEMENT_FORMATS[fmt].kind]
    return next(k for k in KERNEL_KINDS.values() if k.code == fmt)


def scale_code(fmt) -> int:
    """The scale code of a :class:`~kvlab.quant.TensorFormat`: static scales, one per slot, or none."""
    return NO_SCALE if not fmt.quantized else STATIC if fmt.static_scales else PER_SLOT


def kernel_formats() -> tuple[str, ...]:
    """The storage formats the kernels read and write, from the registry, in words for error messages."""
    return tuple(f.name + KERNEL_KINDS[f.kind].words for f in ELEMENT_FORMATS.values() if f.kernel)


@dataclass
class Operand:
    """One of K or V in one layer, as the kernels see it."""

    data: torch.Tensor  # [N, bs, H, D] (int4: [N, bs, H, D/2] uint8)
    fmt: int  # FLOAT, INT8 or INT4
    scale_kind: int = NO_SCALE  # NO_SCALE, STATIC or PER_SLOT
    static_scale: torch.Tensor | None = None  # [H, D] fp32, contiguous (STATIC)
    slot_scale: torch.Tensor | None = None  # int8: [N, bs, W, 1], W = H or 1; int4: [N, bs, H, D/g, 1]
    group_size: int = 0  # int4 only
    label: str = ""

    @property
    def head_dim(self) -> int:
        return self.data.shape[-1] * (2 if self.fmt == INT4 else 1)

    def scale_strides(self) -> tuple[int, int, int, int]:
        """(block, token, head, group) strides of the per-slot scale pages, in elements; a scale
        shared by all heads (per-token) gets head stride 0, so every head reads the same number."""
        s = self.slot_scale
        if s is None:
            return 0, 0, 0, 0
        head = s.stride(2) if s.shape[2] > 1 else 0
        group = s.stride(3) if self.fmt == INT4 else 0
        return s.stride(0), s.stride(1), head, group


def check_kernel_format(fmt, where: str) -> None:
    """ValueError unless the kernels can read and write this :class:`~kvlab.quant.TensorFormat`
    (its registry entry says ``kernel=True``; packed formats only symmetric, in power-of-two groups)."""
    el = fmt.element
    if not el.kernel or (el.kind == "packed" and not fmt.symmetric):
        raise ValueError(f"{where} is stored as {fmt.label()!r}; attn_backend='triton' handles "
                         f"{', '.join(kernel_formats())}; use attn_backend='torch' or 'reference'")
    reason = why_not(el.name) if available() and el.kernel else None
    if reason is not None:
        raise ValueError(f"{where}: {reason}")
    if el.kind == "packed" and (fmt.group_size < 2 or fmt.group_size & (fmt.group_size - 1)):
        raise ValueError(f"{where}: attn_backend='triton' needs an {fmt.dtype} group_size that is a power of two >= 2, "
                         f"got {fmt.group_size}")


def check_head_dim(d: int) -> None:
    """The kernels tile head_dim with tl.arange (a power of two) and tl.dot (at least 16 on a GPU)."""
    if d & (d - 1) or d < 16:
        raise ValueError(f"attn_backend='triton' needs a power-of-two head_dim >= 16, the model has {d}; "
                         "use attn_backend='torch'")
