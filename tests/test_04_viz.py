"""Notebook 04's pictures: they build, the slider moves them, and they agree with what the engine did."""

import random

import pytest

from kvlab.engine import LLM, SamplingParams
from kvlab.viz import engine as ev


def _run(tiny, policy="continuous", seed=0, n=6, record=True):
    """6 requests of 5-40 tokens on a 16-block pool: chunking and preemption both happen."""
    model, tok = tiny
    llm = LLM(model, tok, num_blocks=16, block_size=4, max_num_seqs=3, max_num_batched_tokens=16, policy=policy)
    rng = random.Random(seed)
    for _ in range(n):
        prompt = [rng.randrange(3, model.config.vocab_size) for _ in range(rng.randint(5, 40))]
        llm.add_request(prompt, SamplingParams(max_tokens=rng.randint(4, 20), ignore_eos=True))
    rec = ev.EngineRecorder(llm) if record else None
    for _ in llm.iter_steps():
        pass
    return llm, rec


@pytest.fixture(scope="module")
def run(tiny):
    llm, rec = _run(tiny)
    actions = {e.action for e in llm.trace}
    assert {"chunked", "preempted"} <= actions  # the run shows what the widgets are for
    return llm, rec


def _parts(w):
    play, step = w.children[0].children
    return play, step, w.children[1], w.children[2]


def test_recorder_frames_match_the_engine(run):
    llm, rec = run
    rec.sync()
    assert [f["step"] for f in rec.frames] == [s.step for s in llm.step_stats]
    for f, s in zip(rec.frames, llm.step_stats):
        assert sum(x["tokens"] for x in f["scheduled"] if x["kind"] == "prefill") == s.prefill_tokens
        assert sum(x["tokens"] for x in f["scheduled"] if x["kind"] == "decode") == s.decode_tokens
        assert len(f["scheduled"]) == s.scheduled
        assert {x["seq_id"] for x in f["scheduled"]} <= set(f["running"])
        assert not set(f["waiting"]) & set(f["running"]) and not set(f["running"]) & set(f["finished"])
        assert len(f["pool"]["blocks"]) == 16 and "tables" not in f["pool"]
        assert [(e["seq_id"], e["action"]) for e in f["events"]] == \
            [(e.seq_id, e.action) for e in llm.trace if e.step == f["step"]]
    assert rec.frames[-1]["events"][-1]["action"] == "finished"  # joined after the last forward


def test_slider_moves_grid_and_html(run):
    llm, rec = run
    w = ev.scheduler_widget(rec, columns=8)
    play, step, info, fig = _parts(w)
    assert (step.min, step.max, step.value) == (1, len(llm.step_stats), len(llm.step_stats))
    assert play.max == step.max and len(fig.data[0].z) == 2  # 16 blocks in 8 columns
    pre = next(e.step for e in llm.trace if e.action == "preempted")
    step.value = 1
    z1, html1 = [list(r) for r in fig.data[0].z], info.value
    assert "<b>step 1</b>" in html1 and "admitted" in html1
    step.value = pre
    assert [list(r) for r in fig.data[0].z] != z1 and info.value != html1
    assert f"<b>step {pre}</b>" in info.value and "preempted" in info.value and "↺" in info.value


def test_live_widget_follows_each_step(tiny):
    model, tok = tiny
    llm = LLM(model, tok, num_blocks=16, block_size=4, max_num_seqs=2, max_num_batched_tokens=8)
    for n in (12, 5, 9):
        llm.add_request(list(range(3, 3 + n)), SamplingParams(max_tokens=4, ignore_eos=True))
    w = ev.live_scheduler_widget(llm)
    play, step, info, fig = _parts(w)
    assert (step.min, step.max, step.value) == (0, 0, 0) and "before step 1" in info.value
    assert "waiting (3)" in info.value
    for stats, _ in llm.iter_steps():
        assert step.max == step.value == stats.step == play.max
        assert f"<b>step {stats.step}</b>" in info.value
    w.recorder.sync()
    assert "finished</span> seq" in info.value  # the last step's finished event, shown in place
    assert "finished (2)" in info.value  # queues as the last forward saw them
    w.recorder.detach()
    assert llm.on_scheduled is None


def _recorded_states(rec):
    """What each request did per step according to the scheduled batches the recorder saw."""
    out, preempted = {}, set()
    for f in rec.frames:
        sched = {x["seq_id"]: x["kind"] for x in f["scheduled"]}
        preempted |= {e["seq_id"] for e in f["events"] if e["action"] == "preempted"}
        for sid in f["waiting"]:
            out.setdefault(sid, []).append((f["step"], "preempted" if sid in preempted else "queued"))
        for sid in f["running"]:
            out.setdefault(sid, []).append((f["step"], sched.get(sid, "prefill")))
    return out


@pytest.mark.parametrize("policy,seed", [("continuous", 0), ("continuous", 1), ("static", 2)])
def test_timeline_states_from_trace_match_the_batches(tiny, policy, seed):
    llm, rec = _run(tiny, policy, seed)
    rec.sync()
    assert ev.request_states(llm) == _recorded_states(rec)


def test_timeline_one_row_per_request(run):
    llm, _ = run
    fig = ev.request_timeline(llm)
    assert [t.name for t in fig.data] == list(ev.STATES)
    rows = {y for t in fig.data for y in t.y if y is not None}
    assert rows == {f"seq {i}" for i in llm.seqs}
    assert list(fig.layout.yaxis.categoryarray) == [f"seq {i}" for i in sorted(llm.seqs)]
    # every request's bars tile its steps from arrival to finish, with no gap or overlap
    for sid, seq in llm.seqs.items():
        spans = sorted((b + 0.5, b + 0.5 + x - 1) for t in fig.data if t.y[0] is not None
                       for y, x, b in zip(t.y, t.x, t.base) if y == f"seq {sid}")
        finish = next(e.step for e in llm.trace if e.seq_id == sid and e.action == "finished")
        assert spans[0][0] == seq.arrival_step + 1 and spans[-1][1] == finish
        assert all(b[0] == a[1] + 1 for a, b in zip(spans, spans[1:]))
    preempted = next(t for t in fig.data if t.name == "preempted")
    assert sum(preempted.x) > 0
    two = ev.request_timeline(llm, seq_ids=[0, 5])
    assert {y for t in two.data for y in t.y if y is not None} == {"seq 0", "seq 5"}
    assert two.layout.height < fig.layout.height


def test_step_time_figure(run):
    llm, _ = run
    fig = ev.step_time_figure(llm.step_stats)
    bars = [t for t in fig.data if t.type == "bar"]
    forward = next(b for b in bars if b.name.startswith("forward ("))  # the forward pass has a bar of its own
    assert fig.layout.barmode == "stack"
    s = llm.step_stats[3]
    assert forward.y[3] == pytest.approx(s.forward_s * 1e3)
    # every part is drawn, those under 3 % of the time together in one bar named after them
    parts = (s.schedule_s, s.packing_s, s.forward_s, s.sample_s)
    assert sum(b.y[3] for b in bars) == pytest.approx(sum(parts) * 1e3)
    named = " ".join(b.name for b in bars)
    assert all(p in named for p in ("schedule", "packing", "forward", "sample"))
    line = fig.data[-1]
    assert line.yaxis == "y2" and list(line.y) == [s.scheduled for s in llm.step_stats]
