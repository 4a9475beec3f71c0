"""The attention backends: one object per way of running paged attention over a pool (notebooks 04, 05).

Each is a ``write``, ``decode`` and ``prefill`` over the pool interface (:mod:`kvlab.cache.paged_storage`),
so the engine can swap them.
"""

from __future__ import annotations

import torch

from kvlab import kernels
from kvlab.attention.batched import (batched_decode_attention, batched_prefill_attention,
                                     quantized_batched_decode_attention)
from kvlab.attention.spec import paged_attention, quantized_paged_attention
from kvlab.kernels.pool import check_head_dim, check_kernel_format
from kvlab.quant.rotation import rotate


def spec_attention(q, k_new, v_new, pool, layer: int, block_tables, seq_lens, query_lens, scale: float,
                   as_decodes: bool = False, **features) -> torch.Tensor:
    """The spec over any pool; new tokens attend at full precision (only what is stored is quantized).
    q (T, H_q, D), k_new/v_new (T, H_kv, D) packed -> (T, H_q, D). ``as_decodes``: see
    :func:`quantized_paged_attention` (a float pool reads every token back already)."""
    if pool.is_quantized:
        return quantized_paged_attention(q, k_new, v_new, pool, layer, block_tables, seq_lens, query_lens, scale,
                                         as_decodes=as_decodes, **features)
    k_pages, v_pages = pool.layer_pages(layer)
    return paged_attention(q, k_pages, v_pages, block_tables, seq_lens, query_lens, scale=scale, **features)


class AttentionBackend:
    """The reference backend: the PyTorch spec for everything, one sequence at a time; subclasses
    replace ``write`` and ``decode``."""

    name = "reference"
    #: decodes go through :meth:`decode` with a DecodeIndex (else the specification runs them too)
    batched_decode = False
    #: prefill chunks over a float pool go through one call with a PrefillIndex (else the spec, per sequence)
    batched_prefill = False
    runs_write, runs_decode, runs_prefill = "pool.write (PyTorch)", "the spec, per sequence", "the spec, per sequence"

    def check(self, pool) -> None:
        """Refuse up front a pool this backend cannot run (a ValueError saying why and what can)."""

    def write(self, pool, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        pool.write(layer, k, v, slot_mapping)

    def decode(self, q, pool, layer: int, index, scale: float, k_new=None, v_new=None, **features) -> torch.Tensor:
        """One token per sequence, q (B, H_q, D); here through the specification, sequence by sequence."""
        table = index.table.tolist()
        lens = index.seq_lens.tolist()
        return self.prefill(q, k_new, v_new, pool, layer, table, lens, [1] * len(lens), scale, **features)

    def prefill(self, q, k_new, v_new, pool, layer: int, block_tables, seq_lens, query_lens, scale: float,
                **features) -> torch.Tensor:
        return spec_attention(q, k_new, v_new, pool, layer, block_tables, seq_lens, query_lens, scale, **features)

    def forward(self, batch, layer: int, q: torch.Tensor, k_new: torch.Tensor, v_new: torch.Tensor, scale: float,
                **features) -> torch.Tensor:
        """One layer of one packed forward: write the new K/V, then the decodes (packed first), then the
        rest. (T, H_q, D) -> same."""
        pool = batch.cache
        self.write(pool, layer, k_new, v_new, batch.slot_mapping)
        nd = batch.decode.num if self.batched_decode and batch.decode is not None else 0
        out = torch.empty_like(q)
        if nd:
            out[:nd] = self.decode(q[:nd], pool, layer, batch.decode, scale, k_new[:nd], v_new[:nd], **features)
        if nd < q.shape[0]:
            index = getattr(batch, "prefill", None)
            if (self.batched_prefill and index is not None and not pool.is_quantized
                    and features.get("softcap") is None and features.get("sinks") is None):
                out[nd:] = batched_prefill_attention(q[nd:], *pool.layer_pages(layer), index, scale,
                                                     window=features.get("window"))
            else:
                out[nd:] = self.prefill(q[nd:], k_new[nd:], v_new[nd:], pool, layer, batch.block_tables[nd:],
                                        batch.seq_lens[nd:], batch.query_lens[nd:], scale,
                                        as_decodes=getattr(batch, "as_decodes", False), **features)
        if batch.observer is not None:  # an eviction policy that scores blocks by the attention they get
            batch.observer.observe(layer, q, pool, batch, scale)
        return out

    def __repr__(self) -> str:
        return f"<attention backend {self.name!r}>"


class TorchBackend(AttentionBackend):
    """Decodes batched in PyTorch: one gather and one masked SDPA for a layer's decodes (notebook 04)."""

    name = "torch"
    batched_decode = True
    batched_prefill = True
    runs_decode = "one gather + one masked SDPA for all decodes (PyTorch)"
    runs_prefill = "one gather + one masked SDPA for all chunks of a float pool (else the spec)"

    def decode(self, q, pool, layer: int, index, scale: float, k_new=None, v_new=None, **features) -> torch.Tensor:
        if pool.is_quantized:
            return quantized_batched_decode_attention(q, k_new, v_new, pool, layer, index, scale, **features)
        return batched_decode_attention(q, *pool.layer_pages(layer), index, scale, **features)


class TritonBackend(AttentionBackend):
    """The write and the decodes in Triton kernels, dequantization fused (notebook 05); compiled on a
    GPU, interpreted on a CPU (``TRITON_INTERPRET=1``)."""

    name = "triton"
    batched_decode = True
    runs_write = "the write kernel (quantize + scatter)"
    runs_decode = "the paged decode kernel, one launch per layer"

    def check(self, pool) -> None:
        if not kernels.available():  # macOS, Windows: say so now, not at the first forward
            raise ValueError(f"attn_backend='triton' cannot run here: {kernels.WHY_NO_TRITON}. Without triton, "
                             f"attn_backend must be one of {tuple(b for b in BACKENDS if b != 'triton')}")
        check_head_dim(pool.head_dim)
        for layer in range(pool.num_layers):
            for which, fmt in zip("KV", pool.formats(layer)):
                check_kernel_format(fmt, f"layer {layer}'s {which}")

    def write(self, pool, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v (T, H_kv, D) post-RoPE values of new tokens -> their slots (-1: skipped)."""
        kernels.write.check_write(k, v, slot_mapping, pool.num_kv_heads, pool.head_dim,
                                  pool.num_blocks * pool.block_size)
        pool.kernel_write(layer, k, v, slot_mapping, kernels.write.launch_write)

    def decode(self, q, pool, layer: int, index, scale: float, k_new=None, v_new=None, **kw) -> torch.Tensor:
        """q (B, H_q, D) -> (B, H_q, D); over a quantized pool the own token, ``k_new, v_new`` (B, H_kv, D),
        is attended at full precision, as the spec does."""
        k_op, v_op = pool.kernel_operands(layer)
        if not pool.is_quantized:
            return kernels.paged_decode(q, k_op, v_op, index.table, index.seq_lens, scale, **kw)
        if k_new is None or v_new is None:
            raise ValueError("a quantized pool needs k_new and v_new: the own token is attended at full precision")
        if pool.rotate_k:  # stored keys are rotated; q . k == (q H) . (k H)
            q, k_new = rotate(q), rotate(k_new)
        return kernels.paged_decode(q, k_op, v_op, index.table, index.seq_lens, scale, k_own=k_new,
                                    v_own=v_new, **kw)


class SkeletonBackend(AttentionBackend):
    """Decodes through notebook 05's skeleton kernel with the ``walk``, ``update`` and ``dequant`` it is
    handed (a participant's, notebook 06's "your engine"); writes and prefills as the reference backend.
    Over an INT8 pool the kernel reads the cached context and folds the own new token in at full precision,
    as in the spec, with the same ``update``. Interpreted on a CPU: a few requests only."""

    name = "skeleton"
    batched_decode = True
    runs_decode = "notebook 05's skeleton kernel, with the walk, update and dequantization it is handed"

    def __init__(self, walk, update, dequant):
        self.walk, self.update, self.dequant = walk, update, dequant

    def check(self, pool) -> None:
        TritonBackend.check(self, pool)
        if pool.is_quantized and (pool.rotate_k or any(f.dtype != "int8" or f.granularity != "per-head"
                                                       for layer in range(pool.num_layers) for f in pool.formats(layer))):
            raise ValueError("the skeleton kernel reads float pools and INT8 per-head pools without rotation")

    def decode(self, q, pool, layer: int, index, scale: float, k_new=None, v_new=None, **features) -> torch.Tensor:
        if any(features.get(f) is not None for f in ("window", "softcap", "sinks")):
            raise ValueError("the skeleton kernel has no sliding window, soft-cap or sinks")
        fns = dict(walk=self.walk, update=self.update, dequant=self.dequant)
        if not pool.is_quantized:  # the own token is in the pages already, at the pool's precision
            return kernels.skeleton.skeleton_decode(q, *pool.layer_pages(layer), index.table, index.seq_lens, scale,
                                                    **fns).to(q.dtype)
        ks, vs = pool.k[layer], pool.v[layer]  # the cached context; the own token joins at full precision
        return kernels.skeleton.skeleton_decode(q, ks.data, vs.data, index.table, index.seq_lens - 1, scale,
                                                ks.scale.flatten(), vs.scale.flatten(), k_own=k_new, v_own=v_new,
                                                **fns).to(q.dtype)


#: the backends by the name ``attn_backend=`` takes
BACKENDS = {b.name: b for b in (AttentionBackend(), TorchBackend(), TritonBackend())}
BACKEND_NAMES = tuple(BACKENDS)


def get_backend(backend) -> AttentionBackend:
    """The backend called ``backend`` ("reference", "torch", "triton"), or ``backend`` itself if it is one."""
    if isinstance(backend, AttentionBackend):
        return backend
    if not isinstance(backend, str) or backend not in BACKENDS:
        raise ValueError(f"attention backend must be one of {BACKEND_NAMES}, got {backend!r}")
    return BACKENDS[backend]


__all__ = ["AttentionBackend", "TorchBackend", "TritonBackend", "SkeletonBackend", "BACKENDS", "BACKEND_NAMES", "get_backend",
           "spec_attention"]
