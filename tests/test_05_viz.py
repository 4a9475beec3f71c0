"""Notebook 05's bandwidth picture: built from the byte model the kernel tests check, live controls."""

import pytest

from kvlab.bench.kernels import recorded_h200
from kvlab.kernels.traffic import FORMATS, GPU_BANDWIDTH, project, step_bytes
from kvlab.viz import bandwidth as bv


def test_unfused_dequantization_moves_more_bytes_than_fp16():
    shape = dict(num_layers=32, h_q=32, h_kv=8, d=128)
    fp16 = step_bytes("fp16", 32, 4096, **shape)
    fused = step_bytes("int8", 32, 4096, **shape)
    unfused = step_bytes("int8", 32, 4096, **shape, fused=False)
    assert fused < 0.52 * fp16 < fp16 < unfused  # the seed's claim: a dequantized copy erases the gain
    assert FORMATS["k8v4"][1].value_bytes(128) == 64


def test_figure_draws_the_byte_model():
    fig = bv.bandwidth_figure("llama-3-8b", batch=32, context=16384, gpu="H100")
    bars = fig.data[0]
    fp16 = step_bytes("fp16", 32, 16384, 32, 32, 8, 128)
    assert bars.y[0] == pytest.approx(fp16 / 1e9)
    assert bars.y[1] < 0.52 * bars.y[0] and bars.y[3] > bars.y[0]  # fused int8 halves, the copy doubles
    line = fig.data[1]  # fp16 projected step time across contexts
    assert line.y[list(bv.CONTEXTS).index(16384)] == pytest.approx(project("llama-3-8b", 32, 16384, "H100")["fp16"]["projected_ms"])
    assert all(len(t.x) == 0 for t in fig.data[5:9])  # no measurements given, none drawn
    assert len(fig.data) == 9  # bars, 4 lines, 4 measured series
    symbols = [t.marker.symbol for t in fig.data[5:9]]  # each format's measured points: its own colour and shape
    assert len(set(symbols)) == 4 and [t.marker.color for t in fig.data[5:9]] == [t.line.color for t in fig.data[1:5]]
    assert all(t.showlegend is not False and t.name.endswith("measured") for t in fig.data[5:9])


def test_figure_shows_recorded_gpu_points():
    rec = recorded_h200()
    assert rec["mode"] == "gpu" and "H200" in rec["device"] and len(rec["measured"]) == 18
    fig = bv.bandwidth_figure("llama-3-8b", batch=32, context=4096, gpu="H200", bench=rec)
    measured_fp16 = fig.data[5]
    assert [round(x) for x in measured_fp16.x] == [round(c * bv.NUDGE ** -1.5) for c in (1024, 4096, 16384)]
    row = next(r for r in rec["measured"] if r["shape"] == "llama-3-8b" and r["batch"] == 32 and r["context"] == 4096)
    assert measured_fp16.y[1] == pytest.approx(row["us"]["fp16"] * 32 / 1e3)
    assert "measured on NVIDIA H200" in fig.layout.title.text and "none at batch" not in fig.layout.title.text
    fig = bv.bandwidth_figure("llama-3-8b", batch=128, context=4096, gpu="H200", bench=rec)
    assert all(len(t.x) == 0 for t in fig.data[5:9]) and "(none at batch 128)" in fig.layout.title.text


def test_widget_controls_redraw():
    w = bv.bandwidth_widget(bench=recorded_h200())
    (shape, gpu), (batch, ctx) = w.children[0].children, w.children[1].children
    text, fig = w.children[2], w.children[3]
    before = fig.data[0].y[0]
    batch.value = 8
    assert fig.data[0].y[0] == pytest.approx(before / 4, rel=1e-3)
    gpu.value = "A100"
    assert "A100" in fig.layout.title.text and "A100" in text.value
    shape.value = "smollm2-135m"
    assert fig.data[0].y[0] == pytest.approx(step_bytes("fp16", 8, 16384, 30, 9, 3, 64) / 1e9)
    ctx.value = 4096
    assert fig.layout.shapes[0].x0 == 4096  # the chosen context marked on the time panel


def test_bad_names_are_refused():
    with pytest.raises(ValueError, match="shape must be one of"):
        bv.bandwidth_figure("gpt-5")
    with pytest.raises(ValueError, match="gpu must be one of"):
        bv.bandwidth_figure(gpu="B200")
    with pytest.raises(ValueError, match="fmt must be one of"):
        step_bytes("int3", 1, 1, 1, 1, 1, 64)
    assert set(GPU_BANDWIDTH) == {"A100", "H100", "H200"}
