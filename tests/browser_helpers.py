"""Helpers for tests/test_browser.py: find a Chromium, serve a copy of the notebooks with JupyterLab,
drive it with Playwright, and list what a learner would see broken.

The one judgement lives in :func:`find_problems`; the notebook tests and the broken-widget test
both call it, so a check that misses a broken widget is caught by the test that plants one.
"""

from __future__ import annotations

import atexit
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

# Playwright's own browser download is not used: we launch the system's Chromium (or Chrome).
LAUNCH_ARGS = ["--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
               "--disable-background-networking", "--disable-component-update", "--disable-sync"]
CHROMIUM_ENV = "KVLAB_CHROMIUM"
CANDIDATES = [
    "/usr/bin/chromium",  # Debian / Ubuntu: apt-get install chromium
    "chromium", "chromium-browser", "google-chrome", "google-chrome-stable",
    "/Applications/Google Chrome.app/Contents/MacOS/Google Chrome",  # macOS
    "/Applications/Chromium.app/Contents/MacOS/Chromium",
]
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
PLOTLY = "application/vnd.plotly.v1+json"


def find_chromium() -> str | None:
    """``$KVLAB_CHROMIUM`` if set (it must exist), else the first Chromium / Chrome found."""
    chosen = os.environ.get(CHROMIUM_ENV)
    if chosen:
        if not (Path(chosen).is_file() and os.access(chosen, os.X_OK)):
            raise FileNotFoundError(f"{CHROMIUM_ENV}={chosen!r} is not an executable file")
        return chosen
    for name in CANDIDATES:
        path = name if os.path.isabs(name) else shutil.which(name)
        if path and Path(path).is_file() and os.access(path, os.X_OK):
            return path
    return None


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


# JupyterLab settings for a run nobody watches: every cell in the DOM (no virtual scrolling, so
# every output can be checked and photographed) and no news / update toast over the outputs.
LAB_SETTINGS = {
    # recordTiming: each cell's execution timestamps in its metadata (rerun_sections re-runs the quick ones)
    "@jupyterlab/notebook-extension/tracker.jupyterlab-settings": {"windowingMode": "none", "recordTiming": True},
    "@jupyterlab/apputils-extension/notification.jupyterlab-settings": {"fetchNews": "false",
                                                                        "checkForUpdates": False},
}


class PortTaken(RuntimeError):
    """The port ``free_port()`` returned was bound by someone else before the server started."""


class JupyterLab:
    """``jupyter lab`` (this Python's) on a free loopback port, serving ``root`` with a token.

    Config, data, runtime, settings and workspace folders are fresh temporary ones, so nothing the
    user saved (layouts, kernelspecs, server config) changes what the test sees; so is the exercise
    progress file (``$KVLAB_PROGRESS``), so that notebook 06's progress list shows no pass made outside
    the run. ``$KVLAB_CACHE`` and ``$HOME`` are passed through: the kernels find the converted model
    where it already is.
    """

    def __init__(self, root: Path, log_path: Path, env: dict | None = None):
        self.root, self.log_path = Path(root), Path(log_path)
        self.extra_env = dict(env or {})  # e.g. KVLAB_WIDGETS=output: the kernels inherit it
        self.port, self.token = free_port(), secrets.token_hex(16)
        self.base = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self, timeout: float = 120, attempts: int = 5) -> "JupyterLab":
        """Start the server; if the free port was taken between ``free_port()`` and the server's bind
        (another xdist worker's kernel can grab it: CI lost a whole browser module to this once),
        try again on a fresh port, up to ``attempts`` times."""
        for attempt in range(attempts):
            try:
                return self._start(timeout)
            except PortTaken:
                if attempt == attempts - 1:
                    raise
                self.port = free_port()
                self.base = f"http://127.0.0.1:{self.port}"
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> "JupyterLab":
        home = self._home = Path(tempfile.mkdtemp(prefix="kvlab-jupyter-"))
        for sub in ("config", "data", "runtime", "ipython", "workspaces"):
            (home / sub).mkdir()
        for rel, value in LAB_SETTINGS.items():
            path = home / "settings" / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(json.dumps(value))
        env = dict(os.environ, JUPYTER_CONFIG_DIR=str(home / "config"), JUPYTER_DATA_DIR=str(home / "data"),
                   JUPYTER_RUNTIME_DIR=str(home / "runtime"), IPYTHONDIR=str(home / "ipython"),
                   JUPYTER_PREFER_ENV_PATH="1", PYTHONUNBUFFERED="1",
                   KVLAB_PROGRESS=str(home / "progress.json"),  # a fresh progress list: not the learner's own
                   KVLAB_KEPT=str(home / "kept_parts.json"),  # nor the learner's kept parts
                   # the kernel's "python" is this environment's python
                   PATH=os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
                   **self.extra_env)
        cmd = [sys.executable, "-m", "jupyterlab", "--no-browser", "--ServerApp.allow_root=True",
               "--ServerApp.ip=127.0.0.1", f"--ServerApp.port={self.port}", "--ServerApp.port_retries=0",
               f"--IdentityProvider.token={self.token}", f"--ServerApp.root_dir={self.root}",
               "--ServerApp.disable_check_xsrf=True",
               "--LabApp.expose_app_in_browser=True",  # window.jupyterapp: run commands, read the model
               f"--LabApp.user_settings_dir={home / 'settings'}",
               f"--LabApp.workspaces_dir={home / 'workspaces'}", "--LabApp.news_url=None"]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        self._log = open(self.log_path, "w")
        self.proc = subprocess.Popen(cmd, env=env, stdout=self._log, stderr=subprocess.STDOUT,
                                     stdin=subprocess.DEVNULL, cwd=self.root)
        atexit.register(self.stop)  # even if the test process ends without its fixtures' teardown
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                self._log.close()
                tail = self.log_tail()
                if "is already in use" in tail:
                    self.proc = None
                    shutil.rmtree(home, ignore_errors=True)
                    raise PortTaken(f"port {self.port} was taken before jupyter lab could bind it")
                raise RuntimeError(f"jupyter lab exited with {self.proc.returncode}:\n{tail}")
            try:
                self.api("GET", "/api/status", timeout=5)
                return self
            except (urllib.error.URLError, ConnectionError, OSError):
                if time.monotonic() > deadline:
                    self.stop()
                    raise RuntimeError(f"jupyter lab did not answer /api/status in {timeout:.0f} s:\n"
                                       f"{self.log_tail()}")
                time.sleep(0.3)

    def api(self, method: str, path: str, timeout: float = 30):
        req = urllib.request.Request(self.base + path, method=method,
                                     headers={"Authorization": f"token {self.token}"})
        with urllib.request.urlopen(req, timeout=timeout) as r:
            body = r.read()
        return json.loads(body) if body else None

    def url(self, path: str) -> str:
        return f"{self.base}/{path}?token={self.token}"

    def shutdown_kernels(self) -> None:
        """Delete every session (and with it its kernel): each notebook's kernel goes when it is done."""
        for session in self.api("GET", "/api/sessions") or []:
            try:
                self.api("DELETE", f"/api/sessions/{session['id']}")
            except urllib.error.URLError:
                pass

    def stop(self) -> None:
        """Kernels first (over the API), then the server: SIGTERM, and SIGKILL if it lingers."""
        if self.proc is None:
            return
        if self.proc.poll() is None:
            try:
                self.shutdown_kernels()
            except Exception:  # the server may already be unwell; it still gets stopped below
                pass
            self.proc.send_signal(signal.SIGTERM)  # jupyter server shuts its kernels down on SIGTERM
            try:
                self.proc.wait(30)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        self._log.close()
        self.proc = None
        shutil.rmtree(self._home, ignore_errors=True)

    def log_tail(self, chars: int = 3000) -> str:
        try:
            return self.log_path.read_text()[-chars:]
        except OSError:
            return ""


# ---- one notebook in the browser ----------------------------------------------------------------

_NOTEBOOK = "window.jupyterapp && window.jupyterapp.shell.currentWidget"

_STATE_JS = """() => {
  const w = window.jupyterapp.shell.currentWidget;
  const kernel = w.sessionContext.session && w.sessionContext.session.kernel;
  const cells = w.content.model.cells;
  let code = 0, done = 0, errors = 0;
  for (let i = 0; i < cells.length; i++) {
    const c = cells.get(i);
    if (c.type !== 'code') continue;
    code++;
    if (c.executionCount) done++;
    for (let j = 0; j < c.outputs.length; j++) if (c.outputs.get(j).type === 'error') errors++;
  }
  const dialog = document.querySelector('.jp-Dialog');
  return {kernel: kernel ? kernel.status : 'none', code, done, errors,
          runDone: !!(window.kvlabRun && window.kvlabRun.done), runError: window.kvlabRun ? window.kvlabRun.error || null : null,
          restarted: !!window.kvlabRun && window.kvlabRun.statuses.some(s => ['autorestarting', 'restarting', 'dead'].includes(s)),
          dialog: dialog ? dialog.innerText.slice(0, 300) : null};
}"""


def open_notebook(page, lab: JupyterLab, name: str, timeout: float = 180) -> None:
    """Open ``name`` in JupyterLab and wait until its kernel is idle."""
    # reset: a fresh layout, without the notebooks opened before (each would start a kernel again)
    page.goto(lab.url(f"lab/tree/{name}") + "&reset")
    page.wait_for_function(f"() => {_NOTEBOOK} && window.jupyterapp.shell.currentWidget.content "
                           f"&& window.jupyterapp.shell.currentWidget.context.path === {json.dumps(name)}",
                           timeout=timeout * 1000)
    page.evaluate("() => window.jupyterapp.shell.collapseLeft()")  # room for the outputs
    deadline = time.monotonic() + timeout
    while True:
        state = page.evaluate(_STATE_JS)
        if state["dialog"]:
            raise AssertionError(f"{name}: JupyterLab opened a dialog: {state['dialog']!r}")
        if state["kernel"] == "idle":
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"{name}: kernel not idle after {timeout:.0f} s (status {state['kernel']})")
        time.sleep(0.5)


def run_all(page, name: str, timeout: float) -> float:
    """Run every cell ("Run All Cells") and return the seconds until JupyterLab has every cell's
    reply (cells after one that raised come back aborted, never run) and the kernel is idle."""
    t0 = time.monotonic()
    page.evaluate("""() => {
      window.kvlabRun = {done: false, statuses: []};  // a restart among them is a crash, even a brief one
      window.jupyterapp.shell.currentWidget.sessionContext.statusChanged.connect(
          (_, status) => window.kvlabRun.statuses.push(status));
      // not awaited here (one evaluate cannot wait many minutes); polled below
      window.jupyterapp.commands.execute('notebook:run-all-cells').then(
          () => { window.kvlabRun.done = true; }, e => { window.kvlabRun.done = true; window.kvlabRun.error = String(e); });
    }""")
    while True:
        time.sleep(1)
        state = page.evaluate(_STATE_JS)
        if state["dialog"]:
            raise AssertionError(f"{name}: JupyterLab opened a dialog while running: {state['dialog']!r}")
        if state["restarted"]:
            raise AssertionError(f"{name}: the kernel died (out of memory?) after {state['done']} of "
                                 f"{state['code']} code cells had run")
        if state["runError"]:
            raise AssertionError(f"{name}: Run All Cells failed in JupyterLab: {state['runError']}")
        if state["runDone"] and state["kernel"] == "idle":
            return time.monotonic() - t0
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{name}: {state['done']} of {state['code']} code cells ran in {timeout:.0f} s "
                                 f"(kernel {state['kernel']}); raise KVLAB_BROWSER_TIMEOUT for slower machines")


# Everything find_problems judges, read from the notebook model (what the kernel sent) and the DOM
# (what the browser made of it). Each output node is tagged data-kvlab-out="<cell>-<output>" so a
# locator can photograph it.
_COLLECT_JS = """() => {
  const DATA_KEYS = ['x', 'y', 'z', 'values', 'labels', 'r', 'theta', 'lat', 'lon', 'a', 'b', 'c',
                     'u', 'v', 'w', 'open', 'close', 'dimensions'];
  const size = v => v == null ? 0 : (Array.isArray(v) || ArrayBuffer.isView(v)) ? v.length
                   : (typeof v === 'object' && typeof v.bdata === 'string') ? v.bdata.length : 0;
  const plotInfo = el => {
    const data = el.data;
    const hasData = t => DATA_KEYS.some(k => size(t[k]) > 0) || (t.cells && size(t.cells.values) > 0)
                         || (t.type === 'indicator' && t.value != null);
    const withPoints = Array.isArray(data) ? data.filter(hasData).length : 0;
    const box = el.getBoundingClientRect();
    return {traces: Array.isArray(data) ? data.length : -1, withPoints,
            width: Math.round(box.width), height: Math.round(box.height)};
  };
  const w = window.jupyterapp.shell.currentWidget;
  const cells = [];
  w.content.widgets.forEach((cell, i) => {
    if (cell.model.type !== 'code') return;
    const outputs = [];
    const model = cell.outputArea.model;
    const children = cell.outputArea.widgets;
    for (let j = 0; j < model.length; j++) {
      const out = model.get(j).toJSON();
      const node = j < children.length ? children[j].node : null;
      if (node) node.setAttribute('data-kvlab-out', `${i}-${j}`);
      const text = node ? node.textContent : '';
      const box = node ? node.getBoundingClientRect() : {width: 0, height: 0};
      outputs.push({
        index: j, type: out.output_type, mimes: Object.keys(out.data || {}),
        ename: out.ename || null, evalue: out.evalue || null, traceback: out.traceback || [],
        stream: out.output_type === 'stream' ? out.name : null,
        streamText: out.output_type === 'stream' ? [].concat(out.text).join('').slice(0, 4000) : null,
        text: text.slice(0, 500), nodeFound: !!node,
        width: Math.round(box.width), height: Math.round(box.height),
        loading: text.includes('Loading widget'),
        widgetError: text.includes('Error displaying widget') || text.includes('Failed to create view')
                     || text.includes('Could not instantiate widget')
                     || (node ? node.querySelectorAll('.jupyter-widgets-error-widget').length : 0) > 0,
        widgetRoots: node ? node.querySelectorAll('.jupyter-widgets').length : 0,
        views: node ? node.querySelectorAll('.lm-Widget').length : 0,
        sliders: node ? node.querySelectorAll('.widget-slider .noUi-handle').length : 0,
        controls: node ? node.querySelectorAll('.widget-slider, .widget-toggle-buttons, .widget-dropdown').length : 0,
        plots: node ? [...node.querySelectorAll('.js-plotly-plot')].map(plotInfo) : [],
      });
    }
    cells.push({index: i, count: cell.model.executionCount, outputs});
  });
  return cells;
}"""


def _cell(c: dict) -> str:
    return f"cell {c['index']} (In [{c['count'] if c['count'] else ' '}])"


def problems_in(cells: list[dict]) -> list[str]:
    """What is wrong in one snapshot of a run notebook (see :func:`find_problems`)."""
    problems, not_run = [], [c["index"] for c in cells if not c["count"]]
    if not_run:  # after a cell raises, the kernel drops the cells queued behind it
        problems.append(f"{len(not_run)} code cells did not run: cells {', '.join(map(str, not_run))}")
    for c in cells:
        where = _cell(c)
        for o in c["outputs"]:
            if o["type"] == "error":
                problems.append(f"{where} raised {o['ename']}: {o['evalue'] or '(no message)'}{_failing_line(o)}")
            elif o["stream"] == "stderr" and "Traceback" in (o["streamText"] or ""):
                problems.append(f"{where} printed a traceback on stderr: "
                                f"{o['streamText'].strip().splitlines()[-1][:200]}")
            is_widget, is_plotly = WIDGET_VIEW in o["mimes"], PLOTLY in o["mimes"]
            if not (is_widget or is_plotly or o["plots"] or o["widgetRoots"]):
                continue
            if not o["nodeFound"]:
                problems.append(f"{where}: output {o['index']} has no view in the page")
                continue
            if o["loading"]:
                problems.append(f"{where}: widget never rendered (still 'Loading widget...': "
                                f"its model never reached the browser)")
            if o["widgetError"]:
                problems.append(f"{where}: widget failed to render: {' '.join(o['text'].split())[:200]!r}")
            if is_widget and not o["loading"] and not o["widgetError"] and (
                    not o["views"] or not (o["width"] and o["height"])):
                problems.append(f"{where}: widget view is empty ({o['width']}x{o['height']} px)")
            if is_plotly and not o["plots"]:
                problems.append(f"{where}: plotly figure was not drawn (no .js-plotly-plot)")
            for k, p in enumerate(o["plots"]):
                if p["traces"] < 0:
                    problems.append(f"{where}: plotly figure {k} has no data attached")
                elif p["withPoints"] == 0:
                    problems.append(f"{where}: plotly figure {k} has no data "
                                    f"({p['traces']} traces, none with points)")
                elif not (p["width"] and p["height"]):
                    problems.append(f"{where}: plotly figure {k} has no size ({p['width']}x{p['height']} px)")
    return problems


def _failing_line(o: dict) -> str:
    """The cell's own line that failed: the first one IPython's traceback marks with an arrow."""
    lines = [re.sub(r"\x1b\[[0-9;]*m", "", line) for tb in o["traceback"] for line in tb.splitlines()]
    marked = [line.split("---->", 1)[1].strip() for line in lines if "---->" in line]
    if not marked:
        return ""
    number, _, code = marked[0].partition(" ")
    return f" at line {number}: {code.strip()[:160]}" if number.isdigit() else f" at: {marked[0][:160]}"


def _final(problem: str) -> bool:
    return any(s in problem for s in (" raised ", " did not run", " printed a traceback"))


def _shows_something(o: dict) -> bool:
    """Outputs worth a screenshot: widgets, figures, and errors."""
    return bool(WIDGET_VIEW in o["mimes"] or PLOTLY in o["mimes"] or o["plots"] or o["widgetRoots"]
                or o["type"] == "error")


def _shot_name(c: dict, o: dict, shown: list[dict]) -> str:
    return f"cell-{c['index']:02d}.png" if len(shown) == 1 else f"cell-{c['index']:02d}-{o['index']}.png"


# ---- controls ------------------------------------------------------------------------------------

# The controls of one widget output, in the order they are tried: sliders first (what the notebooks'
# widgets are driven by), then toggle buttons and dropdowns. ``state`` is what moving them changes.
_CONTROLS_JS = """(sel) => {
  const node = document.querySelector(sel);
  const label = el => { const l = el.querySelector('.widget-label'); return l ? l.textContent.trim() : ''; };
  const sliders = [...node.querySelectorAll('.widget-slider')].map((s, k) => {
    const h = s.querySelector('.noUi-handle');
    return {kind: 'slider', nth: k, label: label(s), state: h && h.getAttribute('aria-valuenow'),
            min: h && h.getAttribute('aria-valuemin'), max: h && h.getAttribute('aria-valuemax')};
  });
  const toggles = [...node.querySelectorAll('.widget-toggle-buttons')].map((t, k) => {
    const buttons = [...t.querySelectorAll('.widget-toggle-button')];
    return {kind: 'toggle buttons', nth: k, label: label(t), options: buttons.length,
            state: buttons.findIndex(b => b.classList.contains('mod-active'))};
  });
  const dropdowns = [...node.querySelectorAll('.widget-dropdown')].map((d, k) => {
    const s = d.querySelector('select');
    return {kind: 'dropdown', nth: k, label: label(d), options: s ? s.options.length : 0,
            state: s ? s.selectedIndex : null};
  });
  return [...sliders, ...toggles, ...dropdowns];
}"""

# What a control can change: the figure (traces, title, shapes, annotations) and the text the widget
# writes (HTML/Output widgets; a slider's own readout is left out, it always follows the handle).
_LOOK_JS = """(sel) => {
  const node = document.querySelector(sel);
  const plots = node.querySelectorAll('.js-plotly-plot');
  const scope = plots.length ? plots : document.querySelectorAll('.jp-Notebook .js-plotly-plot');
  const fig = [...scope].map(el => JSON.stringify([el.data, el.layout && el.layout.title,
      el.layout && el.layout.shapes, el.layout && el.layout.annotations])).join('|');
  const text = [...node.querySelectorAll('.widget-html-content, .widget-htmlmath-content, .widget-output')]
      .map(e => e.textContent).join('|');
  return {fig, text, local: plots.length > 0};
}"""


def _move(page, sel: str, c: dict) -> None:
    """Slider: to its minimum (its maximum if already there), by keyboard on the handle. Toggle
    buttons: click the next button. Dropdown: choose the next option."""
    node = page.locator(sel)
    if c["kind"] == "slider":
        handle = node.locator(".widget-slider .noUi-handle").nth(c["nth"])
        handle.focus()
        handle.press("Home" if float(c["state"]) != float(c["min"]) else "End")
    elif c["kind"] == "toggle buttons":
        group = node.locator(".widget-toggle-buttons").nth(c["nth"])
        group.locator(".widget-toggle-button").nth((c["state"] + 1) % c["options"]).click()
    else:
        node.locator(".widget-dropdown select").nth(c["nth"]).select_option(index=(c["state"] + 1) % c["options"])


def check_controls(page, cell: dict, output: dict, timeout: float = 20, log=print) -> list[str]:
    """Move the controls of one widget output, one at a time, until one changes the figure.

    Each control moved must change the figure or the widget's text; a widget with a figure needs a
    control that changes it. When the figure is not in the same output, the notebook's other
    figures count. Sliders are tried first; a widget without sliders has its toggle buttons and
    dropdowns tried instead.
    """
    sel = f'[data-kvlab-out="{cell["index"]}-{output["index"]}"]'
    where = _cell(cell)
    controls = page.evaluate(_CONTROLS_JS, sel)
    if any(c["kind"] == "slider" for c in controls):
        controls = [c for c in controls if c["kind"] == "slider"]
    controls = [c for c in controls if c["kind"] == "slider" or c["options"] > 1]
    problems, text_only = [], []
    for c in controls:
        name = f"{c['kind'].rstrip('s')} {c['label'] or '#' + str(c['nth'])!r}"
        if c["state"] is None:
            problems.append(f"{where}: {name} has no handle")
            continue
        before = page.evaluate(_LOOK_JS, sel)
        _move(page, sel, c)
        deadline = time.monotonic() + timeout
        moved = changed_text = False
        text_seen_at = None
        while time.monotonic() < deadline:
            page.wait_for_timeout(250)
            now = [x for x in page.evaluate(_CONTROLS_JS, sel) if x["kind"] == c["kind"]][c["nth"]]["state"]
            moved = moved or now != c["state"]
            look = page.evaluate(_LOOK_JS, sel)
            if look["fig"] != before["fig"]:  # this control drives the figure: the widget works
                others = f" (before it, {', '.join(text_only)} changed only the text)" if text_only else ""
                whose = "its figure" if look["local"] else "a figure in another cell"
                log(f"  {where}: {name} redraws {whose}{others}")
                return problems
            if look["text"] != before["text"] and not changed_text:
                changed_text, text_seen_at = True, time.monotonic()
            if changed_text and time.monotonic() - text_seen_at > 3:
                break  # the text answered; the figure had its chance to follow
        if not moved:
            problems.append(f"{where}: {name} did not move when operated")
        elif changed_text:
            text_only.append(name)
        else:
            problems.append(f"{where}: moving {name} changed nothing in {timeout:.0f} s "
                            f"(neither the figure nor the widget's text)")
    if controls and not problems and page.evaluate(_LOOK_JS, sel)["fig"]:
        problems.append(f"{where}: no control changes the figure ({', '.join(text_only)} changed only "
                        f"the widget's text)")
    return problems


# ---- the one check -------------------------------------------------------------------------------


def _screenshot(page, locator, path: Path) -> None:
    """The whole output, even one taller than the window: the notebook scrolls inside JupyterLab's
    fixed-height layout, so the window is made tall enough for the output while it is taken."""
    view = page.viewport_size
    height = locator.evaluate("el => Math.ceil(el.getBoundingClientRect().height)")
    if view and height + 300 > view["height"]:
        page.set_viewport_size({"width": view["width"], "height": height + 300})
        page.wait_for_timeout(500)  # JupyterLab re-lays out to the new window
    try:
        locator.screenshot(path=str(path), timeout=30_000)
    finally:
        if view and page.viewport_size != view:
            page.set_viewport_size(view)
            page.wait_for_timeout(300)


def find_problems(page, shots: Path | None = None, settle: float = 60, controls: bool = True,
                  control_timeout: float = 20, log=print) -> list[str]:
    """Everything a learner would see broken in the open notebook after a run, as sentences.

    Waits up to ``settle`` seconds for widgets and figures to finish rendering, then reports: cells
    that did not run or raised, tracebacks on stderr, widget views left "Loading widget..." or
    showing an error, empty widget views, plotly figures not drawn or without data, and (with
    ``controls``) widgets whose sliders (or, without sliders, toggle buttons and dropdowns) change
    nothing in ``control_timeout`` seconds or never change the figure: see :func:`check_controls`.
    Saves a screenshot of every output holding a widget or a figure into ``shots``
    (``cell-<index>.png``, the cell's index in the notebook).
    """
    deadline = time.monotonic() + settle
    while True:
        cells = page.evaluate(_COLLECT_JS)
        problems = problems_in(cells)
        if all(_final(p) for p in problems) or time.monotonic() > deadline:
            break  # only rendering can still come right; errors and skipped cells will not
        page.wait_for_timeout(1000)
    if shots is not None:
        shots.mkdir(parents=True, exist_ok=True)
    for c in cells:
        shown = [o for o in c["outputs"] if _shows_something(o) and o["nodeFound"]]
        for o in shown:
            path = None
            if shots is not None:  # photographed as rendered, before any control moves
                path = shots / _shot_name(c, o, shown)
                try:
                    _screenshot(page, page.locator(f'[data-kvlab-out="{c["index"]}-{o["index"]}"]'), path)
                except Exception as e:  # a screenshot is evidence, not the verdict
                    log(f"  (no screenshot of {_cell(c)}: {type(e).__name__}: {str(e).splitlines()[0]})")
                    path = None
            if controls and o["controls"] and o["widgetRoots"]:
                problems += check_controls(page, c, o, timeout=control_timeout, log=log)
            if path is not None:
                for i, p in enumerate(problems):
                    if p.startswith(_cell(c)) and "[screenshot" not in p:
                        problems[i] = f"{p} [screenshot {path}]"
    return problems


def count_outputs(page) -> dict:
    """How many widget views, figures and slider widgets the open notebook shows (for the log)."""
    cells = page.evaluate(_COLLECT_JS)
    outs = [o for c in cells for o in c["outputs"]]
    return {"widget views": sum(WIDGET_VIEW in o["mimes"] for o in outs),
            "figures": sum(len(o["plots"]) for o in outs),
            "slider widgets": sum(bool(o["sliders"]) for o in outs),
            "widgets with controls": sum(bool(o["controls"]) for o in outs)}


def save_executed(page, lab: "JupyterLab", name: str, dest: Path, timeout: float = 30) -> bool:
    """Save the notebook as the browser ran it (outputs and widget state) and copy it to ``dest``: the
    executed notebook beside its screenshots, for a reader who was not there. True when it was saved."""
    src = lab.root / name
    before = src.stat().st_mtime_ns
    page.evaluate("() => window.jupyterapp.commands.execute('docmanager:save')")
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if src.stat().st_mtime_ns != before:
            time.sleep(0.5)  # let the write finish
            shutil.copyfile(src, dest)
            return True
        time.sleep(0.25)
    return False


def dismiss_toasts(page) -> int:
    """Close JupyterLab's notification toasts (the news question, "a kernel started", update checks) so
    no screenshot has one over its right edge; the settings above keep most away, this catches the rest.
    Returns how many were closed."""
    return page.evaluate("""() => {
      let n = 0;
      document.querySelectorAll('.jp-Notification-Toast-Close').forEach(b => { b.click(); n++; });
      document.querySelectorAll('.Toastify__toast-container').forEach(c => c.remove());
      return n;
    }""")


_RERUN_JS = """(i) => {
  const w = window.jupyterapp.shell.currentWidget;
  window.kvlabRerun = {done: false, error: null};
  w.content.activeCellIndex = i;
  w.content.deselectAll();
  window.jupyterapp.commands.execute('notebook:run-cell').then(
      () => { window.kvlabRerun.done = true; }, e => { window.kvlabRerun.done = true; window.kvlabRerun.error = String(e); });
}"""

_RERUN_STATE_JS = """(i) => {
  const w = window.jupyterapp.shell.currentWidget;
  const kernel = w.sessionContext.session && w.sessionContext.session.kernel;
  const c = w.content.model.cells.get(i);
  const errors = [];
  for (let j = 0; j < c.outputs.length; j++) {
    const o = c.outputs.get(j).toJSON();
    if (o.output_type === 'error') errors.push(`${o.ename}: ${o.evalue}`);
  }
  return {done: window.kvlabRerun.done, error: window.kvlabRerun.error, kernel: kernel ? kernel.status : 'none',
          errors};
}"""


def _rerun(page, i: int, timeout: float) -> list[str]:
    """Run cell ``i`` again and wait for the kernel: the errors it showed."""
    t0 = time.monotonic()
    page.evaluate(_RERUN_JS, i)
    while True:
        time.sleep(0.5)
        state = page.evaluate(_RERUN_STATE_JS, i)
        if state["done"] and state["kernel"] == "idle":
            break
        if time.monotonic() - t0 > timeout:
            state["errors"].append(f"still running after {timeout:.0f} s")
            break
    if state["error"]:
        state["errors"].append(state["error"])
    return state["errors"]


def rerun_cells(page, name: str, runs: dict[str, list[int]], timeout: float = 600) -> list[str]:
    """After Run All, re-run each task's cells in order, as a room does (its stub or solution and checker,
    then every cell that plugs it in): the problems, one line per cell that raised. A cell that plugs in
    several tasks runs for the last of them only (it then reads every task's function as re-run)."""
    last_task = {i: task for task, cells in runs.items() for i in cells}
    problems = []
    for task, cells in runs.items():
        for i in cells:
            if last_task[i] != task:
                continue
            problems += [f"{name}: re-running task {task}'s cell {i} after Run All raised {e}"
                         for e in _rerun(page, i, timeout)]
    return problems


_CELL_SECONDS_JS = """() => {
  const cells = window.jupyterapp.shell.currentWidget.content.model.cells;
  const out = [];
  for (let i = 0; i < cells.length; i++) {
    const ex = cells.get(i).getMetadata('execution');
    const a = ex && (ex['iopub.execute_input'] || ex['iopub.status.busy']), b = ex && ex['shell.execute_reply'];
    out.push(a && b ? (Date.parse(b) - Date.parse(a)) / 1000 : null);
  }
  return out;
}"""


def cell_seconds(page) -> list[float | None]:
    """Each cell's last run time in seconds (JupyterLab's recordTiming, LAB_SETTINGS), None if unknown."""
    return page.evaluate(_CELL_SECONDS_JS)


def rerun_sections(page, name: str, sections: dict[str, list[int]], quick_s: float = 3.0,
                   timeout: float = 600) -> tuple[list[str], dict]:
    """After Run All, re-run each section from its first cell, as a room does when it goes back: the last
    section first, so each one meets the names every later section bound (the hazard: a later cell rebinds
    a name an earlier one reads). Every cell that took at most ``quick_s`` in Run All; a slower one keeps
    its state from Run All (re-running all of them would be a second Run All of the suite, ~12 minutes
    on 2 cores). Returns (problems, counts)."""
    seconds = cell_seconds(page)
    problems, ran, kept = [], 0, 0
    if sections and all(seconds[i] is None for cells in sections.values() for i in cells):
        return [f"{name}: no cell run times recorded (JupyterLab's recordTiming), so no section was re-run"], {}
    for title, cells in reversed(sections.items()):
        for i in cells:
            if seconds[i] is None or seconds[i] > quick_s:
                kept += 1
                continue
            ran += 1
            problems += [f"{name}: re-running section '{title}' from its first cell, cell {i} raised {e}"
                         for e in _rerun(page, i, timeout)]
    return problems, {"section cells re-run": ran, "section cells slower than quick_s": kept}
