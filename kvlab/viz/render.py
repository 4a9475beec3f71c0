"""Figures that widgets update in place, on every front end (JupyterLab, Colab, Kaggle, a course hub).

A live widget updates its figure inside ``with fig.batch_update():``; where ``FigureWidget`` does not
render (Colab, Kaggle), a plain figure is redrawn in an ``ipywidgets.Output``: slower, but it renders.
"""

from __future__ import annotations

from contextlib import contextmanager

import plotly.graph_objects as go

from kvlab.env import WIDGET_MODES as MODES
from kvlab.env import widget_mode

__all__ = ["MODES", "RedrawnFigure", "live", "view", "widget_mode"]


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
