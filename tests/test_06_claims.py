"""The claims table (kvlab/claims/): verdicts follow measurements, every claim points to a section
that exists, and the CLI prints the same rows."""

import html
import json
import os
import re
from pathlib import Path
from types import SimpleNamespace

import torch

import pytest

from kvlab import claims
import kvlab.claims.rules  # noqa: F401  (claims.rules.recording)
from kvlab.cli import main

NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
NO_MODEL = ["kv-7b", "weights-7b", "kv-1mb", "a100-half", "kv-70b", "decode-1ms", "int8-half", "int4-quarter",
            "24-to-16gb", "b32-16k-fits", "22ms-step", "16ms-step", "12-7ms", "int8-39pct", "unfused", "static-30", "static-50", "paged-90",
            "frag-5-10", "util-30-80", "zero-guard"] + [c.id for c in claims.CLAIMS
                                                            if c.measure.__module__ == "kvlab.claims.arithmetic"] + [
            "per-channel-code"]


def _headings(notebook: str) -> set[str]:
    nb = json.loads((NOTEBOOKS / f"{notebook}.ipynb").read_text())
    out = set()
    for cell in nb["cells"]:
        if cell["cell_type"] == "markdown":
            for line in "".join(cell["source"]).splitlines():
                m = re.match(r"#+\s+(.*)", line)
                if m:
                    out.add(m.group(1).strip())
    return out


def test_at_least_twenty_claims_with_unique_ids_from_the_three_articles():
    assert len(claims.CLAIMS) >= 20
    assert len({c.id for c in claims.CLAIMS}) == len(claims.CLAIMS)
    assert {c.article for c in claims.CLAIMS} == {"000", "003", "004"}


@pytest.mark.parametrize("claim", claims.CLAIMS, ids=lambda c: c.id)
def test_every_claim_points_to_a_section_that_exists(claim):
    assert (NOTEBOOKS / f"{claim.notebook}.ipynb").exists(), claim.notebook
    assert claim.section in _headings(claim.notebook), f"{claim.notebook} has no heading {claim.section!r}"


def test_verdict_rules():
    """Each rule kind, a measurement planted on each side of its tolerance: both verdicts, in the four words."""
    W = claims.rules.detail
    # ratio: ±15 % by default
    assert claims.ratio(1.0, 1.14) == "holds" and claims.ratio(1.0, 1.16) == "wrong"
    assert W(claims.ratio(2**20, 2**19)) == "off by 2.0× (±15% allowed)" and W(claims.ratio(1, 2, tol=0)) == "off by 2.0×"
    # in_range: the range itself is the tolerance
    assert claims.in_range(5, 20, 5) == "holds" and claims.in_range(5, 20, 4.9) == "wrong"
    assert W(claims.in_range(5, 20, 2.5)) == "off by 2.0× below the range"
    assert W(claims.in_range(5, 20, 60)) == "off by 3.0× above the range"
    assert claims.in_range(5, 20, 21.9, tol=0.1) == "holds" and claims.in_range(5, 20, 22.1, tol=0.1) == "wrong"
    assert claims.in_range(0.5, 1.5, -0.3) == "wrong"
    # truth
    assert claims.truth(True) == "holds" and claims.truth(False) == "wrong"
    # cost_range: meets the range, above it (wrong), below it (partly: a smaller cost)
    assert claims.cost_range(0.5, 1.5, 0.2, (0.1, 0.6)) == "holds"
    assert claims.cost_range(0.5, 1.5, 3.0, (2.0, 4.0)) == "wrong"
    assert claims.cost_range(0.5, 1.5, -0.3, (-0.6, 0.49)) == "partly"
    # shown: the bytes refute, a run confirms, a bound alone is not checkable here
    assert claims.shown(False, False) == "wrong" and claims.shown(True, True) == "holds"
    assert claims.shown(True, False) == "not checkable here"
    # margin: 10 % slack below the limit is partly
    assert claims.margin(16.1, 16) == "holds" and claims.margin(15, 16) == "partly" and claims.margin(14, 16) == "wrong"
    # parts: both, one, neither
    assert claims.parts(True, True, "a", "b") == "holds" and claims.parts(False, False, "a", "b") == "wrong"
    assert claims.parts(False, True, "a", "b") == "partly" and W(claims.parts(False, True, "a", "b")) == "holds b, not a"
    # judged_on keeps the word and says where it was measured
    v = claims.judged_on(claims.ratio(3, 6), "SmolLM2", "a 7B")
    assert v == "wrong" and W(v) == "off by 2.0× (±15% allowed), on SmolLM2 (claimed for a 7B)"
    assert claims.judged_on(claims.truth(True)) == "holds"
    for v in ("holds", "partly", "wrong", "not checkable here"):
        assert claims.corrected(v) == (v in ("partly", "wrong"))
    with pytest.raises(ValueError, match="verdict must be one of"):
        claims.rules.Verdict("not settled")
    with pytest.raises(ValueError, match="positive"):
        claims.ratio(0, 1)
    with pytest.raises(ValueError, match="lo <= hi"):
        claims.in_range(3, 1, 2)


def _lab(kl_absmax, kl_p999, kl_k4v8=0.02, kl_k8v4=0.003, delta=0.3, top1=0.995):
    """A stand-in for the SmolLM2 measurements: the verdicts must follow whatever is measured."""
    cfg = lambda kl, **kw: dict(kl=kl, ppl=10.0, delta_ppl_pct=kw.get("delta", 0.0), top1=kw.get("top1", 1.0),
                                k_clip_rate=0.0, delta_ppl_ci95=(kw.get("delta", 0.0) - 0.05, kw.get("delta", 0.0) + 0.05))
    return SimpleNamespace(quality={"ppl_fp": 10.0, "scored": 100, "configs": {
        "int8": cfg(kl_absmax, delta=delta, top1=top1), "int8 p99.9": cfg(kl_p999),
        "k4v8": cfg(kl_k4v8), "k8v4": cfg(kl_k8v4)}}, sensitivity=[0.9, 0.1, 0.2, 0.3, 0.05, 0.8],
        answers={"identical": 10, "requests": 16, "prefix_share": 0.7})


def test_verdicts_are_computed_from_the_measurements_not_typed_in():
    by_id = {c.id: c for c in claims.CLAIMS}
    W = claims.rules.detail
    # the article's own measurement on its own model: judged on SmolLM2, and the verdict says so (the one rule)
    p999 = by_id["p999"].measure(_lab(0.002, 0.001))[1]
    assert p999 == "holds" and W(p999) == "on SmolLM2 (claimed for the article's own model)"
    assert by_id["p999"].measure(_lab(0.001, 0.002))[1] == "wrong"
    assert by_id["k-over-v"].measure(_lab(0.001, 0.002))[1] == "holds"
    assert by_id["k-over-v"].measure(_lab(0.001, 0.002, kl_k4v8=0.001, kl_k8v4=0.01))[1] == "wrong"
    # claims made for a 7B, measured on SmolLM2: judged there
    assert by_id["ppl-0.5-1.5"].measure(_lab(0.001, 0.002, delta=1.0))[1] == "holds"
    assert by_id["ppl-0.5-1.5"].measure(_lab(0.001, 0.002, delta=0.1))[1] == "partly"  # a smaller cost
    wrong = by_id["ppl-0.5-1.5"].measure(_lab(0.001, 0.002, delta=3.0))[1]
    assert wrong == "wrong" and W(wrong) == "off by 2.0× above the range, on SmolLM2 (claimed for a 7B model)"
    assert by_id["ppl-0.1"].measure(_lab(0.001, 0.002, delta=0.5))[1] == "holds"
    assert by_id["ppl-0.1"].measure(_lab(0.001, 0.002, delta=2.0))[1] == "wrong"
    assert by_id["negligible"].measure(_lab(0.001, 0.002, top1=0.9))[1] == "wrong"
    assert by_id["first-last"].measure(_lab(0.001, 0.002))[1] == "holds"  # layers 0 and 5 rank 1 and 2 of 6


def test_model_free_claims_run_and_count():
    rows = claims.run(ids=NO_MODEL)
    assert [r["id"] for r in rows] == NO_MODEL
    verdict = {r["id"]: r["verdict"] for r in rows}
    assert verdict["kv-7b"] == "holds" and verdict["kv-1mb"] == "wrong" and verdict["b32-16k-fits"] == "wrong"
    assert {r["id"]: r for r in rows}["kv-1mb"]["why"].startswith("off by 2.0× (±15% allowed); ")
    c = claims.counts(rows)
    assert set(c) == {"claims", *claims.VERDICTS}
    assert sum(c[v] for v in claims.VERDICTS) == c["claims"] == len(NO_MODEL)
    index = claims.format_index(rows).splitlines()
    assert len(index) == len(rows) and all(len(line) <= 110 for line in index)
    assert index[0].startswith(" 1. ") and index[0][4] in "✓~✗?"
    grouped = claims.format_grouped(rows).splitlines()
    heads = [line for line in grouped if not line.startswith(" ") and ":" in line][:-1]
    assert [h.split(" ", 1)[1].rsplit(":", 1)[0] for h in heads] == [v for v in claims.VERDICTS if c[v]]
    assert all(int(h.rsplit(": ", 1)[1]) == c[h.split(" ", 1)[1].rsplit(":", 1)[0]] for h in heads)
    assert len(grouped) == len(rows) + len(heads) + 1 and grouped[-1] == claims.count_line(rows)
    with pytest.raises(ValueError, match="numbers"):
        claims.format_table(rows, numbers=[1])
    assert claims.format_table(rows[:1], numbers=[7]).startswith(" 7. ")
    text = claims.format_table(rows)
    assert text.count("\n      verdict ") == len(NO_MODEL) and text.splitlines()[-1] == claims.count_line(rows)
    # the notebooks' widget: the same rows, every field escaped, numbered as given, the count line last
    from kvlab.viz.claims import claims_html, claims_widget
    page = claims_html(rows)
    assert page.count("<tr>") == len(rows) + 1 and page.endswith(f"<b>{html.escape(claims.count_line(rows))}</b></p>")
    for r in rows:
        assert html.escape(r["claim"]) in page and html.escape(r["why"]) in page
    planted = dict(rows[0], claim="<b>x</b> & y")
    assert "&lt;b&gt;x&lt;/b&gt; &amp; y" in claims_html([planted])
    assert "<td style='padding:4px 8px;vertical-align:top;border-bottom:1px solid #e5e7e9'>7</td>" in claims_html(rows[:1], numbers=[7])
    with pytest.raises(ValueError, match="numbers"):
        claims_html(rows, numbers=[1])
    assert claims_widget(rows).value == page
    # claims.show's pieces: a verdict line each (the why only where nothing folds it), the fold holds both
    short = claims.format_verdicts(rows, why=False).splitlines()
    assert len(short) == len(rows) and all(" — " not in line for line in short)
    assert all(line.endswith(r["verdict"].upper()) for line, r in zip(short, rows))
    assert all(r["why"] in line for line, r in zip(claims.format_verdicts(rows).splitlines(), rows))
    fold = claims.why_html([planted])
    assert fold.startswith("<details>") and "&lt;b&gt;" not in fold  # the claim is not in it; measured and why are
    assert html.escape(planted["measured"]) in fold and html.escape(planted["why"]) in fold


def test_notebook_tables_are_escaped_and_refuse_ragged_rows():
    from kvlab.viz import table
    from kvlab.viz.render import table_html
    page = table_html(["policy", "share"], [["<max>", "26.9%"], ["paged", 98.7]], caption="a & b")
    assert page.count("<tr>") == 3 and "&lt;max&gt;" in page and "a &amp; b" in page
    assert "text-align:right'>98.7<" in page and "text-align:left'>&lt;max&gt;<" in page
    assert table(["a"], [[1]]).data == table_html(["a"], [[1]])
    with pytest.raises(ValueError, match=r"rows must each have 2 cells .* rows \[1\]"):
        table_html(["a", "b"], [[1, 2], [3]])


def test_run_refuses_unknown_ids():
    with pytest.raises(ValueError, match="unknown claim id"):
        claims.run(ids=["kv-7b", "nope"])


def test_run_shows_its_progress_and_refuses_a_wrong_progress():
    seen = []
    rows = claims.run(ids=["kv-7b", "kv-1mb"], progress=seen.append)
    assert seen == ["kv-7b", "kv-1mb"] == [r["id"] for r in rows]
    assert claims.run(ids=["kv-7b"], progress=False)[0]["id"] == "kv-7b"  # no bar
    with pytest.raises(TypeError, match="progress must be True, False, None or a function"):
        claims.run(ids=["kv-7b"], progress="yes")


def test_without_the_peer_the_vllm_rows_say_which_recorded_version_they_read(monkeypatch):
    """Issue 57 item 2: the rows vLLM's options decide read them from the installed peer
    (tests/test_peer_vllm.py); with none, or one that fails, from the pinned version's record, saying so."""
    from kvlab.bench import vllm_peer
    ids = ["int8-in-frameworks", "kv-dtype-per-layer"]
    monkeypatch.setattr(vllm_peer, "peer_python", lambda: None)
    vllm_peer.kv_cache_options.cache_clear()
    try:
        rows = claims.run(ids=ids)
        assert all("vLLM 0.32.0 as recorded (no peer installed here)" in r["measured"] for r in rows), rows
        assert [r["verdict"] for r in rows] == ["partly", "holds"]  # table order: kv-dtype-per-layer first
        monkeypatch.setattr(vllm_peer, "peer_python", lambda: "python-of-a-broken-peer")
        monkeypatch.setattr(vllm_peer, "run_worker", lambda *a, **k: (_ for _ in ()).throw(vllm_peer.PeerError("boom")))
        vllm_peer.kv_cache_options.cache_clear()
        assert vllm_peer.kv_cache_options()["source"] == "0.32.0 as recorded (the installed peer failed: boom)"
    finally:
        vllm_peer.kv_cache_options.cache_clear()


def test_cli_claims_json(capsys):
    assert main(["claims", "--json", "--only", "kv-7b,static-30,unfused"]) == 0
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    if not os.environ.get("TQDM_DISABLE"):
        assert "claims: 100%" in captured.err and "3/3" in captured.err  # the bar, on stderr, beside the JSON
    assert [r["id"] for r in out["claims"]] == ["kv-7b", "unfused", "static-30"]  # in table order
    assert out["counts"]["claims"] == 3 and {"measured", "verdict", "why", "rule", "tolerance", "notebook",
                                             "section"} <= set(out["claims"][0])


def test_cli_claims_bad_id(capsys):
    assert main(["claims", "--only", "nope"]) == 2
    assert "unknown claim id" in capsys.readouterr().err


def test_every_row_carries_the_rule_and_tolerance_it_was_judged_by():
    rows = claims.run(ids=NO_MODEL)
    for r in rows:
        assert r["rule"] != "none" and r["tolerance"], r["id"]  # no verdict typed in
    by_id = {r["id"]: r for r in rows}
    assert by_id["kv-7b"]["rule"] == "ratio x5" and by_id["kv-7b"]["tolerance"] == "within ±15% of the claimed figure"
    assert by_id["util-30-80"]["rule"] == "in_range x2, parts, judged_on" and "[0.3, 0.4]" in by_id["util-30-80"]["tolerance"]
    assert by_id["24-to-16gb"]["rule"] == "margin"
    assert claims.format_table(rows).count("\n      rule ") == len(rows)
    with claims.rules.recording() as calls:
        claims.ratio(2.0, 2.1, tol=0.1)
        claims.in_range(1, 2, 3)
    assert claims.rules.summarize(calls) == ("ratio, in_range", "within ±10% of the claimed figure; in [1, 2]")
    assert claims.rules.summarize([])[0] == "none"


def test_no_notebook_cites_a_path_outside_the_project():
    """A learner's clone must carry what it cites: the source articles are not in the project, so the
    notebooks quote them and point to `kvlab claims`, never to a folder beside the repository."""
    outside = re.compile(r"shared/seeds|\.\./|(?<![\w.])/(work|home|root|tmp)/")
    for path in sorted(NOTEBOOKS.glob("*.ipynb")) + sorted((NOTEBOOKS.parent / "docs").glob("*.md")):
        text = path.read_text() if path.suffix == ".md" else "".join(
            "".join(c["source"]) for c in json.loads(path.read_text())["cells"])
        hits = sorted({m.group(0) for m in outside.finditer(text)})
        assert not hits, f"{path.name} cites {hits}"


# every arithmetic/reasoning rule, with a planted measurement that must flip its verdict (a rule that
# cannot fail is not a check): claim id -> keyword arguments of its measuring function
PLANTED = {
    "decode-memory-bound": dict(batch=512, context=1),  # 512 tokens share each weight read: compute-bound
    "prefill-compute-bound": dict(prompt=16),
    "l2-threshold": dict(weights=2**20),
    "zero-fragmentation": dict(lengths=[16, 32, 48]),
    "per-block-scales-50": dict(head_dim=1),
    "deferred-quant": dict(resident="int8"),
    "low-concurrency": dict(batch=32),
    "no-cache-realtime": dict(context=100),
    "kv-linear-batch": dict(batches=(1, 2), sizes=[1, 3]),
    "70b-one-card": dict(hbm=200 * 2**30),
    "swa-caps-memory": dict(window=2**20),
    "spec-ttft": dict(with_draft=1.0),
    "mla-smaller": dict(mla=10**9),
    "8k-16k-need-quant": dict(card=16 * 2**30),
    "int8-bigger-batch": dict(int8=9),
    "layer-16kb": dict(per_layer=64 * 2**10),
    "bandwidth-linear": dict(batches=(1, 2), steps=[dict(kv=1, weights=5), dict(kv=3, weights=5)]),
    "test-model-shape": dict(d=5120),
    "latency-throughput": dict(ms=(22.0, 10.0)),
    "saved-is-transfer": dict(claimed_ms=16.3),  # the step saves 5.7 ms, within 15 % of the 5 ms of reads
    "gate-1pct": dict(rise=0.015),
    "unfused-fp16-copy": dict(temp_bytes=0),
    "pool-halves": dict(sized_by="tokens"),
    "gain-above-4k": dict(batch=1),
    "k8v4-lower": dict(k8v4=10**12),
    "finer-scales-cost": dict(extra=0.0),
    "hbm-sram": dict(hbm=1.5e12),  # the A100 40 GB's HBM
    "kv-heads": dict(model="llama-2-7b"),  # multi-head: as many KV heads as attention heads
    "no-cache-quadratic": dict(cached=True),
    "block-16": dict(vllm={"default_block_size": 32}),
    "sym-one-multiply": dict(ops={"symmetric": ("cvt", "mul"), "asymmetric": ("cvt", "sub", "mul")}),
    "kv-dtype-per-layer": dict(vllm={"skip_layers": False}),  # one dtype, no layer exempt: wrong (else partly)
    "first-last-saving": dict(kept=0),
    "int4-half-again": dict(group=32, scale_dtype="fp32"),  # kvlab's own layout: judged so, it misses
    "ttft-quant": dict(extra_per_token=2**30),
    "dequant-one-fma": dict(ops={"fp16": 1}),
    "int8-in-frameworks": dict(vllm={"kv_cache_dtypes": ["auto", "fp8"]}),  # vLLM 0.11-0.13's list: partly
    "fp8-flag": dict(flag="int8_per_token_head"),  # a flag vLLM reads as INT8
    "fp8-native": dict(gpus=("A100", "H100")),
}


def test_every_arithmetic_rule_flips_on_a_planted_measurement():
    arith = [c for c in claims.CLAIMS if c.measure.__module__ == "kvlab.claims.arithmetic"]
    assert {c.id for c in arith} == set(PLANTED)
    for c in arith:
        _, verdict, _ = c.measure(None)
        _, planted, _ = c.measure(None, **PLANTED[c.id])
        assert planted != verdict, (c.id, verdict, planted)
        assert c.quote and c.article in ("000", "003", "004"), c.id


def test_every_claim_quotes_its_article():
    # the seeds are not in the project: the quotes' text is checked against them outside the tests
    for c in claims.CLAIMS:
        assert c.quote and c.article in ("000", "003", "004"), c.id


def test_claims_about_another_model_or_workload_follow_the_one_rule():
    """Measured on what the lab runs, judged there, the why saying so: never 'not settled', never a bare verdict."""
    import inspect

    on_lab = ["static-30", "static-50", "paged-90", "paged-near-100", "prefix-40-60", "util-30-80", "10-30ms",
              "cache-5-20x", "granularity", "3-bits", "p999", "ppl-0.1", "ppl-0.5-1.5", "negligible", "k-over-v",
              "first-last", "saturation"]
    by_id = {c.id: c for c in claims.CLAIMS}
    for cid in on_lab:  # each measuring function passes its verdict through judged_on
        assert "judged_on(" in inspect.getsource(by_id[cid].measure), cid
    # a claim about models the lab cannot run (trained with a window): shown here, or not checkable here
    window = lambda w: SimpleNamespace(passkey={"full": dict(correct=4, n=4, prompt_tokens=540),  # noqa: E731
                                                "window": dict(correct=w, n=4, prompt_tokens=540)})
    fails, shows = (by_id["swa-documents"].measure(window(w))[1] for w in (0, 4))
    assert fails == "not checkable here" and "fails on SmolLM2 with a window imposed" in claims.rules.detail(fails)
    assert shows == "holds"
    rows = {r["id"]: r for r in claims.run(ids=["util-30-80", "static-30", "paged-90", "gain-above-4k"])}
    for cid in ("util-30-80", "static-30", "paged-90"):
        assert "judged_on" in rows[cid]["rule"] and " (claimed for " in rows[cid]["why"], cid
    assert "seat occupancy" in rows["util-30-80"]["why"]
    # a gain is never 'holds' from an upper bound alone
    assert rows["gain-above-4k"]["verdict"] == "not checkable here"
    assert by_id["gain-above-4k"].measure(None, measured=1.35)[1] == "holds"
    assert by_id["gain-above-4k"].measure(None, measured=1.1)[1] == "not checkable here"


def test_the_table_has_seventy_rows_or_more_each_with_a_verdict_word_why_rule_and_tolerance(capsys):
    assert len(claims.CLAIMS) >= 70
    assert main(["claims", "--json", "--only", ",".join(NO_MODEL)]) == 0
    out = json.loads(capsys.readouterr().out)
    for r in out["claims"]:
        assert r["verdict"] in claims.VERDICTS, r["id"]
        assert r["why"] and r["rule"] != "none" and r["tolerance"], r["id"]
        assert "\n" not in r["why"] and "not settled" not in r["why"], r["id"]


def test_the_five_corrected_verdicts():
    """Issue 45: the verdicts the articles' own words settle, each with the measurement that decides it."""
    by_id = {c.id: c for c in claims.CLAIMS}
    # zero-fragmentation: 「零碎片」 is zero; each sequence's last block keeps ~7.5 empty slots (lengths 1-2048)
    measured, v, _ = by_id["zero-fragmentation"].measure(None)
    assert v == "wrong" and "7.5 slots stay empty" in measured
    assert by_id["zero-fragmentation"].measure(None, lengths=[16, 32, 48])[1] == "holds"  # no partial block: zero
    # pool-halves: the reserved bytes (the next clause): vLLM sizes the pool by bytes, so they do not halve
    measured, v, _ = by_id["pool-halves"].measure(None)
    assert v == "wrong" and "16 GiB vs 16 GiB" in measured
    assert by_id["pool-halves"].measure(None, sized_by="tokens")[1] == "holds"
    # round-even: truncation biases (holds); half-to-even vs half-away: no exact ties, no difference (does not)
    assert by_id["round-even"].measure(SimpleNamespace(kv=_kv("plain")))[1] == "partly"
    assert by_id["round-even"].measure(SimpleNamespace(kv=_kv("ties")))[1] == "holds"  # ties: half-away biases
    assert by_id["round-even"].measure(SimpleNamespace(kv=_kv("grid")))[1] == "wrong"  # on the grid: nothing to round
    # int8-39pct: measured at 32 x 16K, which cannot fit an 80 GB card
    measured, v, _ = by_id["int8-39pct"].measure(None)
    assert v == "wrong" and "32 x 16K of the article's 7B" in measured and "needs 269 GiB" in measured
    # l2-threshold: the cache does pass the L2 (~80 tokens); the threshold marks nothing (weights 321x the L2)
    measured, v, _ = by_id["l2-threshold"].measure(None)
    assert v == "partly" and "holds 80 tokens" in measured and "321x" in measured


def _quality_lab(**over):
    """A stand-in Lab whose measurements are planted: each field a claim reads, set by hand."""
    cfg = lambda kl=0.001, top1=0.995, delta=0.2: dict(kl=kl, ppl=10.0, delta_ppl_pct=delta, top1=top1,
                                                         k_clip_rate=0.001, delta_ppl_ci95=(delta - 0.05, delta + 0.05))
    base = dict(
        quality={"ppl_fp": 10.0, "scored": 383, "configs": {"int8": cfg(), "int8 p99.9": cfg(kl=0.002),
                                                            "k4v8": cfg(kl=0.02), "k8v4": cfg(kl=0.003)}},
        saturation={"configs": {"static": cfg(kl=0.003, top1=0.97), "corrected": cfg(kl=0.0015)}},
        seed_shares={w: {"max": [0.2, 0.25, 0.31], "oracle": [0.6, 0.62, 0.7], "paged": [0.95] * 3}
                     for w in ("sharegpt", "alpaca")},
        step_ms={("short", 1): 10.0, ("short", 16): 12.0, ("1k", 1): 10.0, ("1k", 16): 30.0},
        speedups=[{"prompt_tokens": 32, "speedup": 2.0}, {"prompt_tokens": 256, "speedup": 6.0}],
        sensitivity=[0.9, 0.1, 0.2, 0.3, 0.05, 0.8])
    base.update(over)
    return SimpleNamespace(**base)


def _kv(kind: str):
    """Planted K/V tensors (layers of (T, H, D)): "tails" has long-tailed key heads with outlier channels,
    "plain" is Gaussian, "flat" has the same value everywhere (no granularity can beat another), "grid" values that
    already sit on the INT8 grid (truncation costs nothing), "heads-grid" each head on its own grid (a per-head
    scale is exact, a per-channel or per-tensor one is not), "ties" values half-way between two INT8 steps
    (half-away-from-zero biases them, half-to-even does not)."""
    g = torch.Generator().manual_seed(0)
    if kind == "ties":
        k = torch.randint(-126, 126, (64, 2, 16), generator=g).float() + 0.5
        k[0, :, 0] = 127.0  # scale 1: every other value sits on a tie
        return [k] * 6, [k] * 6
    if kind == "grid":
        k = torch.randint(-126, 127, (64, 2, 16), generator=g).float()
        k[0, :, 0] = 127.0  # every head's abs-max is 127: scale 1, every value an integer
        return [k] * 6, [k] * 6
    if kind == "heads-grid":  # head h on a grid of step 2^-h, its abs-max in channel 0 only: per-head is exact
        k = torch.randint(-100, 101, (64, 2, 16), generator=g).float()
        k[0, :, 0] = 127.0
        k[:, 1] *= 0.5
        return [k] * 6, [k] * 6
    if kind == "flat":
        k = torch.full((64, 2, 16), 0.5)
        return [k] * 6, [k] * 6
    if kind == "heads-apart":  # Gaussian heads 20x apart: heads differ far more than a head's tokens do
        k = torch.randn(256, 2, 16, generator=g) * torch.tensor([1.0, 20.0])[None, :, None]
        return [k] * 6, [k] * 6
    k = torch.randn(256, 2, 16, generator=g)
    if kind == "plain":
        return [k] * 6, [k] * 6
    k[:, :, 3] *= 3  # an outlier channel
    k[5, 0, 7] = 100.0  # one value 100 standard deviations out: a long tail
    v = torch.randn(256, 2, 16, generator=g)
    return [k] * 6, [v] * 6


# claim id -> (stand-in A, stand-in B): planted measurements on which the verdict must differ (a stand-in Lab,
# or keyword arguments planting the measurement itself)
PLANTED_LABS = {
    "static-30": (_quality_lab(), _quality_lab(seed_shares={"sharegpt": {"max": [0.2, 0.31, 0.32]},
                                                            "alpaca": {"max": [0.04, 0.05, 0.03]}})),
    "paged-near-100": (_quality_lab(), _quality_lab(seed_shares={w: {"paged": [0.9, 0.91, 0.92]} for w in ("sharegpt", "alpaca")})),
    "static-50": (_quality_lab(), _quality_lab(seed_shares={w: {"max": [0.2, 0.6], "oracle": [0.7]} for w in ("sharegpt", "alpaca")})),
    "paged-90": (_quality_lab(), _quality_lab(seed_shares={w: {"paged": [0.95, 0.85, 0.8]} for w in ("sharegpt", "alpaca")})),
    "10-30ms": (_quality_lab(), _quality_lab(step_ms={("short", 1): 10.0, ("short", 16): 12.0, ("1k", 1): 10.0,
                                                      ("1k", 16): 11.0})),
    "cache-5-20x": (_quality_lab(), _quality_lab(speedups=[{"prompt_tokens": 256, "speedup": 2.5}])),
    "round-even": (_quality_lab(kv=_kv("plain")), _quality_lab(kv=_kv("ties"))),
    "granularity": (_quality_lab(kv=_kv("tails")), _quality_lab(kv=_kv("heads-grid"))),
    "head-stable": (_quality_lab(kv=_kv("plain")), _quality_lab(kv=_kv("heads-apart"))),
    "seed-fp16": (_quality_lab(answers={"identical": 40, "requests": 48}), _quality_lab(answers={"identical": 48, "requests": 48})),
    "max-batch": (_quality_lab(), _quality_lab(step_ms={("1k", 1): 10.0, ("1k", 16): 200.0})),  # 16 rows, less throughput
    "3-bits": (_quality_lab(kv=_kv("tails")), _quality_lab(kv=_kv("flat"))),
    "p999": (_lab(0.002, 0.001), _lab(0.001, 0.002)),
    "ppl-0.1": (_lab(0.001, 0.002, delta=0.5), _lab(0.001, 0.002, delta=2.0)),
    "ppl-0.5-1.5": (_lab(0.001, 0.002, delta=1.0), _lab(0.001, 0.002, delta=3.0)),
    "negligible": (_lab(0.001, 0.002, top1=0.995), _lab(0.001, 0.002, top1=0.9)),
    "k-over-v": (_lab(0.001, 0.002), _lab(0.001, 0.002, kl_k4v8=0.001, kl_k8v4=0.01)),
    "first-last": (_lab(0.001, 0.002), _quality_lab(sensitivity=[0.1, 0.9, 0.8, 0.7, 0.6, 0.05])),
    "saturation": (_quality_lab(), _quality_lab(saturation={"configs": {
        "static": dict(kl=2.0, top1=0.3, k_clip_rate=0.2), "corrected": dict(kl=0.0015, top1=0.99)}})),
    "prefix-40-60": (dict(measured=(0.47, 27, 58.0)), dict(measured=(0.2, 27, 58.0))),  # (saving, shared, mean)
    "swa-documents": tuple(SimpleNamespace(passkey={"full": dict(correct=4, n=4, prompt_tokens=540),
                                                    "window": dict(correct=w, n=4, prompt_tokens=540)}) for w in (0, 4)),
}
# claim id -> keyword arguments planting a measurement in a claim that needs no model
PLANTED_ARGS = {
    "per-channel-code": dict(reduce_dim=0),  # the max over the tokens: one scale per channel
    "kv-7b": dict(per=2**20), "weights-7b": dict(w=30 * 10**9), "kv-1mb": dict(per=2**20),
    "a100-half": dict(request=4 * 2**30), "kv-70b": dict(per=1600 * 10**3), "decode-1ms": dict(bandwidth=1e12),
    "int8-half": dict(scales="per-token-head"), "int4-quarter": dict(group=32, scale_dtype="fp32"),
    "24-to-16gb": dict(context=8192), "b32-16k-fits": dict(hbm=2**40), "22ms-step": dict(bandwidth=14e12),
    "16ms-step": dict(bandwidth=9.4e12), "12-7ms": dict(bandwidth=23e12), "int8-39pct": dict(hbm=2**40),
    "unfused": dict(unfused=1), "frag-5-10": dict(lengths=(60, 140)), "util-30-80": dict(busy={"static": 0.35,
                                                                                                 "continuous": 0.85}),
    "zero-guard": dict(threshold=0.0),
}


def test_every_measured_rule_flips_on_a_planted_measurement():
    """The other half of the table (the arithmetic rows are above): every row's rule, given a planted
    measurement, gives another verdict. Model-free rows: the real measurement against a planted one;
    rows that need SmolLM2: two planted stand-ins, so no model runs here."""
    by_id = {c.id: c for c in claims.CLAIMS}
    measured = {c.id for c in claims.CLAIMS if c.measure.__module__ != "kvlab.claims.arithmetic"}
    assert set(PLANTED_LABS) | set(PLANTED_ARGS) == measured
    assert not set(PLANTED_LABS) & set(PLANTED_ARGS)
    for cid, kw in PLANTED_ARGS.items():
        real, planted = by_id[cid].measure(None)[1], by_id[cid].measure(None, **kw)[1]
        assert real != planted, (cid, real, planted)
    run = lambda cid, x: by_id[cid].measure(None, **x) if isinstance(x, dict) else by_id[cid].measure(x)
    for cid, (a, b) in PLANTED_LABS.items():
        va, vb = run(cid, a)[1], run(cid, b)[1]
        assert va != vb, (cid, va, vb)


def test_each_part_of_a_two_part_row_flips_on_its_own_evidence(monkeypatch):
    """Issue 57 item 1: no part of a verdict is a literal. The parts that were typed in (True) now come
    from the bytes: plant evidence against each and that part, alone, turns."""
    from kvlab import sizing
    by_id = {c.id: c for c in claims.CLAIMS}
    detail = claims.rules.detail
    assert by_id["finer-scales-cost"].measure(None)[1] == "partly"
    assert detail(by_id["finer-scales-cost"].measure(None, finer="per-head")[1]).endswith(  # no scale per token
        "not that finer scales cost a finer implementation")
    assert by_id["first-last-saving"].measure(None, middle="fp16")[1] == "wrong"
    assert by_id["first-last-saving"].measure(None, kept=0, middle="fp16")[1] == "wrong"
    assert by_id["first-last-saving"].measure(None, kept=0)[1] == "holds"
    assert by_id["deferred-quant"].measure(None)[1] == "wrong" != by_id["deferred-quant"].measure(None, resident="int8")[1]
    assert by_id["kv-heads"].measure(None)[1] == "partly"  # lengths and layers hold, heads (GQA) do not
    real = sizing.kv_size
    monkeypatch.setattr(sizing, "kv_size", lambda model, *a, tokens=1, **k: real(model, *a, tokens=min(tokens, 4096), **k))
    assert detail(by_id["kv-heads"].measure(None)[1]).startswith("neither")  # bytes that stop growing with length


def test_int8_39pct_is_wrong_as_stated_and_the_rule_can_go_every_way():
    """As stated (32 x 16K on 80 GB) it cannot have run; where a setting fits, the bytes bound it and only a
    measured kernel confirms it."""
    from kvlab.claims.memory import c_39pct

    measured, verdict, why = c_39pct(None)
    assert verdict == "wrong" and "biggest FP16 batch that fits is 8 x 16K" in measured and "H200" in why
    big = 2**40  # a card the setting fits
    assert c_39pct(None, hbm=big) == c_39pct(None, hbm=big) and c_39pct(None, hbm=big)[1] == "not checkable here"
    assert c_39pct(None, hbm=big, attention_speedup=2.0)[1] == "holds"
    assert c_39pct(None, context=4096, batch=1, hbm=big, attention_speedup=2.0)[1] == "wrong"  # weights dominate


def test_the_lab_takes_a_generation_run_already_made_and_refuses_a_wrong_one():
    made = {"identical": 25, "requests": 48, "prefix_share": 0.63}
    assert claims.Lab(answers=made).answers is made  # read, not re-run (no model is loaded)
    with pytest.raises(ValueError, match="answers"):
        claims.Lab(answers={"identical": 25})


#: the rows whose measurements issue 54 made smaller for a laptop's time and memory: notebook 06's workload
#: (prefix blocks: ShareGPT-like lengths x 0.1, was x 0.15) and the recompute speed-ups (one run per length,
#: was three), and the greedy answers alone (06's prompts, 24 tokens each in roomy pools, was 06's whole run in
#: its budget: seed-fp16's verdict reads them; "negligible" shows them, but its verdict reads top-1 alone)
SHRUNK = ("prefix-40-60", "cache-5-20x", "seed-fp16")


def test_the_smaller_workloads_leave_the_verdicts_as_they_were():
    """tests/claims_verdicts.json holds every verdict of ``kvlab claims`` as measured before the workloads
    shrank (same seeds, b2e998a; rows added since, as first measured); the shrunk rows, measured now, must
    give the same words."""
    before = json.loads((Path(__file__).parent / "claims_verdicts.json").read_text())
    assert set(before) == {c.id for c in claims.CLAIMS}  # the record covers the whole table
    rows = claims.run(claims.Lab(), ids=list(SHRUNK))
    assert {r["id"]: r["verdict"] for r in rows} == {i: before[i] for i in SHRUNK}
