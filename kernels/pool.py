"""What a kernel needs to know about one of K or V in one layer of a pool (notebook 05).

The kernels take tensors, never caches: :func:`operands` turns a :class:`~kvlab.cache.PagedKVCache`
or a :class:`~kvlab.quant.cache.QuantizedPagedKVCache` layer into two :class:`Operand` s, each the
data pages plus how to read them. Nothing is copied: an operand holds views of the pool's tensors.

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

# format codes the kernels branch on (tl.constexpr)
FLOAT, INT8, INT4 = 0, 1, 2
# scale codes: none, one static [H, D] tensor, one scale per slot (and head, or all heads)
NO_SCALE, STATIC, PER_SLOT = 0, 1, 2

#: storage formats the Triton kernels read and write (FP8 stays on the PyTorch path)
KERNEL_FORMATS = ("fp32", "fp16", "bf16", "int8 (any granularity)", "int4 (symmetric)")


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


def _static(scale: torch.Tensor | None, h: int, d: int, what: str) -> torch.Tensor:
    if scale is None:
        raise ValueError(f"{what}: this quantized layer has no scale yet (a dynamic policy sets it on the first "
                         "write); write to the cache before attending")
    return scale.float().expand(1, h, d)[0].contiguous()  # (1,1,1) | (1,H,1) | (1,H,D) -> (H, D)


def _check_format(fmt, where: str) -> None:
    """ValueError unless the kernels can read and write this TensorFormat."""
    ok = fmt.dtype in ("fp32", "fp16", "bf16", "int8") or (fmt.dtype == "int4" and fmt.symmetric)
    if not ok:
        raise ValueError(f"{where} is stored as {fmt.label()!r}; attn_backend='triton' handles "
                         f"{', '.join(KERNEL_FORMATS)}; use attn_backend='torch' or 'reference'")
    if fmt.dtype == "int4" and (fmt.group_size < 2 or fmt.group_size & (fmt.group_size - 1)):
        raise ValueError(f"{where}: attn_backend='triton' needs an int4 group_size that is a power of two >= 2, "
                         f"got {fmt.group_size}")


def operand_of_store(store, what: str = "K") -> Operand:
    """An operand for one ``kvlab.quant.cache._Store`` (one of K/V of one quantized layer)."""
    fmt = store.fmt
    _check_format(fmt, what)
    if fmt.dtype in ("fp32", "fp16", "bf16"):
        return Operand(store.data, FLOAT, label=fmt.label())
    if fmt.dtype == "int8":
        if fmt.static_scales:
            return Operand(store.data, INT8, STATIC, static_scale=_static(store.scale, store.h, store.d, what),
                           label=fmt.label())
        return Operand(store.data, INT8, PER_SLOT, slot_scale=store.token_scale, label=fmt.label())
    return Operand(store.data, INT4, PER_SLOT, slot_scale=store.token_scale, group_size=fmt.group_size,
                   label=fmt.label())


def operands(cache, layer: int) -> tuple[Operand, Operand]:
    """(K, V) operands of one layer of a float or quantized paged pool."""
    if hasattr(cache, "config"):  # QuantizedPagedKVCache
        return operand_of_store(cache.k[layer], f"layer {layer}'s K"), operand_of_store(cache.v[layer], f"layer {layer}'s V")
    label = str(cache.dtype).replace("torch.", "").replace("float", "fp")
    return (Operand(cache.k_cache[layer], FLOAT, label=label), Operand(cache.v_cache[layer], FLOAT, label=label))


def check_head_dim(d: int) -> None:
    """The kernels tile head_dim with tl.arange (a power of two) and tl.dot (at least 16 on a GPU)."""
    if d & (d - 1) or d < 16:
        raise ValueError(f"attn_backend='triton' needs a power-of-two head_dim >= 16, the model has {d}; "
                         "use attn_backend='torch'")


def check_cache_supported(cache) -> None:
    """Raise ValueError up front when a pool holds a format or shape the kernels cannot read or write."""
    check_head_dim(cache.head_dim)
    if hasattr(cache, "config"):
        for layer in range(cache.num_layers):
            _check_format(cache.k[layer].fmt, f"layer {layer}'s K")
            _check_format(cache.v[layer].fmt, f"layer {layer}'s V")
