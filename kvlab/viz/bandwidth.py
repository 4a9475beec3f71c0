"""Bandwidth savings, made visible (notebook 05): bytes one decode step moves by KV format and context, the
step time they imply on a GPU, and measured kernel times (``kvlab bench kernels``) beside them.
"""

from __future__ import annotations

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.kernels.traffic import COMPARED, GPU_BANDWIDTH, SHAPES, step_bytes
from kvlab.viz import COLORS
from kvlab.viz.render import live, view
from kvlab.viz.paged import PALETTE

#: what is drawn: the compared formats and INT8 through a dequantized FP16 copy
FORMAT_NAMES = {**{f: f.upper() for f in COMPARED}, "int8_unfused": "INT8 via FP16 copy"}
FORMAT_COLORS = dict(zip(FORMAT_NAMES, (COLORS["weights"], COLORS["tokens"], PALETTE[0], COLORS["kv"])))
# measured points of different formats can sit on top of each other: distinct shapes keep them apart
FORMAT_SYMBOLS = dict(zip(FORMAT_NAMES, ("circle", "diamond", "square", "triangle-up")))
NUDGE = 1.12  # measured points of the four formats spread along x by this factor each, so none hides another
CONTEXTS = [2**k for k in range(8, 16)]  # 256 ... 32768 tokens per sequence


def _bytes(shape: str, fmt: str, batch: int, context: int) -> int:
    unfused = fmt == "int8_unfused"
    return step_bytes("int8" if unfused else fmt, batch, context, *SHAPES[shape], fused=not unfused)


def measured_points(bench: dict | None, shape: str, batch: int, fmt: str) -> tuple[list, list]:
    """(contexts, whole-model step ms = per-layer kernel time x layers) from a GPU run; empty without one."""
    if not bench or "measured" not in bench:
        return [], []
    layers = SHAPES[shape][0]
    rows = sorted((r for r in bench["measured"] if r["shape"] == shape and r["batch"] == batch),
                  key=lambda r: r["context"])
    return [r["context"] for r in rows], [r["us"][fmt] * layers / 1e3 for r in rows]


def bandwidth_figure(shape: str = "llama-3-8b", batch: int = 32, context: int = 16384, gpu: str = "H100",
                     bench: dict | None = None, widget: bool = False):
    """Bytes per decode step (attention only) by format, and their time at the GPU's peak bandwidth."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    if gpu not in GPU_BANDWIDTH:
        raise ValueError(f"gpu must be one of {sorted(GPU_BANDWIDTH)}, got {gpu!r}")
    fig = make_subplots(rows=1, cols=2, column_widths=[0.38, 0.62], horizontal_spacing=0.12,
                        subplot_titles=("bytes per decode step", "step time (attention only)"))
    fmts = list(FORMAT_NAMES)
    fig.add_bar(x=[FORMAT_NAMES[f].replace(" via ", " via<br>") for f in fmts], y=[0] * len(fmts), marker_color=[FORMAT_COLORS[f] for f in fmts],
                textposition="outside", showlegend=False, row=1, col=1)
    for f in fmts:  # fused INT8 / K8V4 read their pages directly; "via FP16 copy" dequantizes first
        fig.add_scatter(x=CONTEXTS, y=[0] * len(CONTEXTS), mode="lines", name=FORMAT_NAMES[f], legendgroup=f,
                        line=dict(color=FORMAT_COLORS[f], dash="dot" if f == "int8_unfused" else "solid"),
                        row=1, col=2)
    for f in fmts:  # a measured point's colour is its format's, as the lines', and so is its shape
        fig.add_scatter(x=[], y=[], mode="markers", name=f"{FORMAT_NAMES[f]} measured", legendgroup=f,
                        row=1, col=2, marker=dict(color=FORMAT_COLORS[f], size=11, symbol=FORMAT_SYMBOLS[f],
                                                  line=dict(width=1, color="black")))
    fig.add_vline(x=context, line=dict(color="black", width=1, dash="dash"), row=1, col=2)  # the chosen context
    fig.update_layout(height=495, legend=dict(orientation="h", y=-0.2, x=0.0), margin=dict(t=115, b=60))
    fig.update_yaxes(title_text="GB", row=1, col=1)
    fig.update_xaxes(tickangle=0, row=1, col=1)
    fig.update_xaxes(title_text="context (tokens per sequence)", type="log", tickvals=CONTEXTS,
                     ticktext=[f"{c // 1024}K" if c >= 1024 else str(c) for c in CONTEXTS], row=1, col=2)
    fig.update_yaxes(title_text="ms per decode step", type="log", dtick=1, row=1, col=2)
    update_bandwidth_figure(fig, shape, batch, context, gpu, bench)
    # built from the finished figure: traces added one by one to a live FigureWidget lose their x (plotly 7)
    return live(fig) if widget else fig


def update_bandwidth_figure(fig, shape: str, batch: int, context: int, gpu: str, bench: dict | None = None) -> dict:
    """Redraw in place; returns the numbers drawn (bytes and projected ms by format at ``context``)."""
    bw = GPU_BANDWIDTH[gpu]
    fmts = list(FORMAT_NAMES)
    at = {f: _bytes(shape, f, batch, context) for f in fmts}
    n = len(fmts)
    with fig.batch_update():
        fig.data[0].y = [at[f] / 1e9 for f in fmts]
        fig.data[0].text = [f"{at[f] / at['fp16']:.0%}" for f in fmts]
        for i, f in enumerate(fmts):
            fig.data[1 + i].y = [1e3 * _bytes(shape, f, batch, c) / bw for c in CONTEXTS]
        for i, f in enumerate(fmts):  # measured points nudged apart along x so the formats do not hide each other
            xs, ys = measured_points(bench, shape, batch, f)
            fig.data[1 + n + i].x, fig.data[1 + n + i].y = [x * NUDGE ** (i - 1.5) for x in xs], ys
        fig.layout.shapes[0].x0 = fig.layout.shapes[0].x1 = context
        batches = sorted({r["batch"] for r in bench["measured"]}) if bench and "measured" in bench else []
        device = ""
        if batches:
            device = (f" · markers: one layer's kernel time x layers, measured on {bench['device']} at batch "
                      f"{', '.join(map(str, batches))}")
            if batch not in batches:
                device += f" (none at batch {batch})"
            else:
                ctxs = measured_points(bench, shape, batch, "fp16")[0]
                where = f"at {', '.join(f'{c // 1024}K' for c in ctxs)} " if ctxs else ""
                device += f"<br>the markers {where}are nudged sideways so that the formats do not hide each other"
        fig.layout.title = dict(text=f"{shape}, batch {batch}, {context:,} tokens per sequence<br><sup>lines: "
                                     f"bytes / {gpu} peak {bw / 1e12:.2f} TB/s (projection){device}</sup>",
                                font=dict(size=14))
    return {f: {"bytes": at[f], "projected_ms": 1e3 * at[f] / bw} for f in fmts}


def bandwidth_widget(shape: str = "llama-3-8b", batch: int = 32, context: int = 16384, gpu: str = "H100",
                     bench: dict | None = None):
    """Sliders for batch and context, dropdowns for the shape and the GPU, over :func:`bandwidth_figure`."""
    import ipywidgets as W  # ipywidgets loads only when a widget is built (a figure needs plotly alone)
    fig = bandwidth_figure(shape, batch, context, gpu, bench, widget=True)
    w_shape = W.Dropdown(options=sorted(SHAPES), value=shape, description="shape")
    w_gpu = W.Dropdown(options=list(GPU_BANDWIDTH), value=gpu, description="GPU")
    w_batch = W.SelectionSlider(options=[1, 2, 4, 8, 16, 32, 64, 128], value=batch, description="batch")
    w_ctx = W.SelectionSlider(options=CONTEXTS, value=context, description="context")
    out = W.HTML()
    def refresh(_=None):
        nums = update_bandwidth_figure(fig, w_shape.value, w_batch.value, w_ctx.value, w_gpu.value, bench)
        f16, i8, kv4, unf = (nums[f] for f in ("fp16", "int8", "k8v4", "int8_unfused"))
        ms = {}  # the measured kernels at exactly this point: the result the lines alone do not show
        for f in COMPARED:
            xs, ys = measured_points(bench, w_shape.value, w_batch.value, f)
            if w_ctx.value in xs:
                ms[f] = ys[xs.index(w_ctx.value)]
        measured = ""
        if len(ms) == 3:
            measured = (f"<br><b>Measured</b> on {bench['device']} at this point: FP16 {ms['fp16']:.2f} ms, INT8 "
                        f"{ms['int8']:.2f} ms (<b>{ms['fp16'] / ms['int8']:.2f}x</b> FP16's speed), K8V4 "
                        f"{ms['k8v4']:.2f} ms ({ms['fp16'] / ms['k8v4']:.2f}x).")
        out.value = (f"FP16 moves <b>{f16['bytes'] / 1e9:,.1f} GB</b> per step: at least "
                     f"<b>{f16['projected_ms']:.2f} ms</b> on {w_gpu.value}. INT8 fused: {i8['projected_ms']:.2f} ms "
                     f"({f16['bytes'] / i8['bytes']:.2f}x fewer bytes); K8V4: {kv4['projected_ms']:.2f} ms; INT8 "
                     f"through a dequantized FP16 copy: {unf['projected_ms']:.2f} ms "
                     f"({unf['bytes'] / f16['bytes']:.1f}x the bytes of FP16).{measured}")
    for c in (w_shape, w_gpu, w_batch, w_ctx):
        c.observe(refresh, names="value")
    refresh()
    return W.VBox([W.HBox([w_shape, w_gpu]), W.HBox([w_batch, w_ctx]), out, view(fig)])
