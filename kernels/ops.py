"""The kernels applied to kvlab's caches: what the engine's ``attn_backend="triton"`` calls (notebook 05).

:func:`write_to_cache` does what ``cache.write`` does (rotation, scale policy, saturation counters)
with the scatter and quantization in the write kernel (:mod:`kvlab.kernels.write`), after
:func:`~kvlab.kernels.write.check_write` and before any scale changes;
:func:`decode_from_cache` is :func:`kvlab.attention.batched_decode_attention` /
:func:`~kvlab.attention.quantized_batched_decode_attention` in one kernel launch per layer.
"""

from __future__ import annotations

import torch

from kvlab.kernels.decode import paged_decode
from kvlab.kernels.pool import INT8, _check_format, operands
from kvlab.kernels.write import _launch_write, check_write


def write_to_cache(cache, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """k, v (T, H_kv, D) post-RoPE values of new tokens -> their slots (-1: skipped) of ``cache``."""
    check_write(k, v, slot_mapping, cache.num_kv_heads, cache.head_dim, cache.num_blocks * cache.block_size)
    if not hasattr(cache, "config"):
        _launch_write(k, v, slot_mapping, *operands(cache, layer))
        return
    from kvlab.quant import core
    from kvlab.quant.rotation import rotate

    _check_format(cache.k[layer].fmt, f"layer {layer}'s K")  # refuse before any scale or page changes
    _check_format(cache.v[layer].fmt, f"layer {layer}'s V")
    core.check_finite(k, f"keys (layer {layer})")  # before anything is touched, as cache.write does
    core.check_finite(v, f"values (layer {layer})")
    if cache.config.rotate_k:
        k = rotate(k)
    stores = (cache.k[layer], cache.v[layer])
    keep = slot_mapping >= 0
    for st, x in zip(stores, (k, v)):
        if st.fmt.static_scales:  # the policy (first write, correction) sees only real tokens
            st.settle_scale(x[keep] if not bool(keep.all()) else x, cache.config.policy)
    k_op, v_op = operands(cache, layer)
    stats = _launch_write(k, v, slot_mapping, k_op, v_op)
    n_real = int(keep.sum())
    for st, op, stat in zip(stores, (k_op, v_op), stats):
        if st.fmt.quantized:
            st.counts["values"] += n_real * st.d
        if op.fmt == INT8 and stat is not None:
            per_head = stat.sum(dim=0).cpu().long()  # (H, 2)
            st.counts["clipped"] += per_head[:, 0]
            st.counts["at_qmax"] += per_head[:, 1]


def decode_from_cache(q: torch.Tensor, cache, layer: int, index, scale: float, k_new: torch.Tensor | None = None,
                      v_new: torch.Tensor | None = None, **kw) -> torch.Tensor:
    """One decode token per sequence, q (B, H_q, D), over ``cache`` through ``index`` (a
    :class:`kvlab.attention.DecodeIndex`). A quantized pool attends each sequence's own new token
    (``k_new, v_new`` (B, H_kv, D)) at full precision, as the PyTorch reference does. ``kw`` goes to
    :func:`~kvlab.kernels.decode.paged_decode` (``window``, ``softcap``, ``sinks``, tuning knobs)."""
    from kvlab.quant.rotation import rotate

    k_op, v_op = operands(cache, layer)
    if not hasattr(cache, "config"):
        return paged_decode(q, k_op, v_op, index.table, index.context_lens, scale, **kw)
    if k_new is None or v_new is None:
        raise ValueError("a quantized pool needs k_new and v_new: the own token is attended at full precision")
    if cache.config.rotate_k:  # stored keys are rotated; q . k == (q H) . (k H)
        q, k_new = rotate(q), rotate(k_new)
    return paged_decode(q, k_op, v_op, index.table, index.context_lens, scale, k_own=k_new, v_own=v_new, **kw)


__all__ = ["write_to_cache", "decode_from_cache"]
