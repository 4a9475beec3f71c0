"""Notebook 05's build tasks: the walk and dequant checkers name the planted mistakes, and the skeleton
decode kernel running kvlab's references (the notebook's own call) matches the PyTorch reference on a
float pool and on an INT8 per-head pool, as the real kernel does. Linux only (triton): skipped elsewhere."""

from pathlib import Path

import pytest
import torch

from kvlab import check, kernels

pytestmark = pytest.mark.skipif(not kernels.available(), reason=kernels.WHY_NO_TRITON)

if kernels.available():
    import triton
    import triton.language as tl  # a @triton.jit function must see `tl` among its module's globals

    @triton.jit
    def walk_no_int64(table_ptr, seq, page, seq_len, s_table, s_blk, s_tok, head, s_head, BLOCK_SIZE: tl.constexpr):
        blk = tl.load(table_ptr + seq * s_table + page)
        offs_t = tl.arange(0, BLOCK_SIZE)
        return blk * s_blk + offs_t * s_tok + head * s_head, page * BLOCK_SIZE + offs_t < seq_len

    @triton.jit
    def walk_no_table(table_ptr, seq, page, seq_len, s_table, s_blk, s_tok, head, s_head, BLOCK_SIZE: tl.constexpr):
        offs_t = tl.arange(0, BLOCK_SIZE)
        return page * s_blk + offs_t * s_tok + head * s_head, page * BLOCK_SIZE + offs_t < seq_len

    @triton.jit
    def walk_no_mask(table_ptr, seq, page, seq_len, s_table, s_blk, s_tok, head, s_head, BLOCK_SIZE: tl.constexpr):
        blk = tl.load(table_ptr + seq * s_table + page).to(tl.int64)
        offs_t = tl.arange(0, BLOCK_SIZE)
        return blk * s_blk + offs_t * s_tok + head * s_head, offs_t >= 0

    @triton.jit
    def walk_no_head(table_ptr, seq, page, seq_len, s_table, s_blk, s_tok, head, s_head, BLOCK_SIZE: tl.constexpr):
        blk = tl.load(table_ptr + seq * s_table + page).to(tl.int64)
        offs_t = tl.arange(0, BLOCK_SIZE)
        return blk * s_blk + offs_t * s_tok, page * BLOCK_SIZE + offs_t < seq_len

    @triton.jit
    def walk_no_s_tok(table_ptr, seq, page, seq_len, s_table, s_blk, s_tok, head, s_head, BLOCK_SIZE: tl.constexpr):
        blk = tl.load(table_ptr + seq * s_table + page).to(tl.int64)
        offs_t = tl.arange(0, BLOCK_SIZE)
        return blk * s_blk + offs_t + head * s_head, page * BLOCK_SIZE + offs_t < seq_len

    @triton.jit
    def walk_mask_inclusive(table_ptr, seq, page, seq_len, s_table, s_blk, s_tok, head, s_head,
                            BLOCK_SIZE: tl.constexpr):
        blk = tl.load(table_ptr + seq * s_table + page).to(tl.int64)
        offs_t = tl.arange(0, BLOCK_SIZE)
        return blk * s_blk + offs_t * s_tok + head * s_head, page * BLOCK_SIZE + offs_t <= seq_len

    @triton.jit
    def update_no_v_scale(m, l, acc, s, v, v_scale):  # right recurrence, but the values' scales left out
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        pv = tl.sum(p[:, :, None] * v[None, :, :], axis=1)
        return m_new, l * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + pv

    @triton.jit
    def dequant_divides(codes, scale):
        return codes.to(tl.float32) / scale

    @triton.jit
    def stub_walk(table_ptr, seq, page, seq_len, s_table, s_blk, s_tok, head, s_head, BLOCK_SIZE: tl.constexpr):
        raise NotImplementedError("x")


def test_block_walk_checker_names_the_mistakes(capsys):
    from kvlab.kernels.answers import block_walk

    assert check.block_walk(block_walk)
    for why, fn in {"cast the block id to int64": walk_no_int64, "a page is not a block id": walk_no_table,
                    "mask the slots past seq_len": walk_no_mask, "add head * s_head": walk_no_head,
                    "add offs_t * s_tok": walk_no_s_tok, "is < seq_len": walk_mask_inclusive}.items():
        capsys.readouterr()
        assert not check.block_walk(fn)
        out = capsys.readouterr().out
        assert out.startswith("[fail] block_walk: ") and why in out, out
        assert "For seq=" in out and "BLOCK_SIZE=16" in out, out  # the case by name
    assert not check.block_walk(stub_walk)
    assert capsys.readouterr().out.startswith("[todo] block_walk")
    assert not check.block_walk(lambda *a: 0)  # a plain Python function: the GPU could not run it
    assert "@triton.jit" in capsys.readouterr().out


def test_online_softmax_checker_names_a_missing_v_scale(capsys):
    from kvlab.kernels.answers import online_softmax_update

    assert check.online_softmax_update(online_softmax_update)
    capsys.readouterr()
    assert not check.online_softmax_update(update_no_v_scale)
    out = capsys.readouterr().out
    assert out.startswith("[fail] online_softmax_update") and "multiply P by v_scale" in out, out


def test_dequant_checker_names_the_mistakes(capsys):
    from kvlab.kernels.answers import dequant_int8

    assert check.dequant_int8(dequant_int8)
    capsys.readouterr()
    assert not check.dequant_int8(dequant_divides)
    out = capsys.readouterr().out
    assert out.startswith("[fail] dequant_int8: multiply by the scale"), out


def test_the_skeleton_with_the_references_matches_the_pytorch_reference():
    from kvlab.attention import DecodeIndex, paged_attention
    from kvlab.kernels.answers import block_walk, dequant_int8, online_softmax_update
    from kvlab.kernels.skeleton import skeleton_decode
    from kvlab.quant import core

    g = torch.Generator().manual_seed(0)
    h_q, h_kv, d, bs = 9, 3, 64, 16
    ctx, tables = [5, 37, 70], [[7], [2, 11, 4], [9, 0, 13, 5, 1]]
    k, v = torch.randn(16, bs, h_kv, d, generator=g), torch.randn(16, bs, h_kv, d, generator=g)
    q = torch.randn(3, h_q, d, generator=g)
    index = DecodeIndex(tables, ctx, bs)
    ref = paged_attention(q, k, v, tables, ctx, [1, 1, 1], scale=d ** -0.5)
    out = skeleton_decode(q, k, v, index.table, index.seq_lens, d ** -0.5, walk=block_walk, update=online_softmax_update)
    assert torch.allclose(out, ref, atol=1e-5)
    qk, sk = core.quantize_per_head(k.flatten(0, 1))  # (slots, H, D) -> per-head scales (1, H, 1)
    qv, sv = core.quantize_per_head(v.flatten(0, 1))
    out8 = skeleton_decode(q, qk.view_as(k), qv.view_as(v), index.table, index.seq_lens, d ** -0.5,
                           k_scale=sk.flatten(), v_scale=sv.flatten(), walk=block_walk,
                           update=online_softmax_update, dequant=dequant_int8)
    ref8 = paged_attention(q, qk.view_as(k).float() * sk, qv.view_as(v).float() * sv, tables, ctx, [1, 1, 1],
                           scale=d ** -0.5)
    assert torch.allclose(out8, ref8, atol=1e-5)
    wrong = skeleton_decode(q, k, v, index.table, index.seq_lens, d ** -0.5, walk=walk_no_table,
                            update=online_softmax_update)
    assert not torch.allclose(wrong, ref, atol=1e-3)  # a wrong walk shows in the output too


def test_the_skeleton_holds_no_answer_of_its_own():
    """kernels/skeleton.py, where notebook 05 sends participants for its tasks, defines no block walk,
    online softmax or dequantization (none jitted, none imported): the answers live in kernels/answers.py."""
    import ast

    from kvlab.kernels import skeleton

    tree = ast.parse(Path(skeleton.__file__).read_text())
    defined = {n.name for n in tree.body if isinstance(n, ast.FunctionDef)}
    imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) for a in n.names}
    for name in ("block_walk", "online_softmax_update", "dequant_int8"):
        assert name not in defined | imported, name
    jitted = [n.name for n in tree.body if isinstance(n, ast.FunctionDef) and n.decorator_list]
    assert all(name.startswith("_") for name in jitted), jitted  # only the kernel and its test harnesses
