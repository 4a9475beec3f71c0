"""Notebook 03's build tasks plugged into the quantized pool through the notebook's own call: kvlab's
references give the pool's own tokens and saturation counters; a wrong function is refused by name.
(The checkers' planted mistakes: here and in tests/test_check.py.)"""

import pytest
import torch

from kvlab import check
from kvlab.cache import BlockManager
from kvlab.cache.quantized import QuantizedPagedKVCache
from kvlab.generate import paged_generate, pool_for
from kvlab.quant import KVQuantConfig, TensorFormat, core, named_config

PROMPTS = [[5, 17, 3, 9, 11, 2, 8, 4, 6, 1], [9, 11, 2, 8, 4, 7]]
INT4 = KVQuantConfig(TensorFormat("int4", group_size=16), TensorFormat("int4", group_size=16))  # tiny: head_dim 16


def _run(model, cfg, **hooks):
    n = pool_for(PROMPTS, 12, 4)
    cache = QuantizedPagedKVCache.from_model(model, n, 4, cfg, **hooks)
    return paged_generate(model, PROMPTS, 12, manager=BlockManager(n, 4), cache=cache).token_ids, cache.saturation()


def _same_counters(a, b):
    return a.keys() == b.keys() and all(str(a[k]) == str(b[k]) for k in a)


def _per_head(x, grid=127.0):
    s = core.scale_from_absmax(x.abs().amax(dim=(0, 2), keepdim=True), grid)  # absmax / grid, zero-guarded
    return torch.round(x / s).clamp(-127, 127).to(torch.int8), s


def test_quantize_per_head_checker_names_the_mistakes(capsys):
    assert check.quantize_per_head(_per_head)
    mistakes = {
        "scale = absmax / 127, not / 128": lambda x: _per_head(x, grid=128.0),  # the largest lands on 127
        "one scale per head, shaped (1, 3, 1)": lambda x: (_per_head(x)[0], _per_head(x)[1].flatten()),
    }
    for why, fn in mistakes.items():
        capsys.readouterr()
        assert not check.quantize_per_head(fn)
        out = capsys.readouterr().out
        assert out.startswith("[fail] quantize_per_head: ") and why in out, out


def test_quantize_static_checker_names_the_rounding(capsys):
    assert check.quantize_static(core.quantize_int8)
    capsys.readouterr()

    def half_away(x, scale):  # "as in Task 1": round half to even, not half away from zero
        r = x / scale
        return (r.sign() * (r.abs() + 0.5).floor()).clamp(-127, 127).to(torch.int8)

    assert not check.quantize_static(half_away)
    out = capsys.readouterr().out
    assert out.startswith("[fail] quantize_static: half away from zero"), out


def test_the_references_plugged_in_give_the_pools_own_tokens_and_counters(tiny):
    model, _ = tiny
    cfg = named_config("int8", policy="dynamic")  # the first write (the prompts) sets the per-head scales
    own, own_sat = _run(model, cfg)
    plugged, sat = _run(model, cfg, quantize_per_head=core.quantize_per_head, quantize_static=core.quantize_int8)
    assert plugged == own and _same_counters(sat, own_sat)
    assert _run(model, INT4, pack_int4=core.pack_int4)[0] == _run(model, INT4)[0]


def test_a_wrong_function_plugged_in_is_refused_by_name(tiny):
    model, _ = tiny
    cfg = named_config("int8", policy="dynamic")
    float_codes = lambda x: (torch.round(x / core.quantize_per_head(x)[1]), core.quantize_per_head(x)[1])  # noqa: E731
    with pytest.raises(ValueError, match=r"quantize_per_head returned torch.float32 .*torch.int8 codes"):
        _run(model, cfg, quantize_per_head=float_codes)
    with pytest.raises(ValueError, match="pack returned torch.uint8"):
        _run(model, INT4, pack_int4=lambda q: q)  # not packed: twice the bytes
    with pytest.raises(ValueError, match=r"plug into INT8 per-head"):
        QuantizedPagedKVCache.from_model(model, 8, 4, INT4, quantize_static=core.quantize_int8)
    with pytest.raises(TypeError, match="quantize_static must be a function"):
        QuantizedPagedKVCache.from_model(model, 8, 4, cfg, quantize_static="round")
