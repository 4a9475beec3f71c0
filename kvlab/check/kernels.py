"""Notebook 05's build tasks, each a ``@triton.jit`` function run inside a kernel under the interpreter;
the skeleton decode kernel (:mod:`kvlab.kernels.skeleton`) then runs them together on a real pool."""

from __future__ import annotations

import functools

import torch

from kvlab import kernels
from kvlab.check.core import run_task, tensor_same


def _softmax_cases():
    """(s, v, v_scale, tile): masked tails, a later larger max (the state shrinks), scores near 100 (exp
    overflows fp32 without the max), and a later much smaller max (the running max keeps the old one)."""
    g = torch.Generator().manual_seed(5)
    cases = []
    for n, tile, big in ((64, 32, 1.0), (96, 32, 30.0), (128, 64, 100.0)):
        s = torch.randn(16, n, generator=g) * big
        s[:, n // 2:] += big  # the second half holds larger scores: later tiles raise the running max
        s[3, -5:] = float("-inf")  # positions past a context's end
        v = torch.randn(n, 32, generator=g)
        v_scale = torch.rand(n, generator=g) + 0.5
        cases.append((s, v, v_scale, tile))
    # the max FALLS: the first tile's scores are ~100 above the second's, so a running max taken from the
    # current tile alone makes alpha = exp(m - m_new) = exp(100) overflow float32
    s = torch.randn(16, 64, generator=g)
    s[:, :32] += 100.0
    cases.append((s, torch.randn(64, 32, generator=g), torch.rand(64, generator=g) + 0.5, 32))
    return cases


def _simulate(s, v, v_scale, tile, mistake=None):
    """The tile-by-tile recurrence in PyTorch, right or with one classic mistake (``mistake``), to name what
    a wrong answer did."""
    g, d = s.shape[0], v.shape[1]
    m = torch.full((g,), float("-inf"))
    l, acc = torch.zeros(g), torch.zeros(g, d)
    for t in range(0, s.shape[1], tile):
        st, vt, sc = s[:, t:t + tile], v[t:t + tile], v_scale[t:t + tile]
        m_new = torch.maximum(m, st.max(dim=1).values)
        alpha = torch.exp(m - m_new)
        p = torch.exp(st) if mistake == "no max" else torch.exp(st - m_new[:, None])
        if mistake == "no max":
            alpha = torch.ones_like(alpha)
        pv = p if mistake == "no v_scale" else p * sc[None, :]
        keep = mistake in ("l not rescaled", "old state not rescaled")
        l = (l if keep else l * alpha) + (pv if mistake == "v_scale in l" else p).sum(dim=1)
        acc = (acc if mistake in ("acc not rescaled", "old state not rescaled") else acc * alpha[:, None]) + pv @ vt
        m = m_new
    return acc / l[:, None]


#: what each simulated mistake means, said to the learner
MISTAKES = {
    "old state not rescaled": "when a tile raises the max, the old l and acc must shrink by alpha = exp(m - m_new)",
    "no max": "exp() of the raw scores overflows (scores near 100 here): subtract the running max m_new before exp",
    "acc not rescaled": "when a tile raises the max, the old acc must shrink by alpha = exp(m - m_new) too",
    "l not rescaled": "when a tile raises the max, the old l must shrink by alpha = exp(m - m_new) too",
    "v_scale in l": "v_scale scales the values only: l sums the unscaled exp(s - m_new)",
    "no v_scale": "each value row carries its scale: multiply P by v_scale before P @ v",
}


def _softmax_hint(args, got, expected):
    if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
        return "return (m_new, l_new, acc_new) with the shapes of (m, l, acc)"
    if not torch.isfinite(got).all():
        if args[0][:, args[3]:].max() < args[0][:, :args[3]].max() - 80:  # the case whose max falls
            return ("NaN or inf once a tile's scores are far below the earlier ones: the running max must keep the old "
                    "one, m_new = tl.maximum(m, tl.max(s, axis=1)); from this tile alone, alpha = exp(m - m_new) overflows")
        return ("NaN or inf in the output: " + MISTAKES["no max"] + "; and exp(-inf - -inf) is NaN, so a fully masked "
                "row needs m_new from tl.maximum, never s - s")
    for mistake, why in MISTAKES.items():
        with torch.no_grad():
            if torch.allclose(got, _simulate(*args, mistake), rtol=1e-4, atol=1e-5):
                return why
    if torch.allclose(got, expected, rtol=1e-2, atol=1e-3):
        return ("close, not exact: on a GPU tl.dot of fp32 tiles runs in TF32; pass input_precision=\"ieee\"")
    return ("when m rises to m_new, everything summed so far was weighted by exp(score - m): rescale the old l and "
            "acc by alpha = exp(m - m_new) before adding this tile's exp(s - m_new)")


def _jitted_or_say(name: str, fn) -> bool:
    if not callable(fn):
        raise TypeError(f"{name}: pass your function itself, got {type(fn).__name__}")
    import triton  # only reached with triton installed (the caller's kernel run needs it anyway)
    from triton.runtime.interpreter import InterpretedFunction  # the same: triton is Linux-only
    if not isinstance(fn, (triton.runtime.JITFunction, InterpretedFunction)):
        print(f"[fail] {name}: decorate it with @triton.jit - the decode kernel calls it on the GPU, where only "
              "Triton functions run")
        return False
    return True


def _raised_todo(call):
    """The interpreter wraps what a @triton.jit function raised: a stub's NotImplementedError stays one.
    Keeps ``call``'s signature, so a failing case prints its arguments by name."""
    @functools.wraps(call)
    def run(*args):
        try:
            return call(*args)
        except Exception as e:
            if "NotImplementedError" in repr(e) + repr(e.__cause__):
                raise NotImplementedError from e
            raise
    return run


def online_softmax_update(fn) -> bool:
    """``fn(m (G,), l (G,), acc (G, D), s (G, N), v (N, D), v_scale (N,)) -> (m, l, acc)``, a ``@triton.jit``
    function run by the decode loop, compared with softmax(s) @ (v * v_scale) over all tiles."""
    if not _jitted_or_say("online_softmax_update", fn):  # the interpreter would run a plain function; a GPU not
        return False
    cases = [((s, v, v_scale, tile), torch.softmax(s, dim=-1) @ (v * v_scale[:, None]))
             for s, v, v_scale, tile in _softmax_cases()]
    def call(s, v, v_scale, tile):
        return kernels.skeleton.run_online_softmax(fn, s, v, v_scale, tile)  # skeleton loads triton on first use
    def close(a, b):
        return isinstance(a, torch.Tensor) and a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5))
    return run_task("online_softmax_update (whole run over all tiles: s, v, v_scale, tile -> softmax(s) @ (v * v_scale))",
                   _raised_todo(call), cases, same=close, exercise="online_softmax_update", learner=fn, hint=_softmax_hint)


# (table row, page, seq_len, s_blk, s_tok, head, s_head, block_size): a scattered table; the last case's
# block 100 at 2**26 elements a block lands past 2**31
_TABLE = torch.tensor([[7, 0, 0, 0, 0], [2, 11, 4, 0, 0], [9, 0, 13, 5, 1], [3, 100, 7, 0, 0]], dtype=torch.int32)
_WALKS = [(1, 0, 37, 3072, 192, 0, 64, 16), (1, 2, 37, 3072, 192, 2, 64, 16), (2, 4, 70, 3072, 192, 1, 64, 16),
          (0, 0, 5, 3072, 192, 2, 64, 16), (3, 1, 40, 2**26, 192, 1, 64, 16)]


def _walk_expected(seq, page, seq_len, s_blk, s_tok, head, s_head, bs, blk=None):
    t = torch.arange(bs)
    blk = int(_TABLE[seq, page]) if blk is None else blk
    return blk * s_blk + t * s_tok + head * s_head, page * bs + t < seq_len


def block_walk(fn) -> bool:
    """``fn(table_ptr, seq, page, seq_len, s_table, s_blk, s_tok, head, s_head, BLOCK_SIZE)``, @triton.jit
    -> (a page's int64 slot offsets for one KV head, which slots hold a token)."""
    if not _jitted_or_say("block_walk", fn):
        return False
    cases = [(a, _walk_expected(*a)) for a in _WALKS]
    def call(seq, page, seq_len, s_blk, s_tok, head, s_head, BLOCK_SIZE):  # the table: _TABLE, row seq
        return kernels.skeleton.run_walk(fn, _TABLE, seq, page, seq_len, s_blk, s_tok, head, s_head, BLOCK_SIZE)
    def hint(args, got, expected):
        seq, page, seq_len, s_blk, s_tok, head, s_head, bs = args
        offsets, mask = got
        want_offsets, want_mask = expected
        if torch.equal(offsets, want_offsets % 2**32 - (want_offsets % 2**32 >= 2**31).long() * 2**32) \
                and not torch.equal(offsets, want_offsets):
            return ("the offsets wrapped around: cast the block id to int64 before multiplying, "
                    "tl.load(...).to(tl.int64) - a big pool's offsets pass 2**31")
        if torch.equal(offsets, _walk_expected(*args, blk=page)[0]):
            return "look the block up in the table, tl.load(table_ptr + seq * s_table + page): a page is not a block id"
        if torch.equal(offsets, _walk_expected(*args, blk=int(_TABLE[0, page]))[0]):
            return "read this sequence's row of the table: table_ptr + seq * s_table + page"
        if torch.equal(offsets, want_offsets - head * s_head):
            return "add head * s_head: each KV head sits at its own offset inside a slot"
        if torch.equal(offsets, want_offsets - torch.arange(bs) * (s_tok - 1)):
            return "consecutive slots are s_tok elements apart: add offs_t * s_tok, not offs_t"
        if torch.equal(offsets, want_offsets) and not torch.equal(mask, want_mask):
            if bool(mask.all()):
                return "mask the slots past seq_len: the last page is partly empty"
            return "a slot holds a token when its position, page * BLOCK_SIZE + offset, is < seq_len"
        return None
    return run_task("block_walk", _raised_todo(call), cases, same=tensor_same, hint=hint, learner=fn)


def dequant_int8(fn) -> bool:
    """``fn(codes (N, D) int8, scale fp32) -> fp32 values``, a ``@triton.jit`` function, in registers."""
    if not _jitted_or_say("dequant_int8", fn):
        return False
    g = torch.Generator().manual_seed(3)
    cases = []
    for scale in (0.5, 0.0131, 3.0):
        codes = torch.randint(-127, 128, (16, 64), generator=g, dtype=torch.int8)
        codes[0, :2] = torch.tensor([127, -127], dtype=torch.int8)
        cases.append(((codes, scale), codes.float() * torch.tensor(scale, dtype=torch.float32)))
    def hint(args, got, expected):
        codes, scale = args
        if torch.allclose(got, codes.float() / scale, rtol=1e-5):
            return "multiply by the scale: a code is round(x / scale), so x is about code * scale"
        if torch.equal(got, codes.float()):
            return "the codes still need the head's scale: code * scale"
        if torch.equal(got, torch.trunc(expected)) or torch.equal(got, torch.round(expected)):
            return "keep the values in fp32: converting back to an integer type throws away the fraction"
        return None
    return run_task("dequant_int8", _raised_todo(lambda codes, scale: kernels.skeleton.run_dequant(fn, codes, scale)),
                   cases, same=tensor_same, hint=hint, learner=fn)
