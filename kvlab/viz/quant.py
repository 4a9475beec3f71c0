"""Pictures for notebook 03: saturation heatmaps, value histograms with clip lines, error per layer.
They only draw numbers kvlab counted (``QuantizedPagedKVCache.saturation()``, calibration stats)."""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.viz import COLORS


def saturation_heatmap(saturation: dict, counter: str = "clipped", title: str = ""):
    """Layer x head rate of ``counter`` (clipped / at_qmax / corrections) for K and V side by side."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("K", "V"), horizontal_spacing=0.08)
    for col, which in enumerate(("k", "v"), start=1):
        s = saturation[which]
        if counter == "corrections":
            z = s["corrections"].float()
        else:
            z = s[counter].float() / s["values"].clamp(min=1).float()
        fig.add_trace(go.Heatmap(z=z.tolist(), colorscale="Reds", zmin=0, coloraxis="coloraxis",
                                 hovertemplate="layer %{y}, head %{x}: %{z:.2e}<extra></extra>"), 1, col)
        fig.update_xaxes(title_text="KV head", row=1, col=col, dtick=1)
    fig.update_yaxes(title_text="layer", row=1, col=1)
    label = "corrections" if counter == "corrections" else f"{counter} rate"
    fig.update_layout(height=460, title=title or f"{label} per layer x head", coloraxis=dict(colorscale="Reds"),
                      coloraxis_colorbar=dict(title=label))
    return fig


def value_histogram(values, clip_lines: dict, qmax: int = 127, bins: int = 120, title: str = ""):
    """Histogram of one head's values with +-clip lines (e.g. abs-max, p99.9) and the INT8 step of each."""
    import torch

    v = torch.as_tensor(values).flatten().float()
    fig = go.Figure(go.Histogram(x=v.tolist(), nbinsx=bins, marker_color=COLORS["weights"], name="values"))
    palette = [COLORS["kv"], COLORS["padding"], COLORS["tokens"], "#8e44ad"]
    for i, (name, limit) in enumerate(clip_lines.items()):
        color = palette[i % len(palette)]
        clipped = (v.abs() > limit).float().mean().item()
        for sign in (-1, 1):
            fig.add_vline(x=sign * limit, line_color=color, line_dash="dash")
        # the legend carries the numbers: clip range, INT8 step (range / 127) and the share clipped
        fig.add_scatter(x=[None], y=[None], mode="lines", line=dict(color=color, dash="dash"),
                        name=f"{name}: +-{limit:.3g}, INT8 step {limit / qmax:.3g}, clips {clipped:.2%}")
    fig.update_layout(height=400, title=title, xaxis_title="value", yaxis_title="count (log)", yaxis_type="log",
                      legend=dict(orientation="h", y=-0.25))
    return fig


def per_layer_figure(values: list[float], title: str, yaxis: str, highlight: list[int] | None = None):
    colors = [COLORS["kv"] if highlight and i in highlight else COLORS["weights"] for i in range(len(values))]
    fig = go.Figure(go.Bar(x=list(range(len(values))), y=values, marker_color=colors))
    fig.update_layout(height=340, title=title, xaxis_title="layer", yaxis_title=yaxis)
    return fig


def granularity_explorer(keys, values, calibration=None,
                         granularities=("per-tensor", "per-head", "per-channel", "per-token-head")):
    """Pick K or V, a granularity and (with a calibration) the statistic behind static scales:
    INT8 signal-to-noise and clip rate per layer update live."""
    import ipywidgets as W

    from kvlab.quant import core

    stats = ["this data's abs-max"] + (["absmax", "p99.99", "p99.9", "p99"] if calibration is not None else [])

    def measure(x, layer, which, gran, stat):
        if stat == stats[0] or gran not in ("per-tensor", "per-head", "per-channel"):
            q, scale = core.int8_roundtrip(x, gran)
        else:
            scale = calibration.scales(which.lower(), stat, gran)[layer]
            q = core.quantize_int8(x, scale)
        clip = ((x.float() / scale).abs() > 127.5).float().mean().item()
        return core.error_metrics(x, core.dequantize_int8(q, scale))["snr_db"], clip

    which = W.ToggleButtons(options=["K", "V"], description="tensor")
    gran = W.Dropdown(options=list(granularities), value="per-head", description="granularity")
    stat = W.Dropdown(options=stats, value=stats[0], description="scales from")
    fig = go.FigureWidget(make_subplots(specs=[[{"secondary_y": True}]]))
    fig.add_bar(x=list(range(len(keys))), y=[0.0] * len(keys), marker_color=COLORS["tokens"], name="SNR (dB)")
    fig.add_scatter(x=list(range(len(keys))), y=[0.0] * len(keys), mode="lines+markers", line_color=COLORS["kv"],
                    name="clip rate", secondary_y=True)
    fig.update_layout(height=360, xaxis_title="layer", legend=dict(orientation="h", y=1.12))
    fig.update_yaxes(title_text="INT8 SNR (dB, higher is better)", secondary_y=False)
    fig.update_yaxes(title_text="share of values clipped", secondary_y=True)

    def refresh(_=None):
        data = keys if which.value == "K" else values
        rows = [measure(x, i, which.value, gran.value, stat.value) for i, x in enumerate(data)]
        with fig.batch_update():
            fig.data[0].y = [r[0] for r in rows]
            fig.data[1].y = [r[1] for r in rows]
            fig.layout.title = f"{which.value}, {gran.value}, scales from {stat.value}"

    for w in (which, gran, stat):
        w.observe(refresh, names="value")
    refresh()
    return W.VBox([W.HBox([which, gran, stat]), fig])
