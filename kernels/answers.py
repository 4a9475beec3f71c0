"""kvlab's answers to notebook 05's three build tasks, as ``check.solution`` prints them and ``check.use`` runs
them until a participant's pass (the skeleton holds none). :mod:`kvlab.kernels.decode` does the same inline.
"""

from __future__ import annotations

from kvlab.kernels import require_triton

require_triton("kvlab.kernels.answers")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvlab.kernels.decode import online_softmax_update  # noqa: E402  Task 2: the production kernel's own step


@triton.jit
def block_walk(table_ptr, seq, page, seq_len, s_table, s_blk, s_tok, head, s_head, BLOCK_SIZE: tl.constexpr):
    """Page ``page`` of sequence ``seq``: its physical block from the block table, then the element
    offset of each of its BLOCK_SIZE slots for KV head ``head``, in int64 (a big pool's offsets pass
    2**31), and a mask of the slots that hold a token (positions < seq_len)."""
    blk = tl.load(table_ptr + seq * s_table + page).to(tl.int64)  # the physical block id
    offs_t = tl.arange(0, BLOCK_SIZE)
    offsets = blk * s_blk + offs_t * s_tok + head * s_head  # (BLOCK_SIZE,) int64
    return offsets, page * BLOCK_SIZE + offs_t < seq_len


@triton.jit
def dequant_int8(codes, scale):
    """int8 codes (N, D) as loaded, one fp32 scale for the KV head -> fp32 values, in registers."""
    return codes.to(tl.float32) * scale


__all__ = ["block_walk", "online_softmax_update", "dequant_int8"]
