"""Pictures for notebook 03: saturation heatmaps, value histograms with clip lines, error per layer.
They only draw numbers kvlab counted (``QuantizedPagedKVCache.saturation()``, calibration stats)."""

from __future__ import annotations

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from kvlab.quant import core
from kvlab.viz import COLORS
from kvlab.viz.render import live, view


def saturation_heatmap(saturation: dict, counter: str = "clipped", title: str = ""):
    """Layer x head rate of ``counter`` (clipped / at_qmax / corrections) for K and V side by side."""
    fig = make_subplots(rows=1, cols=2, subplot_titles=("K", "V"), horizontal_spacing=0.08)
    for col, which in enumerate(("k", "v"), start=1):
        s = saturation[which]
        z = s[counter].float() if counter == "corrections" else s[counter].float() / s["values"].clamp(min=1).float()
        fig.add_trace(go.Heatmap(z=z.tolist(), colorscale="Reds", zmin=0, coloraxis="coloraxis",
                                 hovertemplate="layer %{y}, head %{x}: %{z:.2e}<extra></extra>"), 1, col)
        fig.update_xaxes(title_text="KV head", row=1, col=col, dtick=1)
    fig.update_yaxes(title_text="layer", row=1, col=1)
    label = "corrections" if counter == "corrections" else f"share of values {counter.replace('_', ' ')}"
    fig.update_layout(height=460, title=title or f"{label} per layer x head", coloraxis=dict(colorscale="Reds"),
                      coloraxis_colorbar=dict(title=label))
    return fig


def value_histogram(values, clip_lines: dict, qmax: int = 127, bins: int = 120, title: str = ""):
    """Histogram of one head's values with +-clip lines (e.g. abs-max, p99.9) and the INT8 step of each."""
    v = torch.as_tensor(values).flatten().float()
    fig = go.Figure(go.Histogram(x=v.tolist(), nbinsx=bins, marker_color=COLORS["weights"], name="values"))
    palette = [COLORS["kv"], COLORS["padding"], COLORS["tokens"], "#8e44ad"]
    for i, (name, limit) in enumerate(clip_lines.items()):
        color = palette[i % len(palette)]
        clipped = (v.abs() > limit * (qmax + 0.5) / qmax).float().mean().item()  # beyond half a step past the edge
        for sign in (-1, 1):
            fig.add_vline(x=sign * limit, line_color=color, line_dash="dash")
        # the legend carries the numbers: clip range, INT8 step (range / 127) and the share clipped
        fig.add_scatter(x=[None], y=[None], mode="lines", line=dict(color=color, dash="dash"),
                        name=f"{name}: +-{limit:.3g}, INT8 step {limit / qmax:.3g}, clips {clipped:.2%}")
    # the x range runs a little past the widest clip line, so no dashed line sits on the plot's edge
    edge = 1.08 * max([v.abs().max().item()] + [float(x) for x in clip_lines.values()])
    fig.update_layout(height=420, title=title or "values and their clip ranges",
                      xaxis=dict(title="value (as the cache receives it, post-RoPE for keys)", range=[-edge, edge]),
                      yaxis_title="count per bin (log scale)", yaxis_type="log",
                      legend=dict(orientation="h", y=-0.25))
    return fig


def per_layer_figure(values: list[float], title: str, yaxis: str, highlight: list[int] | None = None,
                     highlight_name: str = "highlighted", other_name: str = "other layers", log: bool = False):
    """One bar per layer, ``highlight`` in a second colour; ``log`` draws points, since on a log axis a bar's
    height depends on where the axis starts."""
    if log and any(v <= 0 for v in values):
        raise ValueError("log=True needs every value > 0")
    marked = set(highlight or ())
    fig = go.Figure()
    for name, color, keep in ((other_name, COLORS["weights"], False), (highlight_name, COLORS["kv"], True)):
        layers = [i for i in range(len(values)) if (i in marked) == keep]
        if layers and log:
            fig.add_scatter(x=layers, y=[values[i] for i in layers], mode="markers", name=name,
                            marker=dict(color=color, size=11, line=dict(width=1, color="black")))
        elif layers:
            fig.add_bar(x=layers, y=[values[i] for i in layers], marker_color=color, name=name, width=0.8)
    fig.update_layout(height=360, title=title, xaxis=dict(title="layer", dtick=1 if len(values) <= 40 else None),
                      yaxis=dict(title=yaxis, type="log", dtick=1) if log else dict(title=yaxis, rangemode="tozero"),
                      barmode="overlay", legend=dict(orientation="h", y=-0.3), showlegend=bool(marked))
    return fig


def granularity_explorer(keys, values, calibration=None,
                         granularities=("per-tensor", "per-head", "per-channel", "per-token-head"),
                         start: str | None = None):
    """K or V, a granularity and the statistic behind static scales -> INT8 SNR and clip rate per layer."""
    import ipywidgets as W  # ipywidgets loads only when a widget is built (a figure needs plotly alone)
    stats = ["this data's abs-max"] + (["absmax", "p99.99", "p99.9", "p99"] if calibration is not None else [])
    if start is not None and start not in stats:
        raise ValueError(f"start must be one of {stats}, got {start!r}")
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
    stat = W.Dropdown(options=stats, value=start or stats[0], description="scales from")
    fig = make_subplots(specs=[[{"secondary_y": True}]])
    fig.add_bar(x=list(range(len(keys))), y=[0.0] * len(keys), marker_color=COLORS["tokens"], name="SNR (dB)")
    fig.add_scatter(x=list(range(len(keys))), y=[0.0] * len(keys), mode="lines+markers", line_color=COLORS["kv"],
                    name="clip rate", secondary_y=True)
    fig.update_layout(height=400, xaxis_title="layer", legend=dict(orientation="h", y=-0.22), margin=dict(t=60, b=40))
    fig.update_yaxes(title_text="INT8 SNR (dB, higher is better)", rangemode="tozero", secondary_y=False)
    fig.update_yaxes(title_text="share of values clipped", tickformat=".3~%", nticks=5, rangemode="tozero",
                     secondary_y=True)
    fig = live(fig)
    def refresh(_=None):
        data = keys if which.value == "K" else values
        rows = [measure(x, i, which.value, gran.value, stat.value) for i, x in enumerate(data)]
        clips = [r[1] for r in rows]
        with fig.batch_update():
            fig.data[0].y = [r[0] for r in rows]
            fig.data[1].y = clips
            # from 0 to just above the largest rate; when nothing clips, one tick that says so
            if max(clips) > 0:
                fig.layout.yaxis2.update(range=[0, max(clips) * 1.15], tickvals=None, ticktext=None)
            else:
                fig.layout.yaxis2.update(range=[0, 1], tickvals=[0], ticktext=["0: nothing clips"])
            source = (stat.value if gran.value in ("per-tensor", "per-head", "per-channel")
                      else "each token on write (per-token scales ignore 'scales from')")
            fig.layout.title = (f"INT8 {which.value}, {gran.value} scales from {source}<br><sup>"
                                f"mean SNR {sum(r[0] for r in rows) / len(rows):.1f} dB, "
                                f"{sum(clips) / len(clips):.3%} of values clipped</sup>")
    for w in (which, gran, stat):
        w.observe(refresh, names="value")
    refresh()
    return W.VBox([W.HBox([which, gran, stat]), view(fig)])
