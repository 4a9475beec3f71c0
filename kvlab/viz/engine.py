"""The serving engine, made visible (notebook 04): who waits, who runs, with how many tokens and at what
cost in blocks and milliseconds, step by step, so the scheduler's rules can be watched, not believed.
It only reads the engine (frames off ``LLM.on_scheduled``, ``llm.trace``, ``llm.step_stats``).
"""

from __future__ import annotations

import bisect
import html
import warnings

import plotly.graph_objects as go

from kvlab.viz import COLORS
from kvlab.viz.paged import PALETTE, SHARED, block_table_figure, redraw_grid, seq_color, snapshot

STATES = ("queued", "prefill", "decode", "preempted")  # a request's state in one step, for the timeline
STATE_COLORS = {"queued": COLORS["empty"], "prefill": PALETTE[0], "decode": COLORS["tokens"],
                "preempted": COLORS["kv"]}
ACTION_COLORS = {"admitted": COLORS["tokens"], "chunked": PALETTE[0], "preempted": COLORS["kv"],
                 "finished": COLORS["weights"], "deferred": COLORS["padding"]}
PART_COLORS = {"schedule_s": COLORS["padding"], "packing_s": PALETTE[2], "forward_s": PALETTE[0],
               "sample_s": COLORS["tokens"]}


# ---- recording ------------------------------------------------------------------------------------

class EngineRecorder:
    """Plain-data frames of an :class:`~kvlab.engine.LLM`, one per step, as its forward sees them (off
    ``llm.on_scheduled``, chained); ``finished`` events, logged after the forward, join via ``llm.on_step``.
    ``listeners`` get ``(frame index, is_new)`` whenever a frame is added or gains events."""

    def __init__(self, llm):
        self.llm = llm
        self.frames: list[dict] = []
        self.listeners: list = []
        self._steps: list[int] = []  # frames[i]["step"], for lookups by step
        self._by_step: dict[int, int] = {}  # step -> index of the frame its events belong to
        self._seen = len(llm.trace)  # events logged before attaching belong to no frame
        self._previous, self._previous_step = llm.on_scheduled, llm.on_step
        llm.on_scheduled, llm.on_step = self._on_scheduled, self._on_step

    def detach(self) -> None:
        """Stop recording; the frames stay."""
        if self.llm.on_scheduled == self._on_scheduled:
            self.llm.on_scheduled = self._previous
        if self.llm.on_step == self._on_step:
            self.llm.on_step = self._previous_step

    def _on_step(self, stats) -> None:  # the step's finished events join its frame at once
        if self._previous_step is not None:
            self._previous_step(stats)
        try:
            self.sync()
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"EngineRecorder: step {stats.step} not synced: {e!r}", stacklevel=2)

    def _on_scheduled(self, batch) -> None:
        if self._previous is not None:
            self._previous(batch)
        try:  # a drawing bug must never break a step: the engine is on the correctness path, we are not
            self.capture(batch)
        except Exception as e:  # noqa: BLE001
            warnings.warn(f"EngineRecorder: step {batch.step} not recorded: {e!r}", stacklevel=2)

    def capture(self, batch=None) -> dict:
        """Record one frame: of ``batch`` (a ``SchedulerOutput``), or with none, of the engine between steps."""
        llm, sched = self.llm, self.llm.scheduler
        step = batch.step if batch is not None else sched.step_count
        note = f"step {step}" if batch is not None else f"before step {step + 1}"
        pool = snapshot(llm.block_manager, note)
        del pool["tables"], pool["lengths"]  # the grid draws blocks only
        # start / total in tokens: this step feeds tokens start..start+n of total; decodes come first
        scheduled = [dict(seq_id=seq.seq_id, tokens=n, kind="decode" if i < batch.num_decodes else "prefill",
                          start=seq.num_computed_tokens, total=seq.num_tokens)
                     for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens))] if batch is not None else []
        frame = dict(step=step, batch=batch is not None, pool=pool, scheduled=scheduled,
                     budget=sched.max_num_batched_tokens,  # tokens per step
                     waiting=[s.seq_id for s in sched.waiting],
                     requeued=[s.seq_id for s in sched.waiting if s.status.value == "preempted"],
                     running=[s.seq_id for s in sched.running],
                     finished=sorted(sid for sid, s in llm.seqs.items() if s.is_finished), events=[])
        self.frames.append(frame)
        self._steps.append(step)
        index = len(self.frames) - 1
        if batch is not None:
            self._by_step[step] = index
        for i in sorted(self._sync() - {index}):
            self._notify(i, False)
        self._notify(index, True)
        return frame

    def _sync(self) -> set[int]:
        trace = self.llm.trace
        changed = set()
        for ev in trace[self._seen:]:
            i = self._by_step.get(ev.step)
            if i is not None:
                self.frames[i]["events"].append(dict(seq_id=ev.seq_id, action=ev.action, reason=ev.reason,
                                                     detail=ev.detail))
                changed.add(i)
        self._seen = len(trace)
        return changed

    def sync(self) -> None:
        """Move trace events logged since the last frame (a last step's ``finished``) into their frames."""
        for i in sorted(self._sync()):
            self._notify(i, False)

    def _notify(self, index: int, new: bool) -> None:
        for fn in list(self.listeners):
            try:
                fn(index, new)
            except Exception as e:  # noqa: BLE001
                warnings.warn(f"EngineRecorder listener failed: {e!r}", stacklevel=2)

    def frame_at(self, step: int) -> dict:
        """The frame of ``step``, or the last one before it."""
        return self.frames[max(bisect.bisect_right(self._steps, step) - 1, 0)]


# ---- the scheduler widget -------------------------------------------------------------------------

def _chip(label: str, color: str | None, title: str = "", outline: str | None = None) -> str:
    bg, fg = (color, "#ffffff") if color else ("#ffffff", "#1b2631")
    border = outline or (color if color else COLORS["weights"])
    return (f'<span title="{html.escape(title)}" style="display:inline-block;margin:1px;padding:0 5px;'
            f"border:2px solid {border};border-radius:8px;background:{bg};color:{fg};font:12px monospace\">"
            f"{html.escape(label)}</span>")


def frame_html(frame: dict) -> str:
    owners = {o for b in frame["pool"]["blocks"] for o in b["owners"]}  # chips take their blocks' colours
    sched = {s["seq_id"]: s for s in frame["scheduled"]}
    prefill, decode = (sum(s["tokens"] for s in sched.values() if s["kind"] == k) for k in ("prefill", "decode"))
    if frame["batch"]:
        plural = "s" if len(sched) != 1 else ""
        head = (f"<b>step {frame['step']}</b>: {len(sched)} sequence{plural} in the forward, <b>{prefill}</b> prefill + "
                f"<b>{decode}</b> decode = {prefill + decode} of {frame['budget']} tokens")
    else:
        head = f"<b>{html.escape(frame['pool']['note'])}</b>: nothing scheduled yet"
    requeued = set(frame["requeued"])
    waiting = "".join(
        _chip(f"{sid}↺" if sid in requeued else str(sid), None,
              f"seq {sid}: preempted, recomputes on readmission" if sid in requeued else f"seq {sid}: queued",
              COLORS["kv"] if sid in requeued else None) for sid in frame["waiting"])
    running = []
    for sid in frame["running"]:
        s = sched.get(sid)
        if s is None:
            label, title = f"{sid} –", f"seq {sid}: holds blocks, no tokens this step"
        elif s["kind"] == "decode":
            label, title = f"{sid} d", f"seq {sid}: decode, one token; {s['total']} tokens with it"
        else:
            label = f"{sid} p{s['tokens']}"
            title = f"seq {sid}: prefill tokens {s['start']}..{s['start'] + s['tokens']} of {s['total']}"
        running.append(_chip(label, seq_color(sid) if sid in owners else COLORS["weights"], title))
    finished = "".join(_chip(str(sid), None, f"seq {sid}: finished", COLORS["empty"]) for sid in frame["finished"])
    none = '<span style="color:#7f8c8d">none</span>'
    rows = "".join(
        f'<tr><td style="padding-right:8px;text-align:left">{name} ({n})</td><td style="text-align:left">'
        f"{chips or none}</td></tr>"
        for name, n, chips in (("waiting", len(frame["waiting"]), waiting),
                               ("running", len(frame["running"]), "".join(running)),
                               ("finished", len(frame["finished"]), finished)))
    events = "".join(
        f'<li><span style="color:{ACTION_COLORS.get(e["action"], COLORS["weights"])};font-weight:bold">'
        f"{e['action']}</span> seq {e['seq_id']}"
        + (f" — {html.escape(e['reason'])}" if e["reason"] else "")
        + (f" <span style=\"color:#7f8c8d\">({html.escape(e['detail'])})</span>" if e["detail"] else "") + "</li>"
        for e in frame["events"])
    s = frame["pool"]["stats"]
    pool = (f"blocks used {s['blocks_used']} · free {s['blocks_free']} · cached {s['blocks_cached']} · "
            f"shared {s['blocks_shared']} · empty slots in held blocks {s['empty_slot_share']:.0%} "
            f"(token slots not yet written in the blocks requests hold: internal fragmentation, notebook 02)")
    return (f"{head}<table>{rows}</table>"
            f"<span style=\"font-size:0.95em\">p<i>n</i> = <i>n</i> prefill tokens, d = one decode token, "
            f"– = waits for token budget, ↺ = preempted</span><br>{pool}"
            f"<br>this step's decisions:"
            f"<ul style=\"margin:0\">{events or '<li>none</li>'}</ul>")


def scheduler_widget(recorder: EngineRecorder, columns: int = 16):
    """Step through a recorded run: queues, tokens, events and the pool; a run in progress moves it along."""
    import ipywidgets as W  # ipywidgets loads only when a widget is built (a figure needs plotly alone)
    if not recorder.frames:
        recorder.capture()
    recorder.sync()
    frames = recorder.frames
    fig = block_table_figure(frames[-1]["pool"], columns, widget=True)
    info = W.HTML(frame_html(frames[-1]))
    first, last = frames[0]["step"], frames[-1]["step"]
    play = W.Play(min=first, max=last, value=last, interval=800, description="play")
    step = W.IntSlider(min=first, max=last, value=last, description="step")
    W.jslink((play, "value"), (step, "value"))
    def draw(value: int):
        frame = recorder.frame_at(value)
        redraw_grid(fig, frame["pool"], columns)
        info.value = frame_html(frame)
    def follow(index: int, new: bool):
        frame_step = recorder.frames[index]["step"]
        if new:
            play.max = step.max = max(step.max, frame_step)
            if step.value == frame_step:
                draw(frame_step)
            step.value = frame_step  # redraws through the observer
        elif recorder.frame_at(step.value) is recorder.frames[index]:
            draw(step.value)
    step.observe(lambda change: draw(change["new"]), names="value")
    recorder.listeners.append(follow)
    box = W.VBox([W.HBox([play, step]), info, fig])
    box.recorder = recorder
    return box


def live_scheduler_widget(llm, columns: int = 16):
    """:func:`scheduler_widget` recording ``llm`` from now on; ``widget.recorder.sync()`` after the run shows
    the last step's ``finished`` events."""
    return scheduler_widget(EngineRecorder(llm), columns)


# ---- the request timeline -------------------------------------------------------------------------

def request_states(llm, seq_ids=None) -> dict[int, list[tuple[int, str]]]:
    """Per request, ``(step, state)`` from arrival to end, from the trace alone: queued, prefill, decode,
    preempted. The trace logs a prompt's chunks but not its last: prefill ends the first step after the
    last ``chunked`` in which the request was not ``deferred``."""
    by_seq: dict[int, dict[int, list]] = {}
    for ev in llm.trace:
        by_seq.setdefault(ev.seq_id, {}).setdefault(ev.step, []).append(ev)
    out = {}
    for sid in (sorted(llm.seqs) if seq_ids is None else seq_ids):
        seq, events = llm.seqs[sid], by_seq.get(sid, {})
        end = max(events) if seq.is_finished else llm.scheduler.step_count
        phase, pending, states = "queued", False, []  # pending: prompt tokens left after this step
        for k in range(seq.arrival_step + 1, end + 1):
            here = events.get(k, [])
            if phase == "prefill" and not pending:
                phase = "decode"  # the prompt was all computed last step
            elif phase == "prefill" and not any(e.action in ("chunked", "deferred") for e in here):
                pending = False  # the last chunk runs now
            for e in here:
                if e.action == "admitted":
                    phase, pending = "prefill", False
                elif e.action == "chunked" or (e.action == "deferred" and phase == "prefill"):
                    pending = True
                elif e.action == "preempted":
                    phase = "preempted"
            states.append((k, phase))
        out[sid] = states
    return out


def _segments(states: list[tuple[int, str]]) -> list[tuple[str, int, int]]:
    """Runs of one state as ``(state, first step, last step)``; every prefill step is its own chunk."""
    segs: list[list] = []
    for k, s in states:
        if segs and segs[-1][0] == s and s != "prefill" and segs[-1][2] == k - 1:
            segs[-1][2] = k
        else:
            segs.append([s, k, k])
    return [tuple(s) for s in segs]


def request_timeline(llm, seq_ids=None):
    """Gantt chart in engine steps: per request, queued -> prefill chunks -> decode, and preempted spans."""
    states = request_states(llm, seq_ids)
    rows = {sid: f"seq {sid}" for sid in states}
    bars = {s: dict(y=[], x=[], base=[], text=[]) for s in STATES}
    for sid, st in states.items():
        seq = llm.seqs[sid]
        for state, a, b in _segments(st):
            bar = bars[state]
            bar["y"].append(rows[sid])
            bar["x"].append(b - a + 1)  # steps
            bar["base"].append(a - 0.5)  # step k covers k-0.5 .. k+0.5
            bar["text"].append(f"seq {sid} ({len(seq.prompt_token_ids)} prompt + {len(seq.output_token_ids)} "
                               f"output tokens): {state}, steps {a}–{b}")
    fig = go.Figure()
    for state in STATES:
        bar = bars[state]
        # a legend entry for every state even when the run had none of it
        fig.add_trace(go.Bar(y=bar["y"] or [None], x=bar["x"] or [None], base=bar["base"] or [None],
                             orientation="h", name=state, marker_color=STATE_COLORS[state],
                             marker_line=dict(color="#ffffff", width=0.5), hovertext=bar["text"] or None,
                             hoverinfo="text"))
    labels = list(rows.values())
    # the title at the top, the legend between it and the plot: neither sits on the other
    fig.update_layout(barmode="overlay", height=170 + 22 * len(labels), margin=dict(l=10, r=10, t=85, b=40),
                      title=dict(text="Requests over engine steps", y=0.98, yanchor="top"), bargap=0.25,
                      xaxis=dict(title="engine step", zeroline=False),
                      yaxis=dict(categoryorder="array", categoryarray=labels, autorange="reversed", type="category"),
                      legend=dict(orientation="h", y=1.02, x=0, yanchor="bottom", traceorder="normal"))
    return fig


# ---- step times -----------------------------------------------------------------------------------

def step_time_figure(step_stats):
    """Per step: schedule / packing / forward / sample time stacked (ms), and how many sequences ran."""
    steps = [s.step for s in step_stats]
    fig = go.Figure()
    ms = {part: [getattr(s, part) * 1e3 for s in step_stats] for part in PART_COLORS}
    total = sum(map(sum, ms.values())) or 1.0
    small = [p for p in ms if sum(ms[p]) < 0.03 * total]  # too thin to see: one bar, named with its share
    for part, color in PART_COLORS.items():
        if part not in small:
            fig.add_bar(x=steps, y=ms[part], name=f"{part.removesuffix('_s')} ({sum(ms[part]) / total:.0%})",
                        marker_color=color)
    if small:
        fig.add_bar(x=steps, y=[sum(v) for v in zip(*(ms[p] for p in small))], marker_color="#bdc3c7",
                    name=" + ".join(p.removesuffix("_s") for p in small) + f" ({sum(sum(ms[p]) for p in small) / total:.1%})")
    fig.add_scatter(x=steps, y=[s.scheduled for s in step_stats], yaxis="y2", name="sequences in the batch (right axis)",
                    mode="lines+markers", line=dict(color=SHARED, width=1.5, dash="dot"), marker_size=4,
                    customdata=[[s.prefill_tokens, s.decode_tokens] for s in step_stats],
                    hovertemplate="step %{x}: %{y} sequences, %{customdata[0]} prefill + %{customdata[1]} decode "
                                  "tokens<extra></extra>")
    most = max((s.scheduled for s in step_stats), default=1)
    fig.update_layout(barmode="stack", height=400, title=dict(text="Where each step's time goes, against batch size",
                                                              y=0.97, yanchor="top"),
                      xaxis_title="engine step", yaxis=dict(title="ms per step"),
                      yaxis2=dict(title=dict(text="sequences in the batch", font=dict(color=SHARED)), overlaying="y",
                                  side="right", showgrid=False, tickfont=dict(color=SHARED),
                                  dtick=1 if most <= 16 else None, range=[0, most + 1], tickformat="d"),
                      legend=dict(orientation="h", y=1.02, yanchor="bottom", x=0), bargap=0.1, margin=dict(t=110))
    return fig
