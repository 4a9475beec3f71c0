"""Figures that widgets update in place, on every front end (JupyterLab, Colab, Kaggle, a course hub).

A live widget updates its figure inside ``with fig.batch_update():``; where ``FigureWidget`` does not
render (Colab, Kaggle), a plain figure is redrawn in an ``ipywidgets.Output``: slower, but it renders.
"""

from __future__ import annotations

import html
from contextlib import contextmanager

import plotly.graph_objects as go

from kvlab.env import WIDGET_MODES as MODES
from kvlab.env import widget_mode

__all__ = ["MODES", "RedrawnFigure", "live", "table", "table_html", "view", "widget_mode"]


class RedrawnFigure:
    """A plotly figure shown in an ``ipywidgets.Output``, redrawn after each ``batch_update``."""

    def __init__(self, fig):
        import ipywidgets as W  # ipywidgets loads only when a widget is built
        self.figure = go.Figure(fig)
        self.output = W.Output()
        self.output.live_figure = self  # from the widget tree back to the figure it shows (tests read it)
        self.draws = 0  # how many times it was sent to the front end (tests read it)
        self.draw()

    def draw(self) -> None:
        from IPython.display import display  # IPython: only where a figure is drawn (a kernel has it)
        self.output.clear_output(wait=True)
        with self.output:
            display(self.figure)
        self.draws += 1

    @contextmanager
    def batch_update(self):
        with self.figure.batch_update():
            yield
        self.draw()

    def update_layout(self, *args, **kwargs):
        self.figure.update_layout(*args, **kwargs)
        self.draw()
        return self

    def __getattr__(self, name):  # data, layout, add_*, ...: the figure's own
        return getattr(self.figure, name)


def live(fig, mode: str | None = None):
    """``fig`` as a figure widgets can update: a ``FigureWidget``, or a :class:`RedrawnFigure`."""
    mode = widget_mode() if mode is None else mode
    if mode not in MODES:
        raise ValueError(f"mode must be one of {MODES} or None, got {mode!r}")
    return go.FigureWidget(fig) if mode == "figurewidget" else RedrawnFigure(fig)


def view(fig):
    """The widget that shows ``fig`` in a layout (``VBox([..., view(fig)])``)."""
    return fig.output if isinstance(fig, RedrawnFigure) else fig


_CELL = "padding:3px 10px;border-bottom:1px solid #e5e7e9"


def table_html(header, rows, caption: str = "") -> str:
    """A small HTML table: ``header`` (column names) over ``rows`` (one sequence per row, as long as the
    header; numbers right-aligned, as given: format them first). A table is looked at, not read word by word."""
    header = list(header)
    rows = [list(r) for r in rows]
    if bad := [i for i, r in enumerate(rows) if len(r) != len(header)]:
        raise ValueError(f"rows must each have {len(header)} cells (the header's), rows {bad} do not")

    def cell(v, tag="td"):
        align = "right" if isinstance(v, (int, float)) or str(v).lstrip("+-−")[:1].isdigit() else "left"
        return f"<{tag} style='{_CELL};text-align:{align}'>{html.escape(str(v))}</{tag}>"

    head = "".join(cell(h, "th") for h in header)
    body = "".join("<tr>" + "".join(cell(v) for v in r) + "</tr>" for r in rows)
    cap = f"<caption style='caption-side:top;text-align:left;padding:2px 0'>{html.escape(caption)}</caption>" if caption else ""
    return (f"<table style='border-collapse:collapse;font-size:13px;margin:4px 0'>{cap}<thead><tr>{head}</tr></thead>"
            f"<tbody>{body}</tbody></table>")


def table(header, rows, caption: str = ""):
    """:func:`table_html` as something a notebook cell displays (``display(table(...))`` or its last line)."""
    from IPython.display import HTML  # IPython: only where a table is shown (a kernel has it)
    return HTML(table_html(header, rows, caption))
