"""Notebook 05's exercise: the online-softmax update inside a Triton kernel."""

from __future__ import annotations


import torch

from kvlab import kernels
from kvlab.check.core import _run


def _softmax_cases():
    """(s, v, v_scale, tile): scores with masked (-inf) tails, a later tile with a larger max (the old
    state must shrink), and scores near 100 (exp without subtracting the max overflows fp32)."""
    g = torch.Generator().manual_seed(5)
    cases = []
    for n, tile, big in ((64, 32, 1.0), (96, 32, 30.0), (128, 64, 100.0)):
        s = torch.randn(16, n, generator=g) * big
        s[:, n // 2:] += big  # the second half holds larger scores: later tiles raise the running max
        s[3, -5:] = float("-inf")  # positions past a context's end
        v = torch.randn(n, 32, generator=g)
        v_scale = torch.rand(n, generator=g) + 0.5
        cases.append((s, v, v_scale, tile))
    return cases


def online_softmax_update(fn) -> bool:
    """``fn`` a ``@triton.jit`` function ``(m, l, acc, s, v, v_scale) -> (m, l, acc)``: fold one tile of
    scores s (G, N) and values v (N, D), each value row scaled by v_scale (N,), into the running max m
    (G,), running sum l (G,) and running output acc (G, D). Run by the decode kernel's loop under the
    interpreter; compared with softmax(s) @ (v * v_scale) over all tiles."""
    if not callable(fn):  # checked here: the wrapper below is always callable
        raise TypeError(f"online_softmax_update: pass your function itself, got {type(fn).__name__}")
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
                call, cases, same=close, exercise="online_softmax_update", learner=fn)
