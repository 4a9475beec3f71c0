"""Quantize-on-write in Triton: new K/V -> their slots in the pool, in the pool's format (notebook 05).

Triton's ``x.to(tl.int8)`` truncates and wraps (:func:`cast_demo`), so the kernel rounds half to even and
clamps first: the same bytes as :mod:`kvlab.quant.core`, bit for bit. Slot -1 is padding, skipped.
"""

from __future__ import annotations

import torch

from kvlab.kernels import require_triton

require_triton("kvlab.kernels.write")  # where triton is missing (macOS, Windows): an ImportError that says why
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvlab.kernels import pool as O
from kvlab.kernels.decode import FLOAT, INT8, STATIC  # compile-time constants (tl.constexpr)
from kvlab.kernels.decode import check_interpretable, pow2
from kvlab.kernels.pool import Operand, check_head_dim
from kvlab.quant.core import ZERO_GUARD as _ZERO_GUARD
from kvlab.validate import cdiv

ZERO_GUARD = tl.constexpr(_ZERO_GUARD)  # an all-zero group gets scale 1.0, as in kvlab.quant.core


@triton.jit
def round_half_even(x):
    """Ties to even, as torch.round does: libdevice's rint is missing under the interpreter."""
    f = tl.floor(x)
    diff = x - f
    odd = (f - 2.0 * tl.floor(f * 0.5)) != 0.0  # floor is odd: a tie goes up to the even neighbour
    return tl.where(diff > 0.5, f + 1.0, tl.where(diff < 0.5, f, tl.where(odd, f + 1.0, f)))


@triton.jit
def _quantize_int8(x, scale):
    r = tl.div_rn(x, scale)  # correctly rounded division, like torch's x / scale
    q = tl.minimum(tl.maximum(round_half_even(r), -127.0), 127.0)
    clipped = tl.sum((tl.abs(r) > 127.5).to(tl.int32), axis=2)  # (TB, H) values beyond the last step
    at_qmax = tl.sum((tl.abs(q) >= 127.0).to(tl.int32), axis=2)  # (TB, H) values stored as +-127
    return q.to(tl.int8), clipped, at_qmax


@triton.jit
def _write_one(x, slot, valid, tok, heads, data_ptr, scale_ptr, stat_ptr, s_slot, s_head, c_slot, c_head, c_grp,
               s_stat_t, TB: tl.constexpr, H: tl.constexpr, H_PAD: tl.constexpr, FMT: tl.constexpr,
               SCALE: tl.constexpr, PER_HEAD: tl.constexpr, HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr):
    """Quantize a tile of tokens' (TB, H_PAD, D) fp32 values and scatter them to their slots (TB,)."""
    offs_d = tl.arange(0, HEAD_DIM)
    row = slot[:, None] * s_slot + heads[None, :] * s_head  # (TB, H_PAD) int64 element offsets
    m2 = valid[:, None] & (heads < H)[None, :]  # (TB, H_PAD) real token and real head
    if FMT == FLOAT:
        tl.store(data_ptr + row[:, :, None] + offs_d[None, None, :], x.to(data_ptr.dtype.element_ty),
                 mask=m2[:, :, None])
    elif FMT == INT8:
        if SCALE == STATIC:
            scale = tl.load(scale_ptr + heads[:, None] * HEAD_DIM + offs_d[None, :], mask=(heads < H)[:, None],
                            other=1.0)[None, :, :]  # (1, H_PAD, D)
        else:
            if PER_HEAD:
                amax = tl.max(tl.abs(x), axis=2)  # (TB, H_PAD) per token and head
            else:
                amax = tl.max(tl.max(tl.abs(x), axis=2), axis=1)[:, None] + tl.zeros((TB, H_PAD), tl.float32)
            scale2 = tl.where(amax < ZERO_GUARD, 1.0, tl.div_rn(amax, 127.0))  # (TB, H_PAD)
            srow = slot[:, None] * c_slot + heads[None, :] * c_head
            smask = m2 if PER_HEAD else m2 & (heads == 0)[None, :]  # per token: one scale, stored once
            tl.store(scale_ptr + srow, scale2, mask=smask)
            scale = scale2[:, :, None]
        q, clipped, at_qmax = _quantize_int8(x, scale)
        tl.store(data_ptr + row[:, :, None] + offs_d[None, None, :], q, mask=m2[:, :, None])
        stat = stat_ptr + tok[:, None] * s_stat_t + heads[None, :] * 2  # (TB, H_PAD)
        tl.store(stat, clipped, mask=m2)
        tl.store(stat + 1, at_qmax, mask=m2)
    else:  # INT4, symmetric: per token, head and group of GROUP_SIZE channels, q in -7..7 stored + 8
        NG: tl.constexpr = HEAD_DIM // GROUP_SIZE
        g = tl.reshape(x, (TB, H_PAD, NG, GROUP_SIZE))
        amax = tl.max(tl.abs(g), axis=3)  # (TB, H_PAD, NG)
        scale = tl.where(amax < ZERO_GUARD, 1.0, tl.div_rn(amax, 7.0))
        q = round_half_even(tl.div_rn(g, scale[:, :, :, None]))
        q = tl.minimum(tl.maximum(q, -7.0), 7.0) + 8.0
        q = tl.reshape(q, (TB, H_PAD, HEAD_DIM // 2, 2)).to(tl.uint8)
        lo, hi = tl.split(q)  # channels 2j and 2j+1
        packed = lo | (hi << 4)  # (TB, H_PAD, D/2): low nibble first, as kvlab.quant.core.pack_int4
        offs_j = tl.arange(0, HEAD_DIM // 2)
        tl.store(data_ptr + row[:, :, None] + offs_j[None, None, :], packed, mask=m2[:, :, None])
        offs_g = tl.arange(0, NG)
        srow = slot[:, None, None] * c_slot + heads[None, :, None] * c_head + offs_g[None, None, :] * c_grp
        tl.store(scale_ptr + srow, scale, mask=m2[:, :, None])


@triton.jit
def _write_kv_kernel(k_ptr, v_ptr, slot_ptr, num_tokens,
                     kd_ptr, ks_ptr, kstat_ptr, vd_ptr, vs_ptr, vstat_ptr,
                     s_kt, s_kh, s_vt, s_vh,
                     sk_slot, sk_head, sv_slot, sv_head,
                     ck_slot, ck_head, ck_grp, cv_slot, cv_head, cv_grp, s_stat_t,
                     H: tl.constexpr, H_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, TOKENS: tl.constexpr,
                     K_FMT: tl.constexpr, K_SCALE: tl.constexpr, K_PER_HEAD: tl.constexpr, K_GROUP: tl.constexpr,
                     V_FMT: tl.constexpr, V_SCALE: tl.constexpr, V_PER_HEAD: tl.constexpr, V_GROUP: tl.constexpr):
    tok = tl.program_id(0) * TOKENS + tl.arange(0, TOKENS)  # this program's tokens
    slot = tl.load(slot_ptr + tok, mask=tok < num_tokens, other=-1).to(tl.int64)
    valid = slot >= 0  # slot -1: a padding token (or past the end), nothing is written
    heads = tl.arange(0, H_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    lmask = (valid[:, None] & (heads < H)[None, :])[:, :, None]  # (TOKENS, H_PAD, 1)
    k = tl.load(k_ptr + tok[:, None, None] * s_kt + heads[None, :, None] * s_kh + offs_d[None, None, :], mask=lmask,
                other=0.0).to(tl.float32)
    _write_one(k, slot, valid, tok, heads, kd_ptr, ks_ptr, kstat_ptr, sk_slot, sk_head, ck_slot, ck_head, ck_grp,
               s_stat_t, TOKENS, H, H_PAD, K_FMT, K_SCALE, K_PER_HEAD, HEAD_DIM, K_GROUP)
    v = tl.load(v_ptr + tok[:, None, None] * s_vt + heads[None, :, None] * s_vh + offs_d[None, None, :], mask=lmask,
                other=0.0).to(tl.float32)
    _write_one(v, slot, valid, tok, heads, vd_ptr, vs_ptr, vstat_ptr, sv_slot, sv_head, cv_slot, cv_head, cv_grp,
               s_stat_t, TOKENS, H, H_PAD, V_FMT, V_SCALE, V_PER_HEAD, HEAD_DIM, V_GROUP)


def check_slots(slot_mapping: torch.Tensor, n_slots: int) -> None:
    """Slots in 0..n_slots-1 or -1, checked on the CPU only: on a GPU it would synchronize every layer,
    and the engine's slot mappings are valid by construction."""
    if slot_mapping.device.type == "cpu" and slot_mapping.numel():
        lo, hi = int(slot_mapping.min()), int(slot_mapping.max())
        if lo < -1 or hi >= n_slots:
            raise ValueError(f"slot_mapping must hold slots in 0..{n_slots - 1} or -1 (padding), got {lo}..{hi}")


def _slot_strides(op: Operand) -> tuple[int, int, int]:
    """(slot, head, group) strides of an operand's per-slot scale pages; slot = block * bs + offset."""
    if op.slot_scale is None:
        return 0, 0, 0
    blk, tok, head, grp = op.scale_strides()
    assert blk == tok * op.slot_scale.shape[1], "per-slot scale pages must be contiguous across a block's slots"
    return tok, head, grp


def check_write(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, h: int, d: int, n_slots: int) -> None:
    """Everything a write is checked for, before anything (scales included) changes."""
    if k.dim() != 3 or k.shape != v.shape or k.shape[1:] != (h, d):
        raise ValueError(f"k and v must both be (T, {h}, {d}), got {tuple(k.shape)} and {tuple(v.shape)}")
    if slot_mapping.shape != (k.shape[0],):
        raise ValueError(f"slot_mapping must have one slot per token: {tuple(slot_mapping.shape)} vs "
                         f"{k.shape[0]} tokens")
    check_head_dim(d)
    check_slots(slot_mapping, n_slots)
    check_interpretable(k, v)


def write_kv(k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, k_op: Operand, v_op: Operand):
    """Write new K/V (T, H, D) to ``slot_mapping`` (T,); returns (k_stats, v_stats): (T, H, 2) int32
    [clipped, at +-qmax] counts for int8 operands, else None."""
    n_blocks, bs, h = k_op.data.shape[:3]
    for op in (k_op, v_op):  # what a pool's kernel_operands guarantee
        assert op.data.shape[:3] == (n_blocks, bs, h) and op.head_dim == k_op.head_dim, "K and V pages differ"
        assert op.data.stride(0) == bs * op.data.stride(1) and op.data.stride(-1) == 1, "pages not contiguous"
    check_write(k, v, slot_mapping, h, k_op.head_dim, n_blocks * bs)
    check_interpretable(k_op.data, v_op.data)
    return launch_write(k, v, slot_mapping, k_op, v_op)


def launch_write(k, v, slot_mapping, k_op: Operand, v_op: Operand):
    """The launch behind :func:`write_kv`, for callers that ran :func:`check_write` already."""
    t, h, d = k.shape
    if t == 0:
        return None, None
    slot_mapping = slot_mapping.contiguous()  # the kernel reads slot t at offset t
    k, v = (x if x.stride(-1) == 1 else x.contiguous() for x in (k, v))
    stats = [torch.zeros((t, h, 2), dtype=torch.int32, device=k.device) if op.fmt == O.INT8 else None
             for op in (k_op, v_op)]
    # scales and counters the kernel uses; slot_mapping stands in where there are none
    ks, vs = ((op.static_scale if op.scale_kind == O.STATIC else op.slot_scale) for op in (k_op, v_op))
    ks, vs, k_stats, v_stats = (slot_mapping if x is None else x for x in (ks, vs, *stats))
    tokens = min(16, pow2(t))  # tokens per program: one tile of (TOKENS, H, D)
    _write_kv_kernel[(cdiv(t, tokens),)](
        k, v, slot_mapping, t, k_op.data, ks, k_stats, v_op.data, vs, v_stats,
        k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        k_op.data.stride(1), k_op.data.stride(2), v_op.data.stride(1), v_op.data.stride(2),
        *_slot_strides(k_op), *_slot_strides(v_op), 2 * h,
        H=h, H_PAD=pow2(h), HEAD_DIM=d, TOKENS=tokens,
        K_FMT=k_op.fmt, K_SCALE=k_op.scale_kind, K_PER_HEAD=_per_head(k_op), K_GROUP=k_op.group_size or 1,
        V_FMT=v_op.fmt, V_SCALE=v_op.scale_kind, V_PER_HEAD=_per_head(v_op), V_GROUP=v_op.group_size or 1,
    )
    return stats[0], stats[1]


def _per_head(op: Operand) -> bool:
    """Per-slot int8 scales: one per token AND head (pages [.., H, 1]) or one per token ([.., 1, 1])."""
    return op.scale_kind == O.PER_SLOT and op.fmt == O.INT8 and op.slot_scale.shape[2] > 1


# ---- the trap this file avoids, as a demonstration --------------------------------------------------

@triton.jit
def _cast_demo_kernel(x_ptr, trunc_ptr, round_ptr, N: tl.constexpr):
    offs = tl.arange(0, N)
    x = tl.load(x_ptr + offs)
    tl.store(trunc_ptr + offs, x.to(tl.int8))  # what a plain cast does
    tl.store(round_ptr + offs, tl.minimum(tl.maximum(round_half_even(x), -127.0), 127.0).to(tl.int8))


def cast_demo(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(plain ``.to(tl.int8)``, round-half-even + clamp) of a 1-D float32 tensor, computed in Triton: the
    plain cast truncates toward zero, and wraps beyond +-127 under the interpreter (undefined on a GPU)."""
    x = x.float().contiguous()
    n = x.numel()
    padded = torch.zeros(pow2(n), dtype=torch.float32, device=x.device)
    padded[:n] = x
    trunc = torch.empty(padded.shape, dtype=torch.int8, device=x.device)
    rnd = torch.empty_like(trunc)
    _cast_demo_kernel[(1,)](padded, trunc, rnd, N=padded.numel())
    return trunc[:n], rnd[:n]


__all__ = ["write_kv", "check_write", "check_slots", "round_half_even", "cast_demo"]
