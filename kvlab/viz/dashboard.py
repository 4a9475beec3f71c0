"""One dashboard for a running engine (notebook 06): pool, queues, bytes read per step and saturation per
layer x head. It only reads an :class:`~kvlab.viz.engine.EngineRecorder`'s frames; a slider replays them.
"""

from __future__ import annotations

import html

import plotly.graph_objects as go
import torch
from plotly.subplots import make_subplots

from kvlab.capstone import CONFIGS, quantized
from kvlab.viz import COLORS
from kvlab.viz.render import live, view
from kvlab.viz.engine import EngineRecorder, frame_html
from kvlab.viz.paged import block_table_figure, redraw_grid

WIDTH = 1000  # px: a widget in a box does not stretch its figures; fits a laptop screen beside the file browser
CONFIG_COLORS = ["#7f8c8d", "#2980b9", "#27ae60", "#16a085"]  # the capstone configurations' colours


def _bytes_per_token(cache) -> float:
    return cache.bytes_per_block / cache.block_size


def _clipped(cache):
    """(L, 2H) clipped-value counts, K heads then V heads, or None for a float pool."""
    if not quantized(cache):
        return None
    sat = cache.saturation()
    return torch.cat([sat["k"]["clipped"], sat["v"]["clipped"]], dim=1).tolist()


class Dashboard:
    """The widget and its per-frame numbers. ``Dashboard(llm).widget`` is what a notebook displays."""

    def __init__(self, llm, columns: int = 32, title: str = ""):
        import ipywidgets as W  # ipywidgets loads only when a widget is built (a figure needs plotly alone)
        self.llm, self.columns, self.title = llm, columns, title
        self.recorder = EngineRecorder(llm)
        self.kv_read: list[float] = []  # per frame: bytes the step's decodes read
        self.clipped: list = []  # per frame: (L, 2H) counts, or None
        if not self.recorder.frames:
            self.recorder.capture()
        for i in range(len(self.recorder.frames)):
            self._note(i)
        frame = self.recorder.frames[-1]
        self.pool = block_table_figure(frame["pool"], columns, widget=True)
        self.pool.update_layout(width=WIDTH, title="the block pool: colour = request, dark = shared by several, "
                                      "grey = cached (freed, reusable), white = free")
        self.chart = live(self._figure())
        self.info = W.HTML()
        self.play = W.Play(min=0, max=0, value=0, interval=400, description="play")
        self.step = W.IntSlider(min=0, max=0, value=0, description="frame")
        W.jslink((self.play, "value"), (self.step, "value"))
        self.step.observe(lambda change: self.draw(change["new"]), names="value")
        self.recorder.listeners.append(self._follow)
        self.widget = W.VBox([W.HTML(f"<b>{html.escape(title)}</b>") if title else W.HTML(),
                              W.HBox([self.play, self.step]), self.info, view(self.chart),
                              view(self.pool)])
        self.widget.dashboard = self
        self._sync_range()
        self.draw(len(self.recorder.frames) - 1)

    # ---- numbers per frame ------------------------------------------------------------------------

    def _note(self, index: int) -> None:
        frame = self.recorder.frames[index]
        ctx = sum(s["total"] for s in frame["scheduled"] if s["kind"] == "decode")  # tokens read by decodes
        value = ctx * _bytes_per_token(self.llm.cache)
        clipped = _clipped(self.llm.cache)
        if index < len(self.kv_read):
            self.kv_read[index], self.clipped[index] = value, clipped
        else:
            self.kv_read.append(value)
            self.clipped.append(clipped)

    def _series(self):
        frames = self.recorder.frames
        x = list(range(len(frames)))
        return (x, [len(f["running"]) for f in frames], [len(f["waiting"]) for f in frames],
                [b / 2**20 for b in self.kv_read])

    # ---- drawing ----------------------------------------------------------------------------------

    def _figure(self) -> go.Figure:
        x, running, waiting, mib = self._series()
        fig = make_subplots(rows=1, cols=3, column_widths=[0.36, 0.34, 0.30], horizontal_spacing=0.1,
                            subplot_titles=("requests running / waiting", "KV read by the step's decodes",
                                            "values clipped so far"))
        fig.add_trace(go.Scatter(x=x, y=running, name="running", line_color=COLORS["tokens"]), 1, 1)
        fig.add_trace(go.Scatter(x=x, y=waiting, name="waiting", line_color=COLORS["padding"]), 1, 1)
        fig.add_trace(go.Bar(x=x, y=mib, name="KV read", marker_color=COLORS["kv"]), 1, 2)
        this_frame = dict(mode="markers", marker=dict(size=11, color="#1b2631", symbol="diamond"))
        fig.add_trace(go.Scatter(x=[x[-1]], y=[running[-1]], name="this frame", **this_frame), 1, 1)
        fig.add_trace(go.Scatter(x=[x[-1]], y=[mib[-1]], showlegend=False, **this_frame), 1, 2)
        z = self.clipped[-1]
        if z is None:
            fig.add_trace(go.Heatmap(z=[[0]], showscale=False, colorscale="Greys"), 1, 3)
            fig.add_annotation(text="float pool: no scales, nothing clips", showarrow=False, row=1, col=3,
                               x=0, y=0)
        else:
            h = len(z[0]) // 2  # KV heads: K's first, then V's
            fig.add_trace(go.Heatmap(z=z, colorscale="Reds", zmin=0, colorbar=dict(title=dict(text="clipped", side="right"), x=1.01, thickness=12)), 1, 3)
            fig.update_xaxes(tickvals=list(range(2 * h)), ticktext=[f"K{i}" for i in range(h)] + [f"V{i}" for i in range(h)],
                             row=1, col=3)
            fig.add_vline(x=h - 0.5, line_color="#1b2631", line_width=2, row=1, col=3)
        for col, x, y in ((1, "frame (one per engine step)", "requests"), (2, "frame", "MiB per step"),
                          (3, "KV head (K, then V)", "layer")):
            fig.update_xaxes(title_text=x, row=1, col=col)
            fig.update_yaxes(title_text=y, row=1, col=col, **({"rangemode": "tozero"} if col < 3 else {}))
        # room on the right for the colour bar and its title, and below for the legend under the axis titles
        fig.update_layout(height=400, width=WIDTH, margin=dict(l=50, r=90, t=50, b=95),
                          legend=dict(orientation="h", y=-0.3))
        return fig

    def draw(self, index: int) -> None:
        frames = self.recorder.frames
        index = max(0, min(index, len(frames) - 1))
        frame = frames[index]
        x, running, waiting, mib = self._series()
        redraw_grid(self.pool, frame["pool"], self.columns)
        with self.chart.batch_update():
            self.chart.data[0].x, self.chart.data[0].y = x, running
            self.chart.data[1].x, self.chart.data[1].y = x, waiting
            self.chart.data[2].x, self.chart.data[2].y = x, mib
            self.chart.data[3].x, self.chart.data[3].y = [index], [running[index]]
            self.chart.data[4].x, self.chart.data[4].y = [index], [mib[index]]
            if self.clipped[index] is not None:
                self.chart.data[5].z = self.clipped[index]
        sat = ("" if self.clipped[index] is None
               else f" · clipped values so far: <b>{sum(map(sum, self.clipped[index])):,}</b>")
        self.info.value = (f"frame {index}: KV read by this step's decodes <b>{mib[index]:.2f} MiB</b> "
                           f"({_bytes_per_token(self.llm.cache):,.0f} B per token){sat}<br>" + frame_html(frame))

    def busiest(self) -> int:
        """The frame with the most requests running (the first of them): a good one to look at."""
        running = [len(f["running"]) for f in self.recorder.frames]
        return running.index(max(running))

    def _sync_range(self) -> None:
        last = len(self.recorder.frames) - 1
        self.play.max = self.step.max = last

    def _follow(self, index: int, new: bool) -> None:
        self._note(index)
        self._sync_range()
        if new and self.step.value != index:
            self.step.value = index  # redraws through the observer
        elif self.step.value == index:
            self.draw(index)


def engine_dashboard(llm, columns: int = 32, title: str = ""):
    """Display this, then run the engine: it follows every step. ``widget.dashboard`` holds the numbers."""
    return Dashboard(llm, columns, title).widget


def comparison_figure(rows: dict[str, dict], title: str = "", modelled: tuple[str, ...] = ("static FP16",),
                      bounds: dict[str, int] | None = None):
    """Configurations side by side: requests held, tokens/s, KV KiB read per token. ``modelled`` bars are
    hatched: the static cache's read is computed from its slab, not counted by the engine."""
    names = [n for n in CONFIGS if n in rows]
    colors = CONFIG_COLORS[:len(names)]
    fig = make_subplots(rows=1, cols=3, subplot_titles=("requests held at once (where the budget limits)", "output tokens / s",
                                                        "KV KiB read per generated token"))
    for col, key, scale, fmt in ((1, "held_at_limit", 1, "{:.1f}"), (2, "output_tok_s", 1, "{:.0f}"),
                                 (3, "kv_read_per_token", 2**-10, "{:,.0f}")):
        hatched = [col == 3 and n in modelled for n in names]
        fig.add_trace(go.Bar(x=names, y=[rows[n][key] * scale for n in names], showlegend=False,
                             marker=dict(color=colors, pattern=dict(shape=["/" if h else "" for h in hatched])),
                             text=[fmt.format(rows[n][key] * scale) + (" (modelled)" if h else "")
                                   for n, h in zip(names, hatched)], cliponaxis=False,
                             textposition="inside" if col == 1 and bounds else "outside"), 1, col)  # not under a bound
    if bounds:
        shown = [n for n in names if n in bounds]
        fig.add_trace(go.Scatter(x=shown, y=[bounds[n] for n in shown], mode="markers", name="bound (section 1)",
                                 marker=dict(symbol="line-ew-open", size=34, color="black", line=dict(width=3, color="black")),
                                 hovertemplate="to-completion bound: %{y}<extra></extra>"), 1, 1)
        fig.update_layout(legend=dict(orientation="h", y=-0.25, x=0))
    fig.update_yaxes(rangemode="tozero")
    for col, label in ((1, "requests"), (2, "tokens / s"), (3, "KiB")):
        fig.update_yaxes(title_text=label, row=1, col=col)
    fig.update_layout(height=420, margin=dict(t=100), title=title)
    return fig


def held_figure(rows: dict[str, dict], title: str = ""):
    """Requests holding KV memory per step, per configuration; thick markers where the budget turned one
    away, whose average (dotted) is the table's "held"."""
    names = [n for n in CONFIGS if n in rows and "running" in rows[n]]
    colors = dict(zip(CONFIGS, CONFIG_COLORS))
    fig = go.Figure()
    for n in names:
        r = rows[n]
        steps = list(range(1, len(r["running"]) + 1))
        fig.add_trace(go.Scatter(x=steps, y=r["running"], mode="lines", name=n, legendgroup=n,
                                 line=dict(color=colors[n], width=1.5)))
        at = [(s, y) for s, y, hit in zip(steps, r["running"], r["limited"]) if hit]
        if at:
            fig.add_trace(go.Scatter(x=[s for s, _ in at], y=[y for _, y in at], mode="markers", legendgroup=n,
                                     showlegend=False, marker=dict(color=colors[n], size=5),
                                     hovertemplate=f"{n}: step %{{x}}, %{{y}} held, a request turned away<extra></extra>"))
            fig.add_trace(go.Scatter(x=[at[0][0], at[-1][0]], y=[r["held_at_limit"]] * 2, mode="lines+text",
                                     legendgroup=n, showlegend=False, line=dict(color=colors[n], dash="dot", width=2),
                                     text=["", f"held {r['held_at_limit']:.1f}"], textposition="top right",
                                     textfont=dict(color=colors[n]), cliponaxis=False, hoverinfo="skip"))
    fig.update_xaxes(title_text="engine step")
    fig.update_yaxes(title_text="requests holding KV memory", rangemode="tozero")
    fig.update_layout(height=380, title=title, margin=dict(t=70, r=90),
                      legend=dict(orientation="h", y=-0.2, x=0))
    return fig
