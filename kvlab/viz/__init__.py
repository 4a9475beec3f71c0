"""Pictures and widgets. They only READ numbers kvlab computes or counts, so a picture and the assertion
next to it come from the same numbers; widgets are never on the correctness path (nbval ignores them).
"""

from __future__ import annotations

import math

import plotly.graph_objects as go

from kvlab import sizing
from kvlab.formats import ELEMENT_FORMATS, KV_CACHE_DTYPES
from kvlab.viz.render import live, table, view

CONTEXTS = [2**k for k in range(7, 18)]  # 128 ... 131072 tokens
COLORS = {"weights": "#7f8c8d", "kv": "#c0392b", "tokens": "#27ae60", "padding": "#f39c12", "empty": "#d5d8dc"}


def _contexts(model: str) -> list[int]:
    """Powers of two from 128 up to the model's maximum context (its maximum itself included)."""
    top = sizing.kv_config(model).max_position or CONTEXTS[-1]
    return [c for c in CONTEXTS if c < top] + [top]


def _dense_contexts(model: str, per_octave: int = 12) -> list[int]:
    """Contexts even on the log axis: through powers of two alone a line shows kinks the arithmetic lacks."""
    marks = _contexts(model)
    lo, hi = marks[0], marks[-1]
    n = max(2, round(per_octave * math.log2(hi / lo)))
    return sorted({round(lo * (hi / lo) ** (i / n)) for i in range(n + 1)} | set(marks))


def _memory_wall_traces(model: str, batch: int, kv_cache_dtype: str, weight_dtype: str):
    xs = _dense_contexts(model)
    w = sizing.weight_read_bytes(model, batch, weight_dtype)
    kv = [sizing.kv_size(model, kv_cache_dtype, tokens=c, batch=batch).total_bytes for c in xs]
    return xs, [w / 2**30] * len(xs), [k / 2**30 for k in kv]


def _memory_wall_marks(model: str, context: int, batch: int, kv_cache_dtype: str, weight_dtype: str) -> dict:
    """The chosen context as a point, and the crossover (KV > weights) as a line, else in a note."""
    top = _contexts(model)[-1]
    step = sizing.decode_step_bytes(model, min(context, top), batch, kv_cache_dtype, weight_dtype)
    cross = sizing.crossover_context(model, batch, kv_cache_dtype, weight_dtype)
    shapes = [dict(type="line", xref="x", yref="paper", x0=min(context, top), x1=min(context, top), y0=0, y1=1,
                   line=dict(color="black", width=1, dash="dash"))]
    notes = [dict(x=math.log10(min(context, top)), y=1, xref="x", yref="paper", yanchor="bottom", showarrow=False,
                  text=f"{min(context, top):,} tokens", font=dict(size=11))]
    if cross <= top:
        shapes.append(dict(type="line", xref="x", yref="paper", x0=cross, x1=cross, y0=0, y1=1,
                           line=dict(color=COLORS["kv"], width=2, dash="dot")))
        # named in the subtitle: a label beside the line would cross the context line when the two are close
        where = f"red dotted line: KV > weights from {cross:,} tokens"
    else:
        where = f"KV would outweigh the weights only beyond {cross:,} tokens, past this model's {top:,}-token context"
    return dict(step=step, cross=cross, top=top, shapes=shapes, annotations=notes, where=where,
                point=(min(context, top), step["total"] / 2**30))


def _memory_wall_title(model, batch, kv_cache_dtype, weight_dtype, where: str = "") -> dict:
    return dict(text=f"Bytes read per decode step: {model}, batch {batch}, KV {kv_cache_dtype}, weights {weight_dtype}"
                     + (f"<br><sup>{where}</sup>" if where else ""))


def _context_ticks(xs: list[int]) -> dict:
    """Ticks at the plotted contexts, the range ending at the maximum (plotly pads a log axis an octave)."""
    labels = [f"{c // 1024}K" if c >= 1024 and c % 1024 == 0 else f"{c:,}" for c in xs]
    return dict(tickvals=xs, ticktext=labels, range=[math.log10(xs[0]), math.log10(xs[-1])])


def memory_wall_figure(model: str = "llama-2-7b", batch: int = 1, kv_cache_dtype: str = "fp16",
                       weight_dtype: str = "fp16", widget: bool = False, context: int = 4096):
    """Bytes one decode step reads (weights once + every sequence's KV cache) vs context (notebook 00)."""
    xs, w, kv = _memory_wall_traces(model, batch, kv_cache_dtype, weight_dtype)
    m = _memory_wall_marks(model, context, batch, kv_cache_dtype, weight_dtype)
    fig = go.Figure(
        data=[go.Scatter(x=xs, y=w, name="weights", stackgroup="one", line_color=COLORS["weights"]),
              go.Scatter(x=xs, y=kv, name="KV cache (all sequences)", stackgroup="one", line_color=COLORS["kv"]),
              go.Scatter(x=[m["point"][0]], y=[m["point"][1]], name="this context: total", mode="markers",
                         marker=dict(color="black", size=10), cliponaxis=False)],
        layout=dict(title=_memory_wall_title(model, batch, kv_cache_dtype, weight_dtype, m["where"]),
                    xaxis=dict(title="context (tokens per sequence, log scale)", type="log",
                               **_context_ticks(_contexts(model))),
                    yaxis=dict(title="GiB read per step", rangemode="tozero"), height=460,
                    legend=dict(orientation="h", y=-0.25), shapes=m["shapes"], annotations=m["annotations"],
                    margin=dict(t=80)))
    return live(fig) if widget else fig


def memory_wall_widget(model: str = "llama-2-7b"):
    """Controls over :func:`memory_wall_figure`, plus the time floor at a bandwidth."""
    import ipywidgets as W  # ipywidgets loads only when a widget is built (a figure needs plotly alone)
    fig = memory_wall_figure(model, batch=8, widget=True, context=2048)
    w_model = W.Dropdown(options=sorted(sizing.PRESETS), value=model, description="model")
    w_ctx = W.SelectionSlider(options=_contexts(model), value=min(2048, _contexts(model)[-1]), description="context")
    w_batch = W.IntSlider(value=8, min=1, max=64, description="batch")  # 8: the crossover is on the plot
    one_format = sorted((f for n, (k, v) in KV_CACHE_DTYPES.items() if k == v for f in [ELEMENT_FORMATS[k]]),
                        key=lambda f: (-f.bits, f.name))  # fp32, fp16, fp8, int8, int4: widest first
    w_kv = W.Dropdown(options=[f.name for f in one_format], value="fp16", description="KV dtype")
    w_wt = W.Dropdown(options=["fp32", "fp16", "int8", "int4"], value="fp16", description="weights")
    w_bw = W.FloatSlider(value=2.0, min=0.05, max=8.0, step=0.05, description="TB/s")
    out = W.HTML()
    def refresh(_=None):
        xs, w, kv = _memory_wall_traces(w_model.value, w_batch.value, w_kv.value, w_wt.value)
        m = _memory_wall_marks(w_model.value, w_ctx.value, w_batch.value, w_kv.value, w_wt.value)
        with fig.batch_update():
            fig.data[0].x, fig.data[0].y = xs, w
            fig.data[1].x, fig.data[1].y = xs, kv
            fig.data[2].x, fig.data[2].y = [m["point"][0]], [m["point"][1]]
            fig.layout.shapes, fig.layout.annotations = m["shapes"], m["annotations"]
            fig.layout.xaxis.update(**_context_ticks(_contexts(w_model.value)))
            fig.layout.title.text = _memory_wall_title(w_model.value, w_batch.value, w_kv.value, w_wt.value,
                                                       m["where"])["text"]
        step = m["step"]
        ms = step["total"] / (w_bw.value * 1e12) * 1e3
        where = (f"The KV cache outweighs the weights beyond {m['cross']:,} tokens per sequence."
                 if m["cross"] <= m["top"] else
                 f"The KV cache would outweigh the weights only beyond {m['cross']:,} tokens per sequence, "
                 f"longer than this model's {m['top']:,}-token context: at this batch the weights always dominate.")
        out.value = (f"<b>{sizing.fmt_bytes(step['total'])}</b> per step at {w_ctx.value:,} tokens "
                     f"(KV {step['kv'] / step['total']:.0%}) &rarr; at least <b>{ms:.2f} ms</b> per step at "
                     f"{w_bw.value:.2f} TB/s, so at most {w_batch.value / ms * 1e3:,.0f} tokens/s for the whole "
                     f"batch ({1e3 / ms:,.0f} per sequence). " + where)
    def model_changed(_=None):
        options = _contexts(w_model.value)
        value = max(c for c in options if c <= w_ctx.value) if w_ctx.value >= options[0] else options[0]
        w_ctx.unobserve(refresh, names="value")
        w_ctx.options = options  # resets the value: put it back, capped at this model's maximum
        w_ctx.value = value
        w_ctx.observe(refresh, names="value")
        refresh()
    w_model.observe(model_changed, names="value")
    for c in (w_ctx, w_batch, w_kv, w_wt, w_bw):
        c.observe(refresh, names="value")
    refresh()
    return W.VBox([W.HBox([w_model, w_kv, w_wt]), W.HBox([w_ctx, w_batch, w_bw]), out, view(fig)])


def static_cache_figure(named_stats: dict[str, dict]):
    """Stacked bars of where a static cache's reserved slots went (one bar per configuration)."""
    parts = [("tokens_stored", "tokens", COLORS["tokens"]), ("padding_slots", "padding", COLORS["padding"]),
             ("empty_slots", "empty (reserved, never written)", COLORS["empty"])]
    # every share in the bar's label too: thin segments have no room for their number
    names = [f"<b>{n}</b><br>{sizing.fmt_bytes(s['bytes_reserved'])} reserved<br>"
             + " · ".join(f"{label.split(' ')[0]} {100 * s[key] / s['slots_reserved']:.1f}%" for key, label, _ in parts)
             for n, s in named_stats.items()]
    fig = go.Figure()
    for key, label, color in parts:
        share = [100 * s[key] / s["slots_reserved"] for s in named_stats.values()]
        fig.add_bar(x=names, y=share, name=label, marker_color=color,
                    text=[f"{v:.1f}%" if v >= 6 else "" for v in share], textposition="inside")  # smaller: no room
    fig.update_layout(barmode="stack", yaxis=dict(title="% of reserved slots", range=[0, 100]), height=460,
                      xaxis=dict(title="reservation policy (same four requests)", tickfont=dict(size=13)),
                      title="Static pre-allocation: where the reserved KV memory goes")
    return fig


def speedup_figure(rows: list[dict]):
    """Recompute vs cache: seconds for each and the speed-up, per prompt length."""
    x = [r["prompt_tokens"] for r in rows]
    fig = go.Figure()
    # the speed-up above the taller bar of each pair, where nothing else is drawn
    fig.add_bar(x=x, y=[r["no_cache_s"] for r in rows], name="no cache (recompute)", marker_color=COLORS["kv"],
                text=[f"cache {r['speedup']:.1f}x faster" for r in rows], textposition="outside", cliponaxis=False)
    fig.add_bar(x=x, y=[r["cache_s"] for r in rows], name="KV cache", marker_color=COLORS["tokens"])
    fig.update_layout(barmode="group", xaxis=dict(title="prompt tokens", type="category"),
                      yaxis_title=f"seconds to generate {rows[0]['new_tokens']} tokens (prefill included)", height=400,
                      title=f"Recompute vs KV cache: {rows[0]['new_tokens']} new tokens after prompts of each length",
                      yaxis_range=[0, 1.15 * max(r["no_cache_s"] for r in rows)], legend=dict(x=0.02, y=0.98))
    return fig
