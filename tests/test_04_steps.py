"""Notebook 04, section 5's conclusions are computed from the numbers (kvlab/bench/steps.py), with a noise
guard: planted rounds give each verdict, a busy machine gives "too busy to decide" and the recorded quiet
run beside it."""

import pytest

from kvlab.bench import steps as S


def _sweep(short, long, bytes_x=1.5):
    """Rounds of (batch 1, batch 16) ms per context."""
    runs = {}
    for context, rounds in (("short", short), ("1k", long)):
        runs[f"{context} 1"] = [a for a, _ in rounds]
        runs[f"{context} 16"] = [b for _, b in rounds]
    return {"batches": [1, 16], "rounds": len(short), "runs": runs,
            "kv_share": {k: 0.1 for k in runs}, "bytes_x": {"1": 1.0, "16": bytes_x}}


def test_sweep_verdicts_follow_the_numbers():
    quiet = S.sweep_verdicts(_sweep([(50, 60), (52, 61), (49, 58)], [(55, 130), (54, 128), (56, 133)]))
    assert "nearly free" in quiet[0] and "the KV read (and its padded copy) shows" in quiet[1] and "grows more than the bytes" in quiet[2]
    other = S.sweep_verdicts(_sweep([(50, 110), (50, 111), (50, 109)], [(50, 95), (50, 96), (50, 94)], bytes_x=2.5))
    assert "not free" in other[0] and "no dearer" in other[1] and "grows less than the bytes" in other[2]
    busy = S.sweep_verdicts(_sweep([(50, 60), (50, 400), (49, 58)], [(55, 130), (54, 128), (56, 133)]))
    assert len(busy) == 1 and "too busy to decide" in busy[0]


def _chunking(whole, chunked):
    """Rounds of (worst gap ms, ttft s) per budget."""
    def rows(rounds):
        return [dict(worst_gap_ms=g, ttft_s=t, prefill_steps=1, prefill_sum_ms=100.0) for g, t in rounds]
    return {"budgets": [1024, 64], "rounds": {"1024": rows(whole), "64": rows(chunked)}}


def test_chunking_verdicts_need_every_round():
    cut = S.chunking_verdicts(_chunking([(900, 2.0), (950, 2.1), (920, 2.0)], [(300, 2.4), (310, 2.5), (305, 2.3)]))
    assert cut[0].startswith("chunking cut the decoders' longest wait") and cut[1].startswith("chunking delayed")
    mixed = S.chunking_verdicts(_chunking([(900, 2.0), (950, 2.1), (920, 2.0)], [(300, 1.8), (310, 2.5), (305, 2.0)]))
    assert "had no consistent effect on the long prompt's first token" in mixed[1]
    busy = S.chunking_verdicts(_chunking([(900, 2.0), (3000, 2.1), (920, 2.0)], [(300, 2.4), (310, 2.5), (305, 2.3)]))
    assert busy == [busy[0]] and "too busy to decide" in busy[0]


def test_a_busy_run_shows_the_recorded_quiet_one_judged_alike():
    quiet = S.recorded()
    assert {"machine", "date", "sweep", "chunking"} <= set(quiet)
    for key, verdicts in (("sweep", S.sweep_verdicts), ("chunking", S.chunking_verdicts)):
        recorded_lines = verdicts(quiet[key])
        assert not any("too busy" in line for line in recorded_lines)  # the recording itself decided
    busy = _sweep([(50, 60), (50, 400), (49, 58)], [(55, 130), (54, 128), (56, 133)])
    lines = S.judged(S.sweep_verdicts, busy, "sweep")
    assert "too busy" in lines[0] and quiet["machine"] in lines[1]
    assert lines[2:] == ["  " + line for line in S.sweep_verdicts(quiet["sweep"])]
    assert S.judged(S.sweep_verdicts, quiet["sweep"], "sweep") == S.sweep_verdicts(quiet["sweep"])


def test_the_sweep_runs_on_a_model(tiny):
    model, tok = tiny
    prompts = [[5, 6, 7, 8], [9, 10, 11], [12, 13]]
    sweep = S.decode_sweep(model, tok, prompts, list(range(3, 60)), batches=(1, 2), rounds=2, max_tokens=3)
    assert set(sweep["runs"]) == {"short 1", "short 2", "1k 1", "1k 2"} and all(len(r) == 2 for r in sweep["runs"].values())
    assert sweep["bytes_x"]["1"] == pytest.approx(1.0) and sweep["bytes_x"]["2"] > 1
    header, rows = S.sweep_table(sweep)
    assert len(header) == 3 and len(rows) == 2 and all(len(r) == 3 for r in rows) and len(S.sweep_verdicts(sweep)) in (1, 3)
    ch = S.chunking_rounds(model, tok, prompts, list(range(3, 40)), budgets=(64, 8), rounds=2)
    assert set(ch["engines"]) == {64, 8} and len(ch["rounds"]["8"]) == 2
    assert ch["rounds"]["8"][0]["prefill_steps"] > ch["rounds"]["64"][0]["prefill_steps"]  # chunked: more steps


@pytest.mark.parametrize("kw, message", [
    (dict(batches=(16,)), "batches must be two or more"), (dict(batches=(4, 1)), "increasing"),
    (dict(batches=(1, True)), "batches"), (dict(rounds=0), "rounds"), (dict(max_tokens=1), "max_tokens"),
])
def test_decode_sweep_refuses_bad_arguments_before_any_work(tiny, kw, message):
    model, tok = tiny
    with pytest.raises(ValueError, match=message):
        S.decode_sweep(model, tok, [[5, 6]], [3, 4, 5], **kw)


@pytest.mark.parametrize("kw, message", [(dict(budgets=(64,)), "budgets must be two"),
                                         (dict(budgets=(64, 1024)), "chunked budget"), (dict(budgets=(64, 4)), "chunked budget"),
                                         (dict(budgets=("a", 8)), "unchunked budget"), (dict(rounds=-1), "rounds")])
def test_chunking_rounds_refuses_bad_arguments(tiny, kw, message):
    model, tok = tiny
    with pytest.raises(ValueError, match=message):
        S.chunking_rounds(model, tok, [[5, 6]], [3, 4, 5], **kw)


def test_the_summary_line_reads_the_recorded_run_only_where_this_one_was_too_busy():
    quiet = S.recorded()
    assert S.brief(quiet["sweep"], "sweep").startswith("16x the batch costs") and "recorded" not in S.brief(quiet["sweep"], "sweep")
    busy = _sweep([(50, 60), (50, 400), (49, 58)], [(55, 130), (54, 128), (56, 133)])
    assert S.brief(busy, "sweep") == S.brief(quiet["sweep"], "sweep") + " (too busy here: the recorded quiet run)"
    cut = _chunking([(900, 2.0), (950, 2.1), (920, 2.0)], [(300, 2.4), (310, 2.5), (305, 2.3)])
    assert S.brief(cut, "chunking") == ("chunked, the decoders' longest wait 920 -> 305 ms (cut), the prompt's first token "
                                        "2.00 -> 2.40 s (delayed)")
    mixed = _chunking([(900, 2.0), (950, 2.1), (920, 2.0)], [(300, 1.8), (310, 2.5), (305, 2.0)])
    assert S.brief(mixed, "chunking").endswith("2.00 -> 2.00 s (no consistent effect)")
