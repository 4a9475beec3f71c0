"""Notebook 04's build tasks: the checkers name the planted mistakes, and the references plugged into the
real engine through the notebook's own call (LLM(..., rule=...)) schedule exactly as kvlab's own rules do."""

import pytest

from kvlab import check
from kvlab.engine import LLM, SamplingParams
from kvlab.engine.scheduler import admission_rule, chunk_prefills, schedule_decodes


def _oldest_first(running, decoding, append, preempt):
    out = []
    for sid in list(running):
        if sid not in running or sid not in decoding:
            continue
        while not append(sid):
            victim = running[0]
            preempt(victim)
            if victim == sid:
                break
        if sid in running:
            out.append(sid)
    return out


def _never_stops(running, decoding, append, preempt):  # goes on preempting after the sequence preempted itself
    out = []
    for sid in list(running):
        if sid not in running or sid not in decoding:
            continue
        while not append(sid):
            preempt(running[-1])
        out.append(sid)
    return out


def test_admission_rule_checker_names_the_mistakes(capsys):
    assert check.admission_rule(admission_rule)

    def rule(r, m, b, n, f, w, fits=lambda n, room: n <= room, watermark=True, order=("token budget", "seq limit")):
        holds = {"token budget": b <= 0, "seq limit": r >= m}
        reason = next((why for why in order if holds[why]), None)
        if reason:
            return reason
        return None if fits(n, f - (w if r and watermark else 0)) else "no blocks"

    mistakes = {
        "(>, not >=)": lambda *a: rule(*a, fits=lambda n, room: n < room),  # the watermark off by one
        "the watermark stays free": lambda *a: rule(*a, watermark=False),
        "the first in the order 'token budget', 'seq limit', 'no blocks'":
            lambda *a: rule(*a, order=("seq limit", "token budget")),
    }
    for why, fn in mistakes.items():
        capsys.readouterr()
        assert not check.admission_rule(fn)
        out = capsys.readouterr().out
        assert out.startswith("[fail] admission_rule: ") and why in out, out


def test_schedule_decodes_checker_names_the_mistakes(capsys):
    assert check.schedule_decodes(schedule_decodes)
    mistakes = {
        "preempted itself: stop there": _never_stops,
        "preempt the most recently admitted": _oldest_first,
        "no room is not a reason to skip": lambda running, decoding, append, preempt:
            [s for s in list(running) if s in decoding and append(s)],
        "still prefilling": lambda running, decoding, append, preempt: [s for s in list(running) if append(s)],
    }
    for why, fn in mistakes.items():
        capsys.readouterr()
        assert not check.schedule_decodes(fn)
        out = capsys.readouterr().out
        assert out.startswith("[fail] schedule_decodes: ") and why in out, out


def test_chunk_prefills_checker_names_the_mistakes(capsys):
    assert check.chunk_prefills(chunk_prefills)
    for why, fn in {"the budget is shared": lambda u, b: [min(n, b) for n in u],
                    "takes a chunk of what is left": lambda u, b: [n if n <= b - sum(u[:i]) else 0 for i, n in enumerate(u)],
                    "more than it still needs": lambda u, b: [b] * len(u),
                    "one number per prefill": lambda u, b: [c for c in chunk_prefills(u, b) if c],
                    "in order: each prefill takes all it needs": lambda u, b: chunk_prefills(u[::-1], b)[::-1]}.items():
        capsys.readouterr()
        assert not check.chunk_prefills(fn)
        out = capsys.readouterr().out
        assert out.startswith("[fail] chunk_prefills: ") and why in out, out


def _serve(model, **rules):
    prompts = [[5 + i, 17, 3, 9, 11, 2, 8, 4, 6, 1, 12, 13][: 6 + i] for i in range(6)]
    llm = LLM(model, None, num_blocks=6, block_size=4, max_num_seqs=4, max_num_batched_tokens=12,
              attn_backend="reference", **rules)
    out = llm.generate(prompts, SamplingParams(max_tokens=9, ignore_eos=True))
    return [o.token_ids for o in out], [(e.step, e.seq_id, e.action, e.reason) for e in llm.trace]


def test_the_references_plugged_into_the_engine_schedule_as_its_own_rules(tiny):
    model, _ = tiny
    own_tokens, own_trace = _serve(model)
    assert any(e[2] == "preempted" for e in own_trace) and any(e[2] == "chunked" for e in own_trace)
    plugged = _serve(model, admission_rule=admission_rule, schedule_decodes=schedule_decodes,
                     chunk_prefills=chunk_prefills)
    assert plugged == (own_tokens, own_trace)


def test_a_wrong_rule_plugged_in_is_refused_by_name(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="chunk_prefills.*together at most the budget"):
        _serve(model, chunk_prefills=lambda u, b: list(u))
    with pytest.raises(ValueError, match="schedule_decodes returned"):
        _serve(model, schedule_decodes=lambda running, decoding, append, preempt: [])
    with pytest.raises(TypeError, match="schedule_decodes must be a function"):
        LLM(model, None, num_blocks=6, block_size=4, schedule_decodes="tail")
