"""Pictures and widgets. They only READ numbers kvlab computes or counts (sizing, ``stats()``):
the picture and the assertion next to it come from the same numbers.

Widgets are never on the correctness path: the notebooks print and assert verdicts in plain
cells, and mark widget cells as ignored by nbval.
"""

from __future__ import annotations

import plotly.graph_objects as go

from kvlab import sizing

CONTEXTS = [2**k for k in range(7, 18)]  # 128 ... 131072 tokens
COLORS = {"weights": "#7f8c8d", "kv": "#c0392b", "tokens": "#27ae60", "padding": "#f39c12", "empty": "#d5d8dc"}


def _memory_wall_traces(model: str, batch: int, kv_dtype: str, weight_dtype: str):
    w = sizing.weight_bytes(model, weight_dtype)
    kv = [sizing.kv_size(model, kv_dtype, tokens=c, batch=batch).total_bytes for c in CONTEXTS]
    gib = 2**30
    return [w / gib] * len(CONTEXTS), [k / gib for k in kv]


def memory_wall_figure(model: str = "llama-2-7b", batch: int = 1, kv_dtype: str = "fp16",
                       weight_dtype: str = "fp16", widget: bool = False):
    """Bytes one decode step reads (weights once + every sequence's whole KV cache) vs context."""
    w, kv = _memory_wall_traces(model, batch, kv_dtype, weight_dtype)
    fig_cls = go.FigureWidget if widget else go.Figure
    fig = fig_cls(
        data=[
            go.Scatter(x=CONTEXTS, y=w, name="weights", stackgroup="one", line_color=COLORS["weights"]),
            go.Scatter(x=CONTEXTS, y=kv, name="KV cache", stackgroup="one", line_color=COLORS["kv"]),
        ],
        layout=dict(
            title=f"Bytes read per decode step: {model}, batch {batch}, KV {kv_dtype}, weights {weight_dtype}",
            xaxis=dict(title="context (tokens per sequence)", type="log"),
            yaxis=dict(title="GiB read per step"), height=420, legend=dict(x=0.02, y=0.98),
        ),
    )
    return fig


def memory_wall_widget(model: str = "llama-2-7b"):
    """Model / batch / dtype controls over :func:`memory_wall_figure`, plus the time floor at a bandwidth."""
    import ipywidgets as W

    fig = memory_wall_figure(model, widget=True)
    w_model = W.Dropdown(options=sorted(sizing.PRESETS), value=model, description="model")
    w_ctx = W.SelectionSlider(options=CONTEXTS, value=4096, description="context")
    w_batch = W.IntSlider(value=1, min=1, max=64, description="batch")
    w_kv = W.Dropdown(options=["fp32", "fp16", "fp8", "int8", "int4"], value="fp16", description="KV dtype")
    w_wt = W.Dropdown(options=["fp32", "fp16", "int8", "int4"], value="fp16", description="weights")
    w_bw = W.FloatSlider(value=2.0, min=0.05, max=8.0, step=0.05, description="TB/s")
    out = W.HTML()

    def refresh(_=None):
        w, kv = _memory_wall_traces(w_model.value, w_batch.value, w_kv.value, w_wt.value)
        with fig.batch_update():
            fig.data[0].y, fig.data[1].y = w, kv
            fig.layout.title.text = (f"Bytes read per decode step: {w_model.value}, batch {w_batch.value}, "
                                     f"KV {w_kv.value}, weights {w_wt.value}")
        step = sizing.decode_step_bytes(w_model.value, w_ctx.value, w_batch.value, w_kv.value, w_wt.value)
        ms = step["total"] / (w_bw.value * 1e12) * 1e3
        cross = sizing.crossover_context(w_model.value, w_batch.value, w_kv.value, w_wt.value)
        out.value = (
            f"<b>{sizing.fmt_bytes(step['total'])}</b> per step at {w_ctx.value:,} tokens "
            f"(KV {step['kv'] / step['total']:.0%}) &rarr; at least <b>{ms:.2f} ms</b> per step at "
            f"{w_bw.value:.2f} TB/s, so at most {w_batch.value / ms * 1e3:,.0f} tokens/s. "
            f"The KV cache outweighs the weights beyond {cross:,} tokens per sequence."
        )

    for c in (w_model, w_ctx, w_batch, w_kv, w_wt, w_bw):
        c.observe(refresh, names="value")
    refresh()
    return W.VBox([W.HBox([w_model, w_kv, w_wt]), W.HBox([w_ctx, w_batch, w_bw]), out, fig])


def static_cache_figure(named_stats: dict[str, dict]):
    """Stacked bars of where a static cache's reserved slots went (one bar per configuration)."""
    names = list(named_stats)
    parts = [("tokens_stored", "tokens", COLORS["tokens"]), ("padding_slots", "padding", COLORS["padding"]),
             ("empty_slots", "reserved, never written", COLORS["empty"])]
    fig = go.Figure()
    for key, label, color in parts:
        fig.add_bar(x=names, y=[100 * s[key] / s["slots_reserved"] for s in named_stats.values()],
                    name=label, marker_color=color)
    fig.update_layout(barmode="stack", yaxis_title="% of reserved slots", height=380,
                      title="Static pre-allocation: where the reserved KV memory goes")
    return fig


def speedup_figure(rows: list[dict]):
    """Recompute vs cache: seconds for each and the speed-up, per prompt length."""
    x = [r["prompt_tokens"] for r in rows]
    fig = go.Figure()
    fig.add_bar(x=x, y=[r["no_cache_s"] for r in rows], name="no cache (recompute)", marker_color=COLORS["kv"])
    fig.add_bar(x=x, y=[r["cache_s"] for r in rows], name="KV cache", marker_color=COLORS["tokens"],
                text=[f"{r['speedup']:.1f}x" for r in rows], textposition="outside")
    fig.update_layout(barmode="group", xaxis=dict(title="prompt tokens", type="category"),
                      yaxis_title=f"seconds for {rows[0]['new_tokens']} new tokens", height=380)
    return fig
