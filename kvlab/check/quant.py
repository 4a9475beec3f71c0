"""Notebook 03's exercises: the INT8 per-head quantizer, calibrated static scales, INT4 packing."""

from __future__ import annotations

from typing import Callable

import torch

from kvlab.quant.core import int8_roundtrip, quantize_int8
from kvlab.quant.core import pack_int4 as ref_pack_int4
from kvlab.check.core import _run, _tensor_same


def quantize_per_head(fn: Callable) -> bool:
    """``fn(x) -> (q, scale)``: x (T, H, D) float; q int8 in -127..127 rounded half to even; scale
    (1, H, 1) = absmax / 127 per head, 1.0 where a head is all (near) zero."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 3, 8, generator=g), torch.randn(16, 2, 4, generator=g) * torch.tensor([5.0, 0.01]).view(1, 2, 1)]
    halves = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 127.0, -127.0, 3.0]).view(1, 1, 8)  # scale exactly 1
    zero_head = torch.randn(3, 2, 8, generator=g)
    zero_head[:, 1] = 0
    cases = [((x,), int8_roundtrip(x, "per-head")) for x in xs + [halves, zero_head]]
    return _run("quantize_per_head", fn, cases, same=_tensor_same)


def quantize_static(fn: Callable) -> bool:
    """``fn(x, scale) -> q``: x (T, H, D) float, scale (1, H, 1) from a calibration run (not from x);
    q int8 = x / scale rounded half to even, clamped to +-127. Here values beyond the calibrated range
    occur, so the clamp fires."""
    g = torch.Generator().manual_seed(2)
    x1 = torch.randn(6, 2, 8, generator=g)
    s1 = torch.tensor([0.02, 0.01]).view(1, 2, 1)  # calibrated on smaller values: many clip
    x2 = torch.tensor([130.0, -130.0, 127.4, -127.6, 200.0, -300.0, 0.5, -2.5]).view(1, 1, 8)  # scale 1
    x3 = torch.randn(4, 3, 4, generator=g) * 0.5
    s3 = torch.tensor([1.0, 0.004, 0.1]).view(1, 3, 1)
    cases = [((x, sc), quantize_int8(x, sc)) for x, sc in ((x1, s1), (x2, torch.ones(1, 1, 1)), (x3, s3))]

    def hint(args, got, expected):
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            return None
        if got.dtype != torch.int8:
            return f"q must be torch.int8, got {got.dtype}"
        outside = (args[0].float() / args[1]).abs() > 128.5  # beyond anything a clamp could give
        if ((got[outside].int() - expected[outside].int()).abs() > 1).any():
            return "values beyond the calibrated range wrapped around: int8 does not saturate, clamp before .to(torch.int8)"
        if (got == -128).any():
            return "-128 appears: clamp to -127..127, a symmetric grid (notebook text, section 2)"
        return None

    return _run("quantize_static", fn, cases, same=_tensor_same, hint=hint, reveal=False)


def pack_int4(fn: Callable) -> bool:
    """``fn(q) -> packed``: q uint8 values 0..15, last dim even; two per byte, the even index in the low nibble."""
    g = torch.Generator().manual_seed(1)
    cases = [((q,), ref_pack_int4(q)) for q in (torch.tensor([[1, 2]], dtype=torch.uint8),
                                       torch.tensor([[15, 0, 0, 15]], dtype=torch.uint8),
                                       torch.randint(0, 16, (3, 4, 8), generator=g, dtype=torch.uint8))]
    return _run("pack_int4", fn, cases, same=_tensor_same)
