"""Notebook 03's exercises: the INT8 per-head quantizer, calibrated static scales, INT4 packing."""

from __future__ import annotations

from typing import Callable

import torch

from kvlab.quant.core import int8_roundtrip, quantize_int8
from kvlab.quant.core import pack_int4 as ref_pack_int4
from kvlab.check.core import run_task, tensor_same


def quantize_per_head(fn: Callable) -> bool:
    """``fn(x) -> (q, scale)``: x (T, H, D) float; q int8 in -127..127 rounded half to even; scale
    (1, H, 1) = absmax / 127 per head, 1.0 where a head is all (near) zero."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 3, 8, generator=g), torch.randn(16, 2, 4, generator=g) * torch.tensor([5.0, 0.01]).view(1, 2, 1)]
    halves = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 127.0, -127.0, 3.0]).view(1, 1, 8)  # scale exactly 1
    zero_head = torch.randn(3, 2, 8, generator=g)
    zero_head[:, 1] = 0
    tiny_head = torch.randn(3, 2, 8, generator=g)
    tiny_head[:, 0] *= 1e-8  # absmax below 1e-6: the guard applies, not only at exactly zero
    cases = [((x,), int8_roundtrip(x, "per-head")) for x in xs + [halves, zero_head, tiny_head]]
    def hint(args, got, expected):
        if not isinstance(got, tuple) or len(got) != 2 or not all(isinstance(t, torch.Tensor) for t in got):
            return "return the pair (q, scale)"
        q, scale = got
        if q.dtype != torch.int8:
            return f"q must be torch.int8 (round, clamp, then .to(torch.int8)), got {q.dtype}"
        if scale.shape != expected[1].shape:
            return f"one scale per head, shaped {tuple(expected[1].shape)} to broadcast over (T, H, D)"
        x = args[0]
        if (x.abs().amax(dim=(0, 2)) < 1e-6).any() and not torch.equal(scale, expected[1]):
            return "the zero guard: scale 1.0 where a head's absmax is below 1e-6, not only where it is 0"
        amax = x.abs().amax(dim=(0, 2), keepdim=True)
        for grid in (128, 255, 256):
            if torch.allclose(scale.float(), torch.where(amax < 1e-6, torch.ones_like(amax), amax / grid)):
                return (f"scale = absmax / 127, not / {grid}: the grid is -127 .. 127, and a head's largest magnitude "
                        "lands exactly on 127")
        if torch.equal(q, torch.trunc(x / expected[1]).clamp(-127, 127).to(torch.int8)):
            return "truncation: round half to even (torch.round) before the cast"
        r = x / expected[1]
        if torch.equal(q, (r.sign() * (r.abs() + 0.5).floor()).clamp(-127, 127).to(torch.int8)):
            return ("half away from zero: 0.5 -> 1 and 2.5 -> 3, where half to even gives 0 and 2 (torch.round); "
                    "on real keys the two almost never differ, but the recipe asks for half to even")
        whole = torch.full_like(expected[1], float(x.abs().max()) / 127)
        if x.abs().max() >= 1e-6 and torch.allclose(scale.float(), whole):
            return "one scale for the whole tensor: per head means the abs-max over tokens and channels, one per head"
        return None
    return run_task("quantize_per_head", fn, cases, same=tensor_same, hint=hint)


def quantize_static(fn: Callable) -> bool:
    """``fn(x (T, H, D), scale (1, H, 1)) -> q``: int8, half to even, clamped to +-127; the scale comes from a
    calibration, not from x, so the clamp fires."""
    g = torch.Generator().manual_seed(2)
    x1 = torch.randn(6, 2, 8, generator=g)
    s1 = torch.tensor([0.02, 0.01]).view(1, 2, 1)  # calibrated on smaller values: many clip
    x2 = torch.tensor([130.0, -130.0, 127.4, -127.6, 200.0, -300.0, 0.5, -2.5]).view(1, 1, 8)  # scale 1
    x3 = torch.randn(4, 3, 4, generator=g) * 0.5
    s3 = torch.tensor([1.0, 0.004, 0.1]).view(1, 3, 1)
    # a hair from half steps: x * (1 / scale) rounds to the neighbouring code (06's engine found it in a write)
    x4 = torch.tensor([[[4.359249591827393, 1], [5.942550182342529, -1], [-0.3013499975204468, 0.7072499394416809]]])
    s4 = torch.tensor([0.0371, 0.0519, 0.0123]).view(1, 3, 1)
    cases = [((x, sc), quantize_int8(x, sc)) for x, sc in ((x1, s1), (x2, torch.ones(1, 1, 1)), (x3, s3), (x4, s4))]
    def hint(args, got, expected):
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            return None
        if got.dtype != torch.int8:
            return f"q must be torch.int8, got {got.dtype}"
        x, sc = args
        if torch.equal(got, torch.round(x.float() * (1.0 / sc)).clamp(-127, 127).to(torch.int8)):
            return "divide by the scale: x * (1 / scale) rounds to the neighbouring code a hair from a half step"
        own = int8_roundtrip(x, "per-head")[0]
        if torch.equal(got, own) and not torch.equal(own, expected):
            return ("that is a scale computed from x (dynamic): here the scale is the calibrated one passed in, "
                    "so values beyond its range must be dealt with")
        widened = quantize_int8(x, torch.maximum(sc, x.abs().amax(dim=(0, 2), keepdim=True) / 127))
        if torch.equal(got, widened) and not torch.equal(widened, expected):
            return ("a widened scale: a real policy (section 4's 1.2x correction), but not this write. Here the "
                    "scale stays as calibrated, so an overshooting value saturates at +-127 and the counters "
                    "record it; widening is decided afterwards, from those counters")
        outside = (args[0].float() / args[1]).abs() > 128.5  # beyond anything a clamp could give
        if ((got[outside].int() - expected[outside].int()).abs() > 1).any():
            return "values beyond the calibrated range wrapped around: int8 does not saturate, clamp before .to(torch.int8)"
        if (got == -128).any():
            return "-128 appears: clamp to -127..127, a symmetric grid (notebook text, section 2)"
        r = x / sc
        if torch.equal(got, torch.trunc(r).clamp(-127, 127).to(torch.int8)):
            return "truncation: round half to even (torch.round) before the clamp and the cast, as in Task 1"
        if torch.equal(got, (r.sign() * (r.abs() + 0.5).floor()).clamp(-127, 127).to(torch.int8)):
            return "half away from zero: 0.5 -> 1 and -2.5 -> -3, where half to even (torch.round) gives 0 and -2"
        return None
    return run_task("quantize_static", fn, cases, same=tensor_same, hint=hint)


def pack_int4(fn: Callable) -> bool:
    """``fn(q) -> packed``: q uint8 values 0..15, last dim even; two per byte, the even index in the low nibble."""
    g = torch.Generator().manual_seed(1)
    cases = [((q,), ref_pack_int4(q)) for q in (torch.tensor([[1, 2]], dtype=torch.uint8),
                                       torch.tensor([[15, 0, 0, 15]], dtype=torch.uint8),
                                       torch.randint(0, 16, (3, 4, 8), generator=g, dtype=torch.uint8))]
    def hint(args, got, expected):
        (q,) = args
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            return f"half the last dimension: two values per byte, shape {tuple(expected.shape)}"
        if got.dtype != torch.uint8:
            return f"bytes are torch.uint8 (an int8 would turn values >= 128 negative), got {got.dtype}"
        if torch.equal(got, q[..., 1::2] | (q[..., 0::2] << 4)):
            return "the nibbles are swapped: the even index goes in the LOW nibble, the odd one in the high"
        return None
    return run_task("pack_int4", fn, cases, same=tensor_same, hint=hint)
