"""The block table, made visible (notebook 02): physical blocks coloured by owner, replayed from snapshots
of a real :class:`~kvlab.cache.paged.BlockManager`'s public state.
"""

from __future__ import annotations

import html
import math

import plotly.graph_objects as go

from kvlab.validate import cdiv
from kvlab.viz import COLORS
from kvlab.viz.render import live, view

PALETTE = ["#2e86c1", "#28b463", "#af7ac5", "#e67e22", "#ec7063", "#d4ac0d", "#76d7c4", "#e59866", "#f7dc6f",
           "#a9cce3", "#abebc6"]  # eleven, none dark or grey: those mean shared and cached
FREE, CACHED, SHARED = "#ffffff", "#d5d8dc", "#1b2631"


def seq_color(seq_id: int) -> str:
    """A sequence keeps its colour from frame to frame (and across widgets)."""
    return PALETTE[seq_id % len(PALETTE)]


def snapshot(bm, note: str = "", names: dict | None = None) -> dict:
    """Per block its state, owners, refcount and fill; ``names`` maps seq ids to labels ("A", "B", ...)."""
    owners: dict[int, list[int]] = {}
    for sid, seq in bm.seqs.items():
        for bid in seq.block_table:
            owners.setdefault(bid, []).append(sid)
    cached = set(bm.cached_ids)
    blocks = []
    for b in bm.blocks:
        state = "used" if b.ref_count else ("cached" if b.block_id in cached else "free")
        blocks.append(dict(id=b.block_id, state=state, owners=sorted(owners.get(b.block_id, [])),
                           ref=b.ref_count, fill=b.num_tokens if state != "free" else 0))
    return dict(note=note, block_size=bm.block_size, blocks=blocks,
                tables={sid: list(s.block_table) for sid, s in bm.seqs.items()},
                lengths={sid: len(s.token_ids) for sid, s in bm.seqs.items()}, stats=bm.stats(),
                names={sid: (names or {}).get(sid, f"seq {sid}") for sid in bm.seqs})


def _name(frame: dict, sid: int) -> str:
    return frame.get("names", {}).get(sid, f"seq {sid}")


class Trace:
    """Snapshots of a block manager after each operation, for :func:`block_table_widget`."""

    def __init__(self, bm, names: dict | None = None):
        self.bm = bm
        self.names = dict(names or {})
        self.frames: list[dict] = []

    def record(self, note: str) -> dict:
        self.frames.append(snapshot(self.bm, note, self.names))
        return self.frames[-1]


COMPACT_COLUMNS = 12  # wider grids label each block with its owner only (c = cached, ×n = shared by n)


def block_grid(frame: dict, columns: int):
    compact = columns > COMPACT_COLUMNS  # a wide grid has narrow cells: the owner only (the hover text has it all)
    blocks, z, text, colors = frame["blocks"], [], [], {}
    for r in range(cdiv(len(blocks), columns)):
        zr, tr = [], []
        for b in blocks[r * columns:(r + 1) * columns]:
            if b["state"] == "free":
                key, short, label = FREE, "", f"#{b['id']}<br>free"
            elif b["state"] == "cached":
                key, short, label = CACHED, "c", f"#{b['id']}<br>cached"
            elif b["ref"] > 1:
                key, short, label = SHARED, f"×{b['ref']}", f"#{b['id']}<br>ref {b['ref']}"
            else:
                key, name = seq_color(b["owners"][0]), _name(frame, b["owners"][0])
                short, label = name.removeprefix("seq "), f"#{b['id']}<br>{name}"
            if b["state"] != "free":
                label += f"<br>{b['fill']}/{frame['block_size']}"
            zr.append(colors.setdefault(key, len(colors)))
            tr.append(short if compact else label)
        z.append(zr + [None] * (columns - len(zr)))  # the last row runs past the pool
        text.append(tr + [""] * (columns - len(tr)))
    # a discrete colourscale: one flat band per colour actually present
    n = max(len(colors), 1)
    scale = [[(idx + j) / n, color] for color, idx in sorted(colors.items(), key=lambda kv: kv[1]) for j in (0, 1)]
    return z, text, scale or [[0, FREE], [1, FREE]], n


def _tables_html(frame: dict) -> str:
    s = frame["stats"]
    rows = "".join(
        f"<tr><td>{html.escape(_name(frame, sid))}</td><td>{frame['lengths'][sid]} tokens</td><td>{table}</td></tr>"
        for sid, table in sorted(frame["tables"].items()))
    return (f"<b>{html.escape(frame['note'])}</b><br>"
            f"blocks used {s['blocks_used']} · free {s['blocks_free']} · cached {s['blocks_cached']} · "
            f"shared {s['blocks_shared']} · empty slots in held blocks {s['empty_slots']} · "
            f"prefix hits {s['prefix_hits']}/{s['prefix_queries']} · copy-on-write {s['cow_copies']} · "
            f"evictions {s['evictions']}"
            f"<table style=\"border-spacing:14px 2px\"><tr><th>sequence</th><th>length</th>"
            f"<th>block table (logical → physical)</th></tr>{rows}</table>")


def block_table_figure(frame: dict, columns: int = 8, widget: bool = False):
    z, text, scale, n = block_grid(frame, columns)
    fig = go.Figure(go.Heatmap(
        z=z, text=text, texttemplate="%{text}", textfont=dict(size=13 if columns <= COMPACT_COLUMNS else 11),
        colorscale=scale, zmin=0, zmax=n, showscale=False, xgap=3, ygap=3, hoverinfo="text"))
    fig.update_layout(height=70 + 62 * len(z), margin=dict(l=10, r=10, t=30, b=10),
                      title="physical blocks (colour = owner, dark = shared, grey = cached, white = free)"
                            + ("<br><sup>each block labelled with its owner; c = cached, ×n = shared by n"
                               "</sup>" if columns > COMPACT_COLUMNS else ""),
                      xaxis=dict(visible=False), yaxis=dict(visible=False, autorange="reversed"))
    if len(frame["blocks"]) % columns:  # the grid's last row runs past the pool: say what those cells are
        fig.layout.title.text += " · blue-grey: past the pool's last block"
    return live(fig) if widget else fig


def redraw_grid(fig, frame: dict, columns: int) -> None:
    """Redraw a live :func:`block_table_figure` in place with ``frame``'s blocks."""
    z, text, scale, n = block_grid(frame, columns)
    with fig.batch_update():
        fig.data[0].z, fig.data[0].text = z, text
        fig.data[0].colorscale, fig.data[0].zmax = scale, n


def block_table_widget(trace: Trace, columns: int = 8, start: int = 0):
    """Step through a trace: the block grid and the per-sequence tables update together."""
    import ipywidgets as W  # ipywidgets loads only when a widget is built (a figure needs plotly alone)
    if not isinstance(start, int) or isinstance(start, bool) or not 0 <= start < len(trace.frames):
        raise ValueError(f"start must be a frame index in 0..{len(trace.frames) - 1}, got {start!r}")
    fig = block_table_figure(trace.frames[start], columns, widget=True)
    info = W.HTML(_tables_html(trace.frames[start]))
    play = W.Play(min=0, max=len(trace.frames) - 1, interval=1200, description="play", value=start)
    step = W.IntSlider(min=0, max=len(trace.frames) - 1, description="step", value=start)
    W.jslink((play, "value"), (step, "value"))
    def show(change):
        frame = trace.frames[change["new"]]
        redraw_grid(fig, frame, columns)
        info.value = _tables_html(frame)
    step.observe(show, names="value")
    return W.VBox([W.HBox([play, step]), info, view(fig)])


def fragmentation_figure(results: list[dict], title: str = ""):
    """Where reserved KV slots go per allocation policy, averaged over decode steps (paper Fig. 2 style)."""
    names = [r["policy"] if r["policy"] != "paged" else f"paged ({r['block_size']})" for r in results]
    fig = go.Figure()
    for key, label, color in (("token_states", "token states", COLORS["tokens"]),
                              ("reservation", "reserved for later tokens", COLORS["padding"]),
                              ("internal_fragmentation", "internal fragmentation", COLORS["kv"])):
        fig.add_bar(x=names, y=[100 * r[key] for r in results], name=label, marker_color=color,
                    text=[f"{100 * r[key]:.1f}%" if r[key] >= 0.06 else "" for r in results],  # no room below 6 %
                    textposition="inside")
    fig.update_layout(barmode="stack", height=420, title=(title + ": " if title else "") + "where reserved KV slots go",
                      xaxis_title="allocation policy (block size)",
                      yaxis=dict(title="% of reserved KV slots (mean over decode steps)", range=[0, 100]),
                      legend=dict(orientation="h", y=-0.25))
    return fig


def block_size_figure(rows: list[dict], title: str = "The block-size trade-off"):
    """Slots wasted at completion vs block-table entries per sequence, across block sizes."""
    x = [str(r["block_size"]) for r in rows]
    waste = [100 * r["waste_at_completion"] for r in rows]
    entries = [r["table_entries_per_seq"] for r in rows]
    fig = go.Figure()
    fig.add_bar(x=x, y=waste, name="slots wasted at completion (%, left axis)", marker_color=COLORS["kv"],
                text=[f"{w:.1f}%" for w in waste], textposition="outside", cliponaxis=False)
    # the line's values on hover only: where the rising bars meet the falling line their labels would collide
    fig.add_scatter(x=x, y=entries, name="block-table entries per sequence (right axis, log)",
                    yaxis="y2", mode="lines+markers", line_color=COLORS["weights"],
                    hovertemplate="block size %{x}: %{y:.1f} entries per sequence<extra></extra>")
    ticks = [t for t in (1, 2, 5, 10, 20, 50, 100, 200, 500, 1000) if t <= 2 * max(entries)]
    fig.update_layout(height=420, title=title, xaxis_title="block size (tokens per block)",
                      yaxis=dict(title="% of slots empty at completion", range=[0, max(waste) * 1.15 + 1]),
                      yaxis2=dict(title="block-table entries per sequence (log scale)", overlaying="y", side="right",
                                  type="log", tickvals=ticks, ticktext=[str(t) for t in ticks], showgrid=False,
                                  range=[math.log10(0.7), math.log10(max(entries) * 2)]),
                      legend=dict(orientation="h", y=-0.25), margin=dict(r=80))
    return fig
