"""Every live widget builds and reacts in both render modes (kvlab.viz.render): plotly's FigureWidget, and
the fallback that redraws a plain figure in an ipywidgets.Output (Colab, Kaggle, KVLAB_WIDGETS=output).
`make test-oldest` runs this file with ipywidgets 7.7.1 and plotly 5.24.1 too."""

import plotly.graph_objects as go
import pytest
import torch

from kvlab.env import hosted, widget_mode
from kvlab.viz import render as L

MODES = ("figurewidget", "output")


def _walk(box, kinds):
    """The widgets of ``kinds`` inside a widget tree."""
    found, todo = [], [box]
    while todo:
        w = todo.pop()
        if isinstance(w, kinds):
            found.append(w)
        todo.extend(getattr(w, "children", ()))
    return found


def _figures(box):
    """The live figures inside a widget tree: FigureWidgets, and the Outputs of redrawn figures."""
    import ipywidgets as W

    return _walk(box, (go.FigureWidget, W.Output))


def _snapshot(box):
    """What the front end would show: each FigureWidget's figure, or the figure each Output last drew
    (with how many times it drew: a redraw is what the front end receives)."""
    return [w.to_json() if isinstance(w, go.FigureWidget) else (w.live_figure.figure.to_json(), w.live_figure.draws)
            for w in _figures(box)]


def _controls(box):
    import ipywidgets as W

    return _walk(box, (W.Dropdown, W.SelectionSlider, W.IntSlider, W.FloatSlider, W.ToggleButtons))


def _move(control):
    """Set a control to another of its values (the widget's observer reacts)."""
    if hasattr(control, "options") and control.options:
        values = [o[1] if isinstance(o, tuple) else o for o in control.options]
        control.value = next((v for v in values if v != control.value), control.value)  # one option: stays
    else:
        control.value = control.max if control.value != control.max else control.min


def _builders(tiny):
    from kvlab.bench.kernels import recorded_h200
    from kvlab.viz import bandwidth, evict, memory_wall_widget, paged, quant

    g = torch.Generator().manual_seed(0)
    kv = [torch.randn(32, 3, 8, generator=g) for _ in range(2)]
    runs = {b: {"window": {"num_blocks": 6, "kept": list(range(6 - b // 16, 6)), "scores": [], "tokens": 96},
                "sinks": {"num_blocks": 6, "kept": [0] + list(range(7 - b // 16, 6)), "scores": [], "tokens": 96}}
            for b in (32, 64)}
    return {
        "memory_wall_widget": lambda: memory_wall_widget(),
        "granularity_explorer": lambda: quant.granularity_explorer(kv, kv),
        "bandwidth_widget": lambda: bandwidth.bandwidth_widget(bench=recorded_h200()),
        "eviction_explorer": lambda: evict.eviction_explorer(runs, marks={0: "key"}, prompt_tokens=40),
        "engine_dashboard": lambda: _dashboard(tiny),
        "block_table_widget": lambda: paged.block_table_widget(_trace()),
    }


def _trace():
    from kvlab.cache import BlockManager
    from kvlab.viz.paged import Trace

    bm = BlockManager(8, 4)
    t = Trace(bm)
    bm.allocate(0, range(6))
    t.record("one request")
    bm.fork(0, 1)
    t.record("fork")
    return t


def _dashboard(tiny):
    from kvlab.engine import LLM, SamplingParams
    from kvlab.viz.dashboard import engine_dashboard

    model, tok = tiny
    llm = LLM(model, tok, num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=16)
    box = engine_dashboard(llm, columns=8)
    llm.generate([[5, 6, 7, 8], [9, 10, 11]], SamplingParams(max_tokens=3, ignore_eos=True))
    return box


@pytest.mark.parametrize("mode", MODES)
def test_every_widget_builds_and_reacts(tiny, mode, monkeypatch):
    monkeypatch.setenv("KVLAB_WIDGETS", mode)
    for name, build in _builders(tiny).items():
        box = build()
        figs = _figures(box)
        assert figs, name
        kind = go.FigureWidget if mode == "figurewidget" else __import__("ipywidgets").Output
        assert all(isinstance(f, kind) for f in figs), (name, mode, [type(f) for f in figs])
        before = _snapshot(box)
        controls = _controls(box)
        assert controls, name
        for c in controls:
            _move(c)
        assert _snapshot(box) != before, f"{name}: moving its controls changed no figure ({mode})"


def test_the_fallback_redraws_once_per_batch():
    fig = L.live(go.Figure(go.Bar(y=[1, 2])), mode="output")
    assert isinstance(fig, L.RedrawnFigure) and L.view(fig) is fig.output and fig.draws == 1
    with fig.batch_update():
        fig.data[0].y = [3, 4]
        fig.layout.title = "new"
    assert fig.draws == 2 and list(fig.data[0].y) == [3, 4]
    fig.update_layout(height=300)
    assert fig.draws == 3 and fig.layout.height == 300
    assert isinstance(L.live(go.Figure(), mode="figurewidget"), go.FigureWidget)
    with pytest.raises(ValueError, match="mode must be one of"):
        L.live(go.Figure(), mode="inline")


def test_the_mode_follows_the_platform_and_the_variable(monkeypatch):
    for var in ("KVLAB_WIDGETS", "COLAB_RELEASE_TAG", "COLAB_GPU", "KAGGLE_KERNEL_RUN_TYPE", "KAGGLE_URL_BASE"):
        monkeypatch.delenv(var, raising=False)
    if hosted():  # pragma: no cover - this suite itself on Colab
        pytest.skip("running on a hosted platform")
    assert widget_mode() == "figurewidget"
    monkeypatch.setenv("COLAB_RELEASE_TAG", "release-colab_20261201")
    assert hosted() == "colab" and widget_mode() == "output"
    monkeypatch.delenv("COLAB_RELEASE_TAG")
    monkeypatch.setenv("KAGGLE_KERNEL_RUN_TYPE", "Interactive")
    assert hosted() == "kaggle" and widget_mode() == "output"
    monkeypatch.setenv("KVLAB_WIDGETS", "figurewidget")  # forced, even on Kaggle
    assert widget_mode() == "figurewidget"
    monkeypatch.setenv("KVLAB_WIDGETS", "canvas")
    with pytest.raises(ValueError, match="KVLAB_WIDGETS must be one of"):
        widget_mode()


def test_setup_switches_colab_s_widget_manager_on_and_says_how_figures_render(monkeypatch, capsys):
    import sys
    import types

    import kvlab

    calls = []
    colab = types.ModuleType("google.colab")
    colab.output = types.SimpleNamespace(enable_custom_widget_manager=lambda: calls.append("on"))
    monkeypatch.setitem(sys.modules, "google", types.ModuleType("google"))
    monkeypatch.setitem(sys.modules, "google.colab", colab)
    monkeypatch.delenv("KVLAB_WIDGETS", raising=False)
    info = kvlab.setup()
    assert calls == ["on"] and info.platform == "colab" and info.widgets == "output"
    assert "on colab" in capsys.readouterr().out
