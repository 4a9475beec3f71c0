"""What a kernel needs to know about one of K or V in one layer of a pool (notebook 05).

The kernels take tensors, never caches: a pool's ``kernel_operands(layer)``
(:class:`~kvlab.cache.PagedKVCache`, :class:`~kvlab.cache.QuantizedPagedKVCache`) hands them two
:class:`Operand` s, each the data pages plus how to read them. Nothing is copied: an operand holds
views of the pool's tensors.

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

# format codes the kernels branch on (tl.constexpr)
FLOAT, INT8, INT4 = 0, 1, 2
# scale codes: none, one static [H, D] tensor, one scale per slot (and head, or all heads)
NO_SCALE, STATIC, PER_SLOT = 0, 1, 2

def kernel_formats() -> tuple[str, ...]:
    """The storage formats the Triton kernels read and write, from the registry (FP8 stays on the
    PyTorch path), in words for error messages."""
    words = {"int": " (any granularity)", "packed": " (symmetric)"}
    return tuple(f.name + words.get(f.kind, "") for f in ELEMENT_FORMATS.values() if f.kernel)



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
