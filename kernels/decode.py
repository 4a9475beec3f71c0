"""Paged decode attention in Triton, with the dequantization fused in (notebook 05); the specification is
:mod:`kvlab.attention`. One program = one sequence x one KV head (x one split): its G query heads share
each K/V load (GQA, padded to 16 rows for ``tl.dot``), it walks the block table ``PAGES`` blocks at a time
with an fp32 online softmax, and widens int8/int4 pages in registers with the scales folded where they
cost least, so no dequantized copy of the cache exists. Split-KV (flash-decoding) merges partial outputs
exactly through their log-sum-exp; ``window``, ``softcap`` and ``sinks`` are what models ask for.
"""

from __future__ import annotations

import math

import torch

from kvlab.kernels import require_triton
from kvlab.validate import cdiv, check_int, check_power_of_two
from kvlab.validate import check_attention_features as check_features

require_triton("kvlab.kernels.decode")  # where triton is missing (macOS, Windows): an ImportError that says why
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvlab.kernels import convert as C
from kvlab.kernels import pool as O
from kvlab.kernels import triton_mode
from kvlab.kernels.pool import Operand

# pool's and convert's codes as tl.constexpr: a @triton.jit function can read a global only if it is one
FLOAT, INT8, INT4 = tl.constexpr(O.FLOAT), tl.constexpr(O.INT8), tl.constexpr(O.INT4)
NO_SCALE, STATIC, PER_SLOT = tl.constexpr(O.NO_SCALE), tl.constexpr(O.STATIC), tl.constexpr(O.PER_SLOT)
CAST, MAGIC, PRMT, RAW = tl.constexpr(C.CAST), tl.constexpr(C.MAGIC), tl.constexpr(C.PRMT), tl.constexpr(C.RAW)


@triton.jit
def int8_magic(u):
    """int8 bytes ``u`` (uint8 view) -> fp16 with no ``cvt``: 1024 + (x + 128) through bits, minus 1152."""
    h = ((u ^ 0x80).to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True)  # 1024 + x + 128, exact
    return h - 1152.0  # stays fp16: x exactly


@triton.jit
def int8_prmt(x):
    """int8 -> fp16 four values at a time in inline PTX (``convert.PRMT_ASM``): compiled GPUs only."""
    return tl.inline_asm_elementwise(C.PRMT_ASM, "=r,=r,r", [x], dtype=tl.float16, is_pure=True, pack=4)


@triton.jit
def int4_magic(n):
    """int4 nibbles n = q + 8 (uint8, 0..15) -> q as fp16: 0x6400 | n is 1024 + n, then 1032 goes."""
    return (n.to(tl.uint16) | 0x6400).to(tl.float16, bitcast=True) - 1032.0


@triton.jit
def dot(a, b):
    """a @ b accumulated in fp32; fp32 operands stay IEEE (not TF32) so the fp32 engine matches PyTorch."""
    if b.dtype == tl.float32:
        return tl.dot(a.to(tl.float32), b, input_precision="ieee")
    else:
        return tl.dot(a.to(b.dtype), b)


@triton.jit
def online_softmax_update(m, l, acc, s, v, v_scale):
    """Fold one tile into the running softmax state (FlashAttention's recurrence); returns (m, l, acc).

    m, l: (G,) running max and sum of exp(score - m); acc: (G, D) running sum of exp(score - m) * value;
    s: (G, N) scores, -inf where no position; v: (N, D) stored values; v_scale: (N,) their scales (or ones).
    """
    m_new = tl.maximum(m, tl.max(s, axis=1))  # (G,)
    alpha = tl.exp(m - m_new)  # how much the old state shrinks; exp(-inf) = 0 on the first tile
    p = tl.exp(s - m_new[:, None])  # (G, N); masked positions give exp(-inf) = 0
    l = l * alpha + tl.sum(p, axis=1)  # the sum uses P itself, not the scaled P
    pv = p * v_scale[None, :]  # sum_n p_n (s_n v_n) == sum_n (p_n s_n) v_n: G*N multiplies, not N*D
    acc = acc * alpha[:, None] + dot(pv, v)  # (G, N) @ (N, D) -> (G, D)
    return m_new, l, acc


@triton.jit
def soft_cap(s, cap):
    """cap * tanh(s / cap), tanh written with exp (tl has no tanh on every backend), overflow-free."""
    x = s / cap
    e = tl.exp(-2.0 * tl.abs(x))
    t = (1.0 - e) / (1.0 + e)
    return cap * tl.where(x < 0, -t, t)


@triton.jit
def _load_pages(ptr, scale_ptr, blk, offs_t, tok_mask, head,
                s_blk, s_tok, s_head, c_blk, c_tok, c_head, c_grp,
                FMT: tl.constexpr, SCALE: tl.constexpr, PAGES: tl.constexpr, BLOCK_SIZE: tl.constexpr,
                HEAD_DIM: tl.constexpr, GROUP_SIZE: tl.constexpr, DTYPE: tl.constexpr, CONVERT: tl.constexpr):
    """PAGES pages of one KV head -> (N, D) values in DTYPE, converted as CONVERT says (RAW stays int8),
    and (N,) fp32 per-slot scales still to apply (1.0 if none). blk (PAGES,) int64; tok_mask (PAGES, BS)."""
    N: tl.constexpr = PAGES * BLOCK_SIZE
    base = blk[:, None] * s_blk + offs_t[None, :] * s_tok + head * s_head  # (PAGES, BS) int64 element offsets
    sc = tl.full((N,), 1.0, tl.float32)
    if FMT == INT4:
        offs_j = tl.arange(0, HEAD_DIM // 2)  # packed bytes: channel 2j in the low nibble, 2j+1 in the high
        packed = tl.load(ptr + base[:, :, None] + offs_j[None, None, :], mask=tok_mask[:, :, None], other=0)
        if CONVERT == CAST:
            lo = (packed & 0x0F).to(tl.float32)
            hi = (packed >> 4).to(tl.float32)
            x = tl.reshape(tl.interleave(lo, hi), (N, HEAD_DIM)) - 8.0  # symmetric: stored q + 8
        else:
            x = tl.reshape(tl.interleave(int4_magic(packed & 0x0F), int4_magic(packed >> 4)), (N, HEAD_DIM))
        NG: tl.constexpr = HEAD_DIM // GROUP_SIZE
        offs_g = tl.arange(0, NG)
        sbase = blk[:, None] * c_blk + offs_t[None, :] * c_tok + head * c_head  # (PAGES, BS)
        gs = tl.load(scale_ptr + sbase[:, :, None] + offs_g[None, None, :] * c_grp, mask=tok_mask[:, :, None],
                     other=0.0)
        gs = tl.reshape(gs, (N, NG))
        if CONVERT != CAST:
            gs = gs.to(tl.float16)  # fp16 x fp16: no value is widened
        x = tl.reshape(tl.reshape(x, (N, NG, GROUP_SIZE)) * gs[:, :, None], (N, HEAD_DIM)).to(DTYPE)  # group scales
    else:
        offs_d = tl.arange(0, HEAD_DIM)
        x = tl.load(ptr + base[:, :, None] + offs_d[None, None, :], mask=tok_mask[:, :, None], other=0)
        if FMT == INT8 and CONVERT == MAGIC:
            x = int8_magic(x)
        elif FMT == INT8 and CONVERT == PRMT:
            x = int8_prmt(x)
        if CONVERT != RAW:
            x = x.to(DTYPE)  # int8 (CAST) or exact fp16 values -> DTYPE in registers
        x = tl.reshape(x, (N, HEAD_DIM))
        if SCALE == PER_SLOT:
            sc = tl.load(scale_ptr + blk[:, None] * c_blk + offs_t[None, :] * c_tok + head * c_head, mask=tok_mask,
                         other=0.0)
            sc = tl.reshape(sc, (N,))
    return x, sc


@triton.jit
def paged_decode_kernel(
    q_ptr, out_ptr, lse_ptr,  # q, out (B, H_q, D); with splits out/lse are the partials (B, H_q, S, D) / (B, H_q, S)
    k_ptr, v_ptr, ks_ptr, vs_ptr,  # pool pages and their scales (static [H, D] or per-slot pages)
    kown_ptr, vown_ptr,  # (B, H_kv, D) the own new token at full precision (HAS_OWN)
    table_ptr, ctx_ptr,  # (B, max_blocks) block ids; (B,) context lengths incl. the own token
    sinks_ptr,  # (H_q,) sink logits (HAS_SINKS)
    sm_scale, iters_per_split, window, softcap,  # window: keys seen by the new token (a huge number: all)
    s_qb, s_qh, s_ob, s_oh, s_os, s_lb, s_lh,
    sk_blk, sk_tok, sk_head, sv_blk, sv_tok, sv_head,
    ck_blk, ck_tok, ck_head, ck_grp, cv_blk, cv_tok, cv_head, cv_grp,
    s_own_b, s_own_h, s_tab,
    K_FMT: tl.constexpr, K_SCALE: tl.constexpr, V_FMT: tl.constexpr, V_SCALE: tl.constexpr,
    K_GROUP: tl.constexpr, V_GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr, BLOCK_SIZE: tl.constexpr, PAGES: tl.constexpr,
    QPP: tl.constexpr, QPP_PAD: tl.constexpr, GQA: tl.constexpr, HAS_OWN: tl.constexpr, SPLIT: tl.constexpr,
    DOT_DTYPE: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr,
    K_CONVERT: tl.constexpr, V_CONVERT: tl.constexpr,
):
    b = tl.program_id(0)
    pid_h = tl.program_id(1)  # a KV head (grouped) or a query head (QPP == 1)
    split = tl.program_id(2)
    kv_head = (pid_h * QPP) // GQA
    offs_g = tl.arange(0, QPP_PAD)
    heads = pid_h * QPP + offs_g  # query heads of this program
    g_mask = offs_g < QPP
    offs_d = tl.arange(0, HEAD_DIM)
    offs_t = tl.arange(0, BLOCK_SIZE)
    offs_p = tl.arange(0, PAGES)
    N: tl.constexpr = PAGES * BLOCK_SIZE
    q = tl.load(q_ptr + b * s_qb + heads[:, None] * s_qh + offs_d[None, :], mask=g_mask[:, None], other=0.0)
    q = q.to(tl.float32)  # (QPP_PAD, D)
    q_pool = q * sm_scale
    if K_SCALE == STATIC:  # fold the K scale into q once: (q * s_k) . k_int8 == q . (s_k * k_int8)
        q_pool = q_pool * tl.load(ks_ptr + kv_head * HEAD_DIM + offs_d)[None, :]
    if K_CONVERT == RAW:  # dot8: q itself to int8, one scale per row, so QK^T is an int8 x int8 -> int32 dot
        q_amax = tl.max(tl.abs(q_pool), axis=1)
        q_sc = tl.where(q_amax > 0, q_amax / 127.0, 1.0)
        q_pool = tl.minimum(tl.maximum(tl.floor(q_pool / q_sc[:, None] + 0.5), -127.0), 127.0).to(tl.int8)
    ctx = tl.load(ctx_ptr + b).to(tl.int32)
    n_pool = ctx - HAS_OWN  # tokens read from the pool
    n_iters = tl.cdiv(n_pool, N)
    lo = tl.maximum(ctx - window, 0)  # the first position the sliding window still sees
    it_start = split * iters_per_split
    it_end = tl.minimum(it_start + iters_per_split, n_iters)
    it_start = tl.maximum(it_start, lo // N)  # tiles wholly before the window are never loaded
    it_end = tl.where(lo < n_pool, it_end, it_start)  # the window holds only the own token: no tile at all
    m = tl.full((QPP_PAD,), float("-inf"), tl.float32)
    l = tl.zeros((QPP_PAD,), tl.float32)
    acc = tl.zeros((QPP_PAD, HEAD_DIM), tl.float32)
    for it in range(it_start, it_end):
        page = it * PAGES + offs_p  # (PAGES,) logical block numbers
        blk = tl.load(table_ptr + b * s_tab + page, mask=page * BLOCK_SIZE < n_pool, other=0).to(tl.int64)
        pos = page[:, None] * BLOCK_SIZE + offs_t[None, :]  # (PAGES, BS) token positions
        tok_mask = (pos < n_pool) & (pos >= lo)
        k, k_sc = _load_pages(k_ptr, ks_ptr, blk, offs_t, tok_mask, kv_head, sk_blk, sk_tok, sk_head,
                              ck_blk, ck_tok, ck_head, ck_grp, K_FMT, K_SCALE, PAGES, BLOCK_SIZE, HEAD_DIM, K_GROUP,
                              DOT_DTYPE, K_CONVERT)
        v, v_sc = _load_pages(v_ptr, vs_ptr, blk, offs_t, tok_mask, kv_head, sv_blk, sv_tok, sv_head,
                              cv_blk, cv_tok, cv_head, cv_grp, V_FMT, V_SCALE, PAGES, BLOCK_SIZE, HEAD_DIM, V_GROUP,
                              DOT_DTYPE, V_CONVERT)
        if K_CONVERT == RAW:  # int8 x int8 on the tensor cores, exact in int32; q's row scales after
            s = tl.dot(q_pool, tl.trans(k), out_dtype=tl.int32).to(tl.float32) * q_sc[:, None]
        else:
            s = dot(q_pool, tl.trans(k))  # (QPP_PAD, D) @ (D, N) -> (QPP_PAD, N) scores
        if K_SCALE == PER_SLOT and K_FMT == INT8:
            s = s * k_sc[None, :]  # per-slot K scale folded into QK
        if HAS_SOFTCAP:
            s = soft_cap(s, softcap)
        s = tl.where(tl.reshape(tok_mask, (N,))[None, :], s, float("-inf"))
        m, l, acc = online_softmax_update(m, l, acc, s, v, v_sc)  # a per-slot V scale is folded into P
    if V_SCALE == STATIC:  # the static V scale multiplies the output once, not every tile
        acc = acc * tl.load(vs_ptr + kv_head * HEAD_DIM + offs_d)[None, :]
    if HAS_OWN:
        if split == tl.num_programs(2) - 1:  # the last split also takes the own token, at full precision
            k_own = tl.load(kown_ptr + b * s_own_b + kv_head * s_own_h + offs_d).to(tl.float32)
            v_own = tl.load(vown_ptr + b * s_own_b + kv_head * s_own_h + offs_d).to(tl.float32)
            s_own = tl.sum(q * k_own[None, :], axis=1) * sm_scale  # (QPP_PAD,)
            if HAS_SOFTCAP:
                s_own = soft_cap(s_own, softcap)
            m_new = tl.maximum(m, s_own)  # the same recurrence for a tile of one position
            alpha = tl.exp(m - m_new)
            p_own = tl.exp(s_own - m_new)
            l = l * alpha + p_own
            acc = acc * alpha[:, None] + p_own[:, None] * v_own[None, :]
            m = m_new
    if HAS_SINKS:
        if split == tl.num_programs(2) - 1:  # the sink joins the softmax once: a key of value zero
            sink = tl.load(sinks_ptr + heads, mask=g_mask, other=0.0).to(tl.float32)
            m_new = tl.maximum(m, sink)
            alpha = tl.exp(m - m_new)
            l = l * alpha + tl.exp(sink - m_new)
            acc = acc * alpha[:, None]
            m = m_new
    if SPLIT:
        # normalized partial output + log-sum-exp; an empty split has l = 0: lse -inf, output 0
        safe_l = tl.where(l > 0, l, 1.0)
        tl.store(out_ptr + b * s_ob + heads[:, None] * s_oh + split * s_os + offs_d[None, :],
                 acc / safe_l[:, None], mask=g_mask[:, None])
        lse = tl.where(l > 0, m + tl.log(safe_l), float("-inf"))
        tl.store(lse_ptr + b * s_lb + heads * s_lh + split, lse, mask=g_mask)
    else:
        tl.store(out_ptr + b * s_ob + heads[:, None] * s_oh + offs_d[None, :],
                 acc / tl.where(l > 0, l, 1.0)[:, None], mask=g_mask[:, None])  # 0, not NaN, for an empty context


@triton.jit
def _merge_kernel(part_ptr, lse_ptr, out_ptr, num_splits, s_pb, s_ph, s_ps, s_lb, s_lh, s_ob, s_oh,
                  HEAD_DIM: tl.constexpr, SPLITS_PAD: tl.constexpr):
    """out = sum_s w_s o_s / sum_s w_s with w_s = exp(lse_s - max lse): the exact softmax over the
    union of the splits, since each o_s is normalized by its own sum exp(lse_s)."""
    b = tl.program_id(0)
    h = tl.program_id(1)
    offs_s = tl.arange(0, SPLITS_PAD)
    offs_d = tl.arange(0, HEAD_DIM)
    s_mask = offs_s < num_splits
    lse = tl.load(lse_ptr + b * s_lb + h * s_lh + offs_s, mask=s_mask, other=float("-inf"))
    w = tl.exp(lse - tl.max(lse, axis=0))  # (S,); empty splits weigh 0
    o = tl.load(part_ptr + b * s_pb + h * s_ph + offs_s[:, None] * s_ps + offs_d[None, :], mask=s_mask[:, None],
                other=0.0)
    tl.store(out_ptr + b * s_ob + h * s_oh + offs_d, tl.sum(w[:, None] * o, axis=0) / tl.sum(w, axis=0))


# ---- host side ------------------------------------------------------------------------------------

# the matmuls run in q's dtype on a GPU (fp16/bf16 on tensor cores), in fp32 under the interpreter
_DOT_DTYPES = {torch.float16: tl.float16, torch.bfloat16: tl.bfloat16, torch.float32: tl.float32}


def check_interpretable(*tensors: torch.Tensor) -> None:
    """Refuse bf16 under the interpreter, which keeps it as raw 16-bit integers (wrong dots and casts)."""
    if triton_mode() == "interpreter" and any(t.dtype == torch.bfloat16 for t in tensors):
        raise ValueError("bf16 tensors cannot run in Triton's interpreter (CPU); use fp32 or fp16")


def pow2(n: int) -> int:
    """The least power of two >= n (1 for n <= 1)."""
    return 1 << max(0, math.ceil(math.log2(max(n, 1))))


def default_pages(block_size: int) -> int:
    """Pages per iteration: 128-token tiles, the best of 32/64/128 tokens at batch 32 x 16K on an H200."""
    return max(1, 128 // block_size)


def default_splits(programs_per_split: int, max_blocks: int, pages: int) -> int:
    """Split only when too few programs fill the GPU (flash-decoding); never under the interpreter."""
    if triton_mode() == "interpreter" or not torch.cuda.is_available():
        return 1
    sms = torch.cuda.get_device_properties(torch.cuda.current_device()).multi_processor_count
    want = cdiv(2 * sms, max(programs_per_split, 1))
    return int(max(1, min(want, cdiv(max_blocks, 4 * pages))))  # at most one split per ~4 tiles of the longest context


def paged_decode(q: torch.Tensor, k: Operand, v: Operand, block_tables: torch.Tensor, seq_lens: torch.Tensor,
                 scale: float, k_own: torch.Tensor | None = None, v_own: torch.Tensor | None = None,
                 num_splits: int | None = None, pages: int | None = None, group_heads: bool = True,
                 out: torch.Tensor | None = None, *, window: int | None = None,
                 softcap: float | None = None, sinks: torch.Tensor | None = None, convert: str = "cast",
                 num_stages: int | None = None) -> torch.Tensor:
    """Decode attention of one query token per sequence over a paged pool: (B, H_q, D) in q's dtype.

    q (B, H_q, D); k, v a pool's ``kernel_operands(layer)``; block_tables (B, max_blocks); seq_lens (B,)
    tokens INCLUDING the new one (checked only on the CPU: a GPU check would synchronize every layer);
    ``k_own, v_own`` (B, H_kv, D): the new token, attended at full precision; ``sinks`` (H_q,).
    """
    C.check_convert(convert)
    if triton_mode() == "interpreter" and convert in C.NOT_INTERPRETABLE:
        raise ValueError(f"convert={convert!r} cannot run here: {C.NOT_INTERPRETABLE[convert]}; "
                         f"under the interpreter use one of {tuple(c for c in C.CONVERSIONS if c not in C.NOT_INTERPRETABLE)}")
    if convert == "dot8" and k.fmt != O.INT8:
        raise ValueError(f"convert='dot8' multiplies int8 K pages by an int8 q; these K pages are {k.label or 'not int8'}")
    if q.dim() != 3:
        raise ValueError(f"q must be (B, H_q, D), got shape {tuple(q.shape)}")
    bsz, h_q, d = q.shape
    h_kv, block_size = k.data.shape[2], k.data.shape[1]
    # what the pool and its DecodeIndex guarantee (the triton backend's check is the user-facing one)
    assert k.head_dim == d == v.head_dim and v.data.shape[:3] == k.data.shape[:3], "q, K and V pages disagree"
    assert q.device == k.data.device == v.data.device, "q, K and V pages on different devices"
    assert block_tables.dim() == 2 and block_tables.shape[0] == bsz and seq_lens.shape == (bsz,), "a row per q row"
    assert block_tables.stride(1) == 1 and seq_lens.stride(0) == 1, "block_tables and seq_lens must be contiguous"
    q = q.contiguous()  # the kernel reads q's last dimension with unit stride
    assert k.data.stride(-1) == 1 and v.data.stride(-1) == 1, "pages must be contiguous along head_dim"
    if d & (d - 1) or d < 16 or block_size & (block_size - 1):
        raise ValueError(f"the kernel needs a power-of-two head_dim >= 16 (tl.dot's smallest) and a power-of-two "
                         f"block_size, got {d} and {block_size}")
    check_interpretable(q, k.data, v.data)
    if h_q % h_kv:
        raise ValueError(f"query heads ({h_q}) must be a multiple of KV heads ({h_kv})")
    if (k_own is None) != (v_own is None):
        raise ValueError("give both k_own and v_own, or neither")
    check_features(h_q, window, softcap, sinks)
    assert sinks is None or sinks.device == q.device, "sinks must be on q's device"
    if out is not None and (out.shape != q.shape or out.stride(-1) != 1):
        raise ValueError(f"out must have q's shape {tuple(q.shape)} and be contiguous along head_dim, "
                         f"got {tuple(out.shape)}")
    if seq_lens.device.type == "cpu" and bsz:
        lo, hi = int(seq_lens.min()), int(seq_lens.max())
        if lo < 1 or hi > block_tables.shape[1] * block_size:
            raise ValueError(f"seq_lens must be in 1..{block_tables.shape[1] * block_size} (max_blocks x "
                             f"block_size), got {lo}..{hi}")
        if block_tables.numel() and (int(block_tables.min()) < 0 or int(block_tables.max()) >= k.data.shape[0]):
            raise ValueError(f"block_tables must hold block ids in 0..{k.data.shape[0] - 1}")
    gqa = h_q // h_kv
    qpp = gqa if group_heads else 1
    pages = check_power_of_two("pages", pages or default_pages(block_size))
    pages = max(pages, 16 // block_size)  # a tile of >= 16 tokens: tl.dot's smallest dimension on a GPU
    max_blocks = block_tables.shape[1]
    if num_splits is None:
        num_splits = default_splits(bsz * (h_q // qpp), max_blocks, pages)
    num_splits = check_int("num_splits", num_splits)
    iters_per_split = max(1, cdiv(cdiv(max_blocks, pages), num_splits))
    has_own = k_own is not None
    if has_own:
        for t, name in ((k_own, "k_own"), (v_own, "v_own")):
            if t.shape != (bsz, h_kv, d) or t.device != q.device:
                raise ValueError(f"{name} must be (B={bsz}, H_kv={h_kv}, D={d}) on {q.device}, got "
                                 f"{tuple(t.shape)} on {t.device}")
        own_k, own_v = k_own.contiguous(), v_own.contiguous()  # one (H_kv * D, D, 1) stride set for both
    else:
        own_k = own_v = q  # unused placeholders keep the signature fixed
    out = torch.empty_like(q) if out is None else out
    split = num_splits > 1
    if split:  # fp32 partial outputs and their log-sum-exp, merged after
        part = torch.empty((bsz, h_q, num_splits, d), dtype=torch.float32, device=q.device)
        lse = torch.empty((bsz, h_q, num_splits), dtype=torch.float32, device=q.device)
        dst, lse_arg, s_o, s_l = part, lse, part.stride()[:3], lse.stride()[:2]
    else:
        dst, lse_arg, s_o, s_l = out, out, (out.stride(0), out.stride(1), 0), (0, 0)
    ks = k.static_scale if k.scale_kind == O.STATIC else k.slot_scale if k.slot_scale is not None else q
    vs = v.static_scale if v.scale_kind == O.STATIC else v.slot_scale if v.slot_scale is not None else q
    k_conv, v_conv = C.CONVERT_CODES[convert]
    # the magic number works on int8 bytes as unsigned: a view, no copy
    kd = k.data.view(torch.uint8) if k_conv == C.MAGIC and k.fmt == O.INT8 else k.data
    vd = v.data.view(torch.uint8) if v_conv == C.MAGIC and v.fmt == O.INT8 else v.data
    dot_dtype = tl.float32 if triton_mode() == "interpreter" else _DOT_DTYPES.get(q.dtype, tl.float32)
    dot_dtype = tl.bfloat16 if convert == "bf16" else dot_dtype
    launch = {} if num_stages is None else {"num_stages": check_int("num_stages", num_stages)}
    grid = (bsz, h_q // qpp, num_splits)
    paged_decode_kernel[grid](
        q, dst, lse_arg, kd, vd, ks, vs, own_k, own_v, block_tables, seq_lens,
        sinks.float().contiguous() if sinks is not None else q,
        float(scale), iters_per_split, window or 1 << 30, float(softcap or 1.0),
        q.stride(0), q.stride(1), *s_o, *s_l,
        kd.stride(0), kd.stride(1), kd.stride(2), vd.stride(0), vd.stride(1), vd.stride(2),
        *k.scale_strides(), *v.scale_strides(),
        h_kv * d, d, block_tables.stride(0),
        K_FMT=k.fmt, K_SCALE=k.scale_kind, V_FMT=v.fmt, V_SCALE=v.scale_kind,
        K_GROUP=k.group_size or 1, V_GROUP=v.group_size or 1,
        HEAD_DIM=d, BLOCK_SIZE=block_size, PAGES=pages,
        QPP=qpp, QPP_PAD=max(16, pow2(qpp)), GQA=gqa, HAS_OWN=has_own, SPLIT=split,
        HAS_SOFTCAP=softcap is not None, HAS_SINKS=sinks is not None,
        DOT_DTYPE=dot_dtype, K_CONVERT=k_conv, V_CONVERT=v_conv, **launch,
    )
    if split:
        _merge_kernel[(bsz, h_q)](part, lse, out, num_splits, part.stride(0), part.stride(1), part.stride(2),
                                  lse.stride(0), lse.stride(1), out.stride(0), out.stride(1),
                                  HEAD_DIM=d, SPLITS_PAD=pow2(num_splits))
    return out


# ---- every int8 value and every nibble through each conversion: exhaustive, on the CPU and on a GPU ---------

@triton.jit
def _convert_all_kernel(x_ptr, u_ptr, cast_ptr, magic_ptr, int4_ptr, prmt_ptr, PRMT_TOO: tl.constexpr):
    offs = tl.arange(0, 256)
    x = tl.load(x_ptr + offs)
    tl.store(cast_ptr + offs, x.to(tl.float16))
    u = tl.load(u_ptr + offs)
    tl.store(magic_ptr + offs, int8_magic(u))
    tl.store(int4_ptr + offs, int4_magic(u & 0x0F))
    if PRMT_TOO:
        tl.store(prmt_ptr + offs, int8_prmt(x))


def convert_all_values(device="cpu") -> dict[str, bool]:
    """Which conversions give exactly ``x.half()`` for all 256 int8 values (and their nibbles as int4)."""
    x = torch.arange(-128, 128, dtype=torch.int8, device=device)
    outs = [torch.full((256,), float("nan"), dtype=torch.float16, device=device) for _ in range(4)]
    prmt_too = triton_mode() == "compiled"
    _convert_all_kernel[(1,)](x, x.view(torch.uint8), *outs, PRMT_TOO=prmt_too)
    want4 = ((x.view(torch.uint8) & 0x0F).to(torch.int16) - 8).half()
    got = {"cast": torch.equal(outs[0], x.half()), "magic": torch.equal(outs[1], x.half()),
           "int4 magic": torch.equal(outs[2], want4)}
    if prmt_too:
        got["prmt"] = torch.equal(outs[3], x.half())
    return got


__all__ = ["convert_all_values", "online_softmax_update", "paged_decode", "paged_decode_kernel", "default_splits",
           "default_pages", "pow2", "check_interpretable"]
