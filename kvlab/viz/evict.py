"""Notebook 07's figures: which blocks each eviction policy keeps, quality against bytes, the fleet."""

from __future__ import annotations

import math

import plotly.graph_objects as go
from plotly.subplots import make_subplots

from kvlab.viz import COLORS
from kvlab.viz.render import live, view

POLICY_COLORS = {"window": "#8e44ad", "sinks+window": "#2980b9", "h2o": "#d35400", "snapkv": "#16a085"}
# diamonds in colours no policy line uses (green and red sat too close to snapkv and h2o)
FORMAT_COLORS = {"int8": "#17202a", "k8v4": "#f1c40f", "int4": "#95a5a6", "fp16": COLORS["weights"]}


def _grid(runs_at_budget: dict, budget: int, prompt_tokens: int | None = None):
    names = list(runs_at_budget)
    n = max(r["num_blocks"] for r in runs_at_budget.values())
    z, text = [], []
    for name in names:
        r = runs_at_budget[name]
        kept = set(r["kept"])
        z.append([2 if b == r["num_blocks"] - 1 else 1 if b in kept else 0 for b in range(n)])
        text.append([f"{name}, block {b} (positions {16 * b}-{16 * b + 15}"
                     + (f"; the prompt ends at {prompt_tokens - 1}, the answer starts in this block"
                        if prompt_tokens is not None and b == (prompt_tokens - 1) // 16 and prompt_tokens % 16 else "")
                     + "): "
                     + ("the newest block, kept (it holds the latest token)" if b == r["num_blocks"] - 1
                        else "kept" if b in kept else "dropped, back in the pool")
                     + (f", score {r['scores'][b]:.1f}" if r["scores"] and b < len(r["scores"]) else "")
                     for b in range(n)])
    return names, z, text


def _spans(marks: dict) -> list[tuple[int, int, str]]:
    """Runs of consecutive marked blocks with the same label: (first, last, label)."""
    out = []
    for b in sorted(marks):
        if out and out[-1][1] == b - 1 and out[-1][2] == marks[b]:
            out[-1] = (out[-1][0], b, marks[b])
        else:
            out.append((b, b, marks[b]))
    return out


def eviction_explorer(runs: dict, marks: dict | None = None, prompt_tokens: int | None = None, block_size: int = 16,
                      start: int | None = None):
    """A budget slider over :func:`kvlab.eval.kept_blocks`' runs: per policy, each logical block kept or
    dropped; ``marks`` labels blocks above the grid (e.g. where the pass key sits)."""
    import ipywidgets as W  # ipywidgets loads only when a widget is built
    budgets = sorted(runs)
    if start is not None and start not in budgets:
        raise ValueError(f"start: {start!r} is not one of the budgets run, {budgets}")
    names, z, text = _grid(runs[budgets[0]], budgets[0], prompt_tokens)
    colorscale = [[0, COLORS["empty"]], [0.33, COLORS["empty"]], [0.34, COLORS["tokens"]], [0.66, COLORS["tokens"]],
                  [0.67, COLORS["padding"]], [1, COLORS["padding"]]]
    fig = go.Figure(go.Heatmap(z=z, y=names, text=text, hoverinfo="text", zmin=0, zmax=2,
                                     colorscale=colorscale, showscale=False, xgap=1, ygap=3))
    # a widget in a box does not stretch its figure (the default 700 px squeezes 35 blocks): set the width
    n = len(z[0])
    fig.update_layout(height=415, width=980, margin=dict(t=125, b=90, l=110, r=20), font=dict(size=13),
                      xaxis=dict(title="logical block (16 tokens each)", range=[-0.5, n - 0.5]),
                      yaxis_autorange="reversed", showlegend=True,
                      legend=dict(orientation="h", x=0, y=-0.22, yanchor="top"))
    for label, colour in (("kept", COLORS["tokens"]), ("dropped (back in the pool)", COLORS["empty"]),
                          ("the newest block (kept: it holds the latest token)", COLORS["padding"])):
        fig.add_scatter(x=[None], y=[None], mode="markers", name=label, hoverinfo="skip",
                        marker=dict(symbol="square", size=13, color=colour, line=dict(width=1, color="#7f8c8d")))
    for first, last, label in _spans(marks or {}):
        fig.add_vrect(x0=first - 0.5, x1=last + 0.5, line_width=1.5, line_color="black", fillcolor="rgba(0,0,0,0)")
        fig.add_annotation(x=(first + last) / 2, y=1.0, yref="paper", yanchor="bottom", text=label, showarrow=False,
                           font=dict(size=13))
    if prompt_tokens is not None:
        edge = prompt_tokens / block_size - 0.5  # the boundary between the prompt's last token and the answer's first
        fig.add_vline(x=edge, line_dash="dash", line_color="black")
        fig.add_annotation(x=edge, y=1.0, yref="paper", yanchor="bottom", text="prompt ends here ", showarrow=False,
                           xanchor="right", font=dict(size=13))  # right-aligned: centred, it ran off the plot
    fig = live(fig)
    slider = W.SelectionSlider(options=budgets, value=budgets[0] if start is None else start,
                               description="budget (tokens)",
                               style={"description_width": "initial"}, layout=W.Layout(width="460px"))
    def refresh(_=None):
        at = runs[slider.value]
        _, z, text = _grid(at, slider.value, prompt_tokens)
        kept = {n: len(r["kept"]) for n, r in at.items()}
        with fig.batch_update():
            fig.data[0].z, fig.data[0].text = z, text
            fig.layout.title = (f"Budget {slider.value} tokens: blocks kept per policy after {next(iter(at.values()))['tokens']} "
                                f"tokens<br><sup>blocks kept: "
                                + ", ".join(f"{n} {k}" for n, k in kept.items()) + " blocks"
                                + (f"<br>boxed ({marks[next(iter(marks))]}) blocks kept: " + ", ".join(
                                    f"{n} {sum(b in r['kept'] for b in marks)}/{len(marks)}" for n, r in at.items())
                                   if marks else "") + "</sup>")
    slider.observe(refresh, names="value")
    refresh()
    return W.VBox([slider, view(fig)])


def quantize_or_evict_figure(q: dict):
    """Next-token KL against bytes held (share of FP16): a marker per format, a line per eviction policy."""
    cs = q["result"]["configs"]
    fig = go.Figure()
    policies = sorted({c["policy"] for c in cs.values() if c["policy"]})
    for p in policies:
        pts = sorted((c["bytes_share"], c["kl"], n) for n, c in cs.items() if c["policy"] == p)
        alone = len(pts) == 1  # a policy with one usable budget (SnapKV here) gets its name beside the point
        fig.add_scatter(x=[a for a, _, _ in pts], y=[b for _, b, _ in pts], mode="markers+text" if alone else "lines+markers",
                        name=p, line_color=POLICY_COLORS.get(p), marker_color=POLICY_COLORS.get(p),
                        customdata=[n for *_, n in pts], text=[n for *_, n in pts] if alone else None,
                        textposition="middle left",
                        hovertemplate="%{customdata}: %{x:.0%} of the bytes, KL %{y:.4f}<extra></extra>")
    for v in q["verdicts"]:
        c = cs[v["format"]]
        fig.add_scatter(x=[c["bytes_share"]], y=[c["kl"]], mode="markers+text", name=f"{v['format']} (every token kept)",
                        marker=dict(symbol="diamond", size=13, color=FORMAT_COLORS.get(v["format"])),
                        text=[v["format"]], textposition="bottom center",
                        hovertemplate=f"{v['format']}: %{{x:.0%}} of the bytes, KL %{{y:.4f}}<extra></extra>")
        fig.add_annotation(x=c["bytes_share"], y=1.0, yref="paper", yanchor="bottom", showarrow=False,
                           text=f"<b>{v['verdict']}</b>" + (f" ({v['factor']:.1f}x)" if v.get("factor") else ""),
                           font=dict(size=12))
    shares = sorted({round(c["bytes_share"], 3) for c in cs.values()})  # a tick where something was measured
    fig.update_layout(height=450, title=dict(text="Quantize or evict? Quality against the bytes held (SmolLM2, one "
                                                  "held-out text)<br><sup>above each format: the computed verdict "
                                                  "and the ratio: the best policy's KL / the format's KL</sup>", y=0.96),
                      xaxis=dict(title="bytes the cache holds at the end of the text (share of the full FP16 cache)",
                                 tickvals=shares, ticktext=[f"{x:.0%}" for x in shares]),  # as the table rounds
                      yaxis=dict(title="next-token KL vs the full FP32 cache (log; lower is better)", type="log", dtick=1),
                      legend=dict(orientation="h", y=-0.25), margin=dict(t=100, b=40))
    return fig


def fleet_figure(rows: list[dict]):
    """Prefix hit rate, TTFT p50 and p99 against replicas, a marker per router (they coincide at one)."""
    fig = make_subplots(rows=1, cols=3, horizontal_spacing=0.08,
                        subplot_titles=("prefix hit rate (blocks found cached)", "TTFT p50, simulated (s)",
                                        "TTFT p99, simulated (s)"))
    colors = dict(zip(("round-robin", "least-loaded", "prefix-affinity"), ("#7f8c8d", "#2980b9", "#27ae60")))
    symbols = dict(zip(("round-robin", "least-loaded", "prefix-affinity"), ("square-open", "circle", "diamond")))
    for router in dict.fromkeys(r["router"] for r in rows):
        rs = [r for r in rows if r["router"] == router]
        for col, key, what in ((1, "prefix_hit_rate", "hit rate"), (2, "ttft_p50_s", "TTFT p50"), (3, "ttft_p99_s", "TTFT p99")):
            fig.add_scatter(x=[r["replicas"] for r in rs], y=[r[key] for r in rs], mode="lines+markers", name=router,
                            legendgroup=router, line=dict(color=colors.get(router)),
                            marker=dict(symbol=symbols.get(router, "circle"), size=9 if router == "round-robin" else 7),
                            showlegend=col == 1, row=1, col=col,
                            hovertemplate=f"{router}, {what}: %{{y:.3~g}}<extra>%{{x}} replicas</extra>")
    fig.update_xaxes(title_text="replicas (log scale)", type="log", tickvals=sorted({r["replicas"] for r in rows}))
    fig.update_yaxes(title_text="prefix hit rate", tickformat=".0%", rangemode="tozero", row=1, col=1)
    ttft = [r[k] for r in rows for k in ("ttft_p99_s", "ttft_p50_s") if r[k] > 0]
    ticks = [m * 10.0 ** e for e in range(-3, 4) for m in (1, 2, 5)]
    ticks = [t for t in ticks if min(ttft, default=1) / 2 <= t <= max(ttft, default=1) * 2]
    lo, hi = math.log10(min(ttft, default=1) / 1.5), math.log10(max(ttft, default=1) * 1.5)
    for col in (2, 3):  # one log scale for both TTFT panels, so p50 and p99 compare by height
        fig.update_yaxes(title_text="time to first token (s)", type="log", tickvals=ticks,
                         ticktext=[f"{t:g}" for t in ticks], range=[lo, hi], row=1, col=col)  # 1-2-5 ticks
    fig.update_layout(height=380, legend=dict(orientation="h", y=-0.25), margin=dict(t=60, b=40))
    return fig
