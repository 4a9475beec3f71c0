"""Notebook 06's build tasks: the FP8 scale checker names the planted mistakes, and the reference plugged
into export_vllm through the notebook's own call writes kvlab's own checkpoint file, byte for byte."""

import pytest
import torch

from kvlab import check
from kvlab.calibrate import calibrate
from kvlab.check import answers
from kvlab.export import export_vllm, fp8_scales
from kvlab.sizing import PRESETS, kv_config, kv_token_bytes


def test_fp8_scales_checker_names_the_mistakes(capsys):
    assert check.fp8_scales(fp8_scales)
    pick = lambda a, s: a.amax(1, keepdim=True) if s == "tensor" else a  # noqa: E731
    guard = lambda x, q: torch.where(x < 1e-6, torch.ones_like(x), x / q)  # noqa: E731
    mistakes = {"not INT8's 127": lambda a, s: guard(pick(a, s), 127),
                "the zero guard": lambda a, s: pick(a, s) / 448,
                "not the mean": lambda a, s: guard(a.mean(1, keepdim=True) if s == "tensor" else a, 448),
                "one per layer, kept 2-D": lambda a, s: guard(pick(a, s), 448).flatten() if s == "tensor" else guard(a, 448),
                "rounds differently in float32": lambda a, s: torch.where(pick(a, s) < 1e-6, 1.0, pick(a, s) * (1 / 448)),
                "not only exactly 0": lambda a, s: torch.where(pick(a, s) == 0, 1.0, pick(a, s) / 448)}  # text: < 1e-6
    for why, fn in mistakes.items():
        capsys.readouterr()
        assert not check.fp8_scales(fn)
        out = capsys.readouterr().out
        assert out.startswith("[fail] fp8_scales: ") and why in out, out


def test_the_reference_plugged_into_the_export_writes_kvlabs_own_file(tiny, tmp_path):
    model, _ = tiny
    cal = calibrate(model, [list(range(5, 69))], progress=False)
    for strategy in ("tensor", "attn_head"):
        export_vllm(tmp_path / f"own-{strategy}", cal, strategy=strategy, model=model)
        export_vllm(tmp_path / f"plugged-{strategy}", cal, strategy=strategy, model=model, scales=fp8_scales)
        name = "kv_cache_scales.safetensors"
        assert (tmp_path / f"own-{strategy}" / name).read_bytes() == (tmp_path / f"plugged-{strategy}" / name).read_bytes()
    with pytest.raises(ValueError, match=r"scales returned \(\d+, \d+\), expected a float tensor of shape \(\d+, 1\)"):
        export_vllm(tmp_path / "wrong", cal, strategy="tensor", model=model, scales=lambda a, s: a / 448)


def test_notebook_00s_answers_agree_with_kvlab_sizing():
    for name in ("llama-2-7b", "llama-3-8b", "mistral-7b"):
        c = kv_config(name)
        assert answers.kv_token_bytes(c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim, 0, 2) == \
            kv_token_bytes(c.num_layers, c.num_kv_heads, c.head_dim, 2)
    assert check.kv_token_bytes(answers.kv_token_bytes) and check.mla_bytes_per_token(answers.mla_bytes_per_token)
    assert PRESETS  # the names above are presets
