"""The decode kernel stripped to its three ideas, for notebook 05's build tasks.

:mod:`kvlab.kernels.decode` has 41 parameters; this keeps what a participant writes: one program per
sequence x KV head walks the block table a page at a time, dequantizes it in registers and folds it into
the online softmax. Each idea is a ``@triton.jit`` function passed in as a constant, so theirs runs inside:

* ``walk(table_ptr, seq, page, seq_len, s_table, s_blk, s_tok, head, s_head, BLOCK_SIZE)`` ->
  ``(offsets, mask)``: the element offsets (int64) of that page's token slots for this KV head, and
  which slots hold a token of the sequence (Task 1);
* ``update(m, l, acc, s, v, v_scale)``: the online-softmax step (Task 2);
* ``dequant(codes, scale)``: int8 codes and their per-head scale -> fp32 values (Task 3).

The skeleton holds none of the three: it runs the functions it is handed (yours, or kvlab's where you
have not written one yet: ``check.solution(name)`` shows those). It reads float pools and INT8 per-head
pools; ``tests/test_05_tasks.py`` holds it to the PyTorch reference.
"""

from __future__ import annotations

import torch

from kvlab.kernels import require_triton

require_triton("kvlab.kernels.skeleton")
import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from kvlab.kernels.decode import dot  # noqa: E402


@triton.jit
def _skeleton_kernel(q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, table_ptr, lens_ptr, out_ptr, kown_ptr, vown_ptr,
                     sm_scale, s_qb, s_qh, s_table, s_blk, s_tok, s_head,
                     WALK: tl.constexpr, UPDATE: tl.constexpr, DEQUANT: tl.constexpr, QUANT: tl.constexpr,
                     OWN: tl.constexpr, G: tl.constexpr, G_PAD: tl.constexpr, D: tl.constexpr,
                     BLOCK_SIZE: tl.constexpr):
    seq = tl.program_id(0)
    head = tl.program_id(1)  # one KV head and the G query heads that share it
    seq_len = tl.load(lens_ptr + seq)
    offs_g = tl.arange(0, G_PAD)
    offs_d = tl.arange(0, D)
    rows = head * G + offs_g
    q = tl.load(q_ptr + seq * s_qb + rows[:, None] * s_qh + offs_d[None, :], mask=offs_g[:, None] < G,
                other=0.0).to(tl.float32)  # (G_PAD, D)
    m = tl.full((G_PAD,), float("-inf"), tl.float32)
    l = tl.zeros((G_PAD,), tl.float32)
    acc = tl.zeros((G_PAD, D), tl.float32)
    ones = tl.full((BLOCK_SIZE,), 1.0, tl.float32)
    for page in range(0, tl.cdiv(seq_len, BLOCK_SIZE)):
        offsets, mask = WALK(table_ptr, seq, page, seq_len, s_table, s_blk, s_tok, head, s_head, BLOCK_SIZE)
        k = tl.load(k_ptr + offsets[:, None] + offs_d[None, :], mask=mask[:, None], other=0)  # (BLOCK_SIZE, D)
        v = tl.load(v_ptr + offsets[:, None] + offs_d[None, :], mask=mask[:, None], other=0)
        if QUANT:
            k = DEQUANT(k, tl.load(ks_ptr + head))
            v = DEQUANT(v, tl.load(vs_ptr + head))
        s = dot(q, tl.trans(k.to(tl.float32))) * sm_scale  # (G_PAD, BLOCK_SIZE)
        s = tl.where(mask[None, :], s, float("-inf"))
        m, l, acc = UPDATE(m, l, acc, s, v.to(tl.float32), ones)
    if OWN:  # the new token at full precision, not read from the pages: one more tile, its first slot only
        first = tl.arange(0, BLOCK_SIZE) < 1
        own = (seq * tl.num_programs(1) + head) * D + offs_d[None, :] + 0 * tl.arange(0, BLOCK_SIZE)[:, None]
        k1 = tl.load(kown_ptr + own, mask=first[:, None], other=0.0).to(tl.float32)  # (BLOCK_SIZE, D)
        v1 = tl.load(vown_ptr + own, mask=first[:, None], other=0.0).to(tl.float32)
        s1 = tl.where(first[None, :], dot(q, tl.trans(k1)) * sm_scale, float("-inf"))
        m, l, acc = UPDATE(m, l, acc, s1, v1, ones)
    out = acc / l[:, None]
    tl.store(out_ptr + seq * s_qb + rows[:, None] * s_qh + offs_d[None, :], out, mask=offs_g[:, None] < G)


def skeleton_decode(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, block_tables: torch.Tensor,
                    seq_lens: torch.Tensor, scale: float, k_scale: torch.Tensor | None = None,
                    v_scale: torch.Tensor | None = None, *, walk, update, dequant=None, k_own=None,
                    v_own=None) -> torch.Tensor:
    """q (B, H_q, D); k, v (num_blocks, block_size, H_kv, D), float or int8 with per-head scales (H_kv,);
    block_tables (B, max_blocks) int32; seq_lens (B,). Returns (B, H_q, D) fp32, NaN where unwritten.
    ``k_own``, ``v_own`` (B, H_kv, D): one more key and value per sequence after its ``seq_lens`` cached
    ones, at full precision (the engine's new token over an INT8 pool), folded in by ``update`` too.
    ``walk``, ``update``, ``dequant``: ``@triton.jit`` functions (module docstring); ``dequant`` only for
    int8 pages. Notebook 05 hands in yours, or kvlab's through ``check.use`` until yours passes."""
    b, h_q, d = q.shape
    nb, bs, h_kv, d2 = k.shape
    quant = k.dtype == torch.int8
    if d2 != d or v.shape != k.shape or h_q % h_kv or (quant and (k_scale is None or v_scale is None)):
        raise ValueError(f"need k, v (num_blocks, block_size, H_kv, {d}) with H_q a multiple of H_kv, and per-head "
                         f"scales for int8 pages: got q {tuple(q.shape)}, k {tuple(k.shape)}, v {tuple(v.shape)}")
    if quant and dequant is None:
        raise ValueError("int8 pages need dequant=: a @triton.jit (codes, scale) -> fp32 values (Task 3)")
    g = h_q // h_kv
    out = torch.full((b, h_q, d), float("nan"), dtype=torch.float32, device=q.device)
    own = k_own is not None
    if own != (v_own is not None) or (own and (k_own.shape != (b, h_kv, d) or v_own.shape != k_own.shape)):
        raise ValueError(f"k_own and v_own come together, each (B, H_kv, D) = {(b, h_kv, d)}")
    one = torch.ones(h_kv, dtype=torch.float32, device=q.device)
    table = block_tables.to(torch.int32).contiguous()
    q = q.float().contiguous()
    _skeleton_kernel[(b, h_kv)](
        q, k.contiguous(), v.contiguous(), (k_scale if quant else one).float().contiguous(),
        (v_scale if quant else one).float().contiguous(), table, seq_lens.to(torch.int32).contiguous(), out,
        (k_own if own else q).float().contiguous(), (v_own if own else q).float().contiguous(), scale, q.stride(0), q.stride(1), table.stride(0), k.stride(0), k.stride(1), k.stride(2),
        WALK=walk, UPDATE=update, DEQUANT=dequant, QUANT=quant, OWN=own, G=g, G_PAD=max(16, triton.next_power_of_2(g)), D=d,
        BLOCK_SIZE=bs)
    return out


@triton.jit
def _walk_harness_kernel(table_ptr, out_ptr, mask_ptr, seq, page, seq_len, s_table, s_blk, s_tok, head, s_head,
                         WALK: tl.constexpr, BLOCK_SIZE: tl.constexpr):
    offsets, mask = WALK(table_ptr, seq, page, seq_len, s_table, s_blk, s_tok, head, s_head, BLOCK_SIZE)
    offs_t = tl.arange(0, BLOCK_SIZE)
    tl.store(out_ptr + offs_t, offsets.to(tl.int64))
    tl.store(mask_ptr + offs_t, mask.to(tl.int8))


def run_walk(walk, table: torch.Tensor, seq: int, page: int, seq_len: int, s_blk: int, s_tok: int, head: int,
             s_head: int, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """One call of a walk function in a tiny kernel: (offsets (block_size,) int64, mask (block_size,) bool)."""
    table = table.to(torch.int32).contiguous()
    out = torch.full((block_size,), -1, dtype=torch.int64)
    mask = torch.full((block_size,), -1, dtype=torch.int8)
    _walk_harness_kernel[(1,)](table, out, mask, seq, page, seq_len, table.stride(0), s_blk, s_tok, head, s_head,
                               WALK=walk, BLOCK_SIZE=block_size)
    return out, mask.bool()


@triton.jit
def _dequant_harness_kernel(codes_ptr, scale, out_ptr, DEQUANT: tl.constexpr, N: tl.constexpr, D: tl.constexpr):
    offs = tl.arange(0, N)[:, None] * D + tl.arange(0, D)[None, :]
    x = DEQUANT(tl.load(codes_ptr + offs), scale)
    tl.store(out_ptr + offs, x.to(tl.float32))


def run_dequant(dequant, codes: torch.Tensor, scale: float) -> torch.Tensor:
    """One call of a dequant function on an int8 tile (N, D): fp32 (N, D)."""
    out = torch.full(codes.shape, float("nan"), dtype=torch.float32)
    _dequant_harness_kernel[(1,)](codes.contiguous(), scale, out, DEQUANT=dequant, N=codes.shape[0], D=codes.shape[1])
    return out


@triton.jit
def _softmax_harness_kernel(s_ptr, v_ptr, vs_ptr, out_ptr, num_tiles, UPDATE: tl.constexpr, G: tl.constexpr,
                            TILE: tl.constexpr, D: tl.constexpr):
    """out (G, D) = softmax(s) @ (v * v_scale) over num_tiles tiles of TILE positions, folded one tile at a
    time by UPDATE(m, l, acc, s, v, v_scale) -> (m, l, acc), as the decode kernel's loop does."""
    offs_g = tl.arange(0, G)
    offs_n = tl.arange(0, TILE)
    offs_d = tl.arange(0, D)
    m = tl.full((G,), float("-inf"), tl.float32)
    l = tl.zeros((G,), tl.float32)
    acc = tl.zeros((G, D), tl.float32)
    for t in range(num_tiles):
        n = t * TILE + offs_n
        s = tl.load(s_ptr + offs_g[:, None] * (num_tiles * TILE) + n[None, :])  # (G, TILE), -inf = masked
        v = tl.load(v_ptr + n[:, None] * D + offs_d[None, :])  # (TILE, D)
        vs = tl.load(vs_ptr + n)  # (TILE,)
        m, l, acc = UPDATE(m, l, acc, s, v, vs)
    tl.store(out_ptr + offs_g[:, None] * D + offs_d[None, :], acc / l[:, None])


def run_online_softmax(update, s: torch.Tensor, v: torch.Tensor, v_scale: torch.Tensor, tile: int) -> torch.Tensor:
    """Run a ``@triton.jit`` :func:`online_softmax_update` over s (G, N) in tiles; v (N, D) -> (G, D)."""
    g, n = s.shape
    if n % tile or v.shape[0] != n or v_scale.shape != (n,):
        raise ValueError(f"need N a multiple of tile and v (N, D), v_scale (N,): got s {tuple(s.shape)}, "
                         f"v {tuple(v.shape)}, v_scale {tuple(v_scale.shape)}, tile {tile}")
    out = torch.full((g, v.shape[1]), float("nan"), dtype=torch.float32, device=s.device)
    _softmax_harness_kernel[(1,)](s.float().contiguous(), v.float().contiguous(), v_scale.float().contiguous(), out,
                                  n // tile, UPDATE=update, G=g, TILE=tile, D=v.shape[1])
    return out


__all__ = ["skeleton_decode", "run_walk", "run_dequant", "run_online_softmax"]
