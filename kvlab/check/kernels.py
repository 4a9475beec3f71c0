"""Notebook 05's exercise: the online-softmax update inside a Triton kernel."""

from __future__ import annotations


import torch

from kvlab import kernels
from kvlab.check.core import _run


def _softmax_cases():
    """(s, v, v_scale, tile): scores with masked (-inf) tails, a later tile with a larger max (the old
    state must shrink), scores near 100 (exp without subtracting the max overflows fp32), and a later
    tile with a much smaller max (the running max must keep the old one)."""
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
    """The tile-by-tile recurrence in PyTorch, right or with one classic mistake, to name what a wrong
    answer did: "no max" (exp of the raw scores), "old state not rescaled" (neither l nor acc shrinks
    when the max grows), "acc not rescaled", "l not rescaled", "v_scale in l"
    (the sum of P scaled too), "no v_scale"."""
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
    return "compare your update with FlashAttention's recurrence in the text above, one line at a time"


def _is_jitted(fn) -> bool:
    import triton  # only reached with triton installed (the caller's kernel run needs it anyway)
    from triton.runtime.interpreter import InterpretedFunction  # the same: triton is Linux-only

    return isinstance(fn, (triton.runtime.JITFunction, InterpretedFunction))


def online_softmax_update(fn) -> bool:
    """``fn`` a ``@triton.jit`` function ``(m, l, acc, s, v, v_scale) -> (m, l, acc)``: fold one tile of
    scores s (G, N) and values v (N, D), each value row scaled by v_scale (N,), into the running max m
    (G,), running sum l (G,) and running output acc (G, D). Run by the decode kernel's loop under the
    interpreter; compared with softmax(s) @ (v * v_scale) over all tiles."""
    if not callable(fn):  # checked here: the wrapper below is always callable
        raise TypeError(f"online_softmax_update: pass your function itself, got {type(fn).__name__}")
    if not _is_jitted(fn):  # the interpreter would run a plain Python function; a GPU would not
        print("[fail] online_softmax_update: decorate it with @triton.jit - the decode kernel calls it on the GPU, "
              "where only Triton functions run")
        return False
    cases = []
    for s, v, v_scale, tile in _softmax_cases():
        expected = torch.softmax(s, dim=-1) @ (v * v_scale[:, None])
        cases.append(((s, v, v_scale, tile), expected))

    def call(s, v, v_scale, tile):
        try:
            return kernels.decode.run_online_softmax(fn, s, v, v_scale, tile)  # decode loads triton on first use
        except Exception as e:  # the interpreter wraps what the function raised
            if "NotImplementedError" in repr(e) + repr(e.__cause__):
                raise NotImplementedError from e
            raise

    def close(a, b):
        return isinstance(a, torch.Tensor) and a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5))

    return _run("online_softmax_update (whole run over all tiles: s, v, v_scale, tile -> softmax(s) @ (v * v_scale))",
                call, cases, same=close, exercise="online_softmax_update", learner=fn, hint=_softmax_hint,
                reveal=False)
