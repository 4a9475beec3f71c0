"""Notebook 07's measurements beyond eviction: quality against bytes, the host tier's projections,
many engines behind a router (kvlab/engine/fleet.py, kvlab/eval/eviction.py)."""

import math

import pytest
import torch

from kvlab import data
from kvlab.calibrate import calibrate
from kvlab.engine import fleet
from kvlab.engine.fleet import StepTimeModel, chat_workload, simulate_fleet
from kvlab.eval import eviction as evq
from kvlab.cache import evict as ev
from kvlab.engine.metrics import StepStats
from kvlab.eval import eviction_quality


def test_eviction_quality_full_cache_is_the_reference(tiny):
    model, _ = tiny
    ids = list(range(3, 3 + 70))
    r = eviction_quality(model, ids, 40, {"keep": (None, "fp32"), "window": ev.SlidingWindow(16),
                                          "fp16": (None, "fp16")}, block_size=4)
    keep, window, fp16 = (r["configs"][n] for n in ("keep", "window", "fp16"))
    assert r["scored"] == 70 - 40 - 1
    # the same cache as the reference: served a token a step here, scored against it in two chunks
    assert keep["kl"] < 1e-9 and keep["top1"] == 1.0
    assert window["kl"] > 1e-3 and window["tokens"] <= 16 and window["bytes_share"] < 0.3
    assert abs(fp16["kl"]) < 1e-4 and fp16["bytes_share"] == 1.0 and fp16["tokens"] == 69
    with pytest.raises(ValueError, match="prompt_len"):
        eviction_quality(model, ids, 69, {"w": ev.SlidingWindow(16)})
    with pytest.raises(TypeError, match="policy"):
        eviction_quality(model, ids, 40, {"w": ("window", "fp16")})
    # an earlier result's full-cache logits reused: the same scores as serving the reference again
    again = eviction_quality(model, ids, 40, {"window": ev.SlidingWindow(16)}, block_size=4, reference=r)
    assert again["full_logits"] is r["full_logits"]  # the reference was not served a second time
    assert again["configs"]["window"]["kl"] == pytest.approx(window["kl"], rel=1e-6)
    for wrong in (ids[:-1], [5] + ids[1:]):  # another text: refused before any work
        with pytest.raises(ValueError, match="reference"):
            eviction_quality(model, wrong, 40, {"w": ev.SlidingWindow(16)}, block_size=4, reference=r)


def test_one_batch_sharing_the_prompt_scores_each_policy_as_served_alone(tiny, monkeypatch):
    """_serve_text serves every policy in one batch, the prompt prefilled once (the others find its blocks
    in the prefix cache; the second H2O gets the attention of the rows it did not compute), and scores each step's
    logits as they come, then drops them: the same numbers and held blocks as each policy served alone
    in an engine of its own, no prefix cache, its logits kept and scored after."""
    from kvlab.cache import BlockManager, QuantizedPagedKVCache
    from kvlab.engine import LLM, SamplingParams
    model, _ = tiny
    ids = list(range(3, 3 + 60))
    policies = [ev.SlidingWindow(16), ev.SinksWindow(16, sinks=4), ev.HeavyHitters(16), None, ev.HeavyHitters(20)]
    ref = torch.log_softmax(torch.stack(evq.forced_logits(model, ids, 40, "fp32", block_size=4)[0]), -1)
    score = evq._Scores(ref, torch.tensor(ids[41:]))
    monkeypatch.setattr(evq, "PREFILL_TOKENS", 50)  # one prompt a step: the others wait, then hit its blocks
    streamed = evq._serve_text(model, ids, 40, policies, "fp16", None, 4, "torch", score=score)
    forced = ids[40:]
    for policy, got in zip(policies, streamed):
        cache = QuantizedPagedKVCache.from_model(model, 64, 4, evq.named_config("fp16"), None)
        llm = LLM(model, block_manager=BlockManager(64, 4, enable_prefix_caching=False), cache=cache, max_num_seqs=1,
                  max_num_batched_tokens=64)
        out = llm.generate([ids[:40]], SamplingParams(max_tokens=len(forced), ignore_eos=True, eviction=policy,
                                                      forced_token_ids=forced, return_logits=True))[0]
        want, have = score.of(out.logits[1:len(forced)]), got["scores"].result()
        assert "logits" not in got and got["held"]["blocks"] == llm.seqs[out.request_id].metrics.held_blocks
        assert torch.allclose(want["kl"], have["kl"], atol=1e-5) and torch.equal(want["top1"], have["top1"])
        assert torch.allclose(want["nll"], have["nll"], atol=1e-5)
    with pytest.raises(ValueError, match="scored 0 positions"):
        score.row().result()


def _kl(p_logits, q_logits) -> float:
    p, q = torch.log_softmax(p_logits, -1), torch.log_softmax(q_logits, -1)
    return float((p.exp() * (p - q)).sum(-1).mean())


def _stepwise(model, ids, prompt_len, fmt, calibration, block_size=4) -> dict:
    """The engine a step per token, every token kept: the scored logits and what the cache held."""
    from kvlab.cache import BlockManager, PagedKVCache, QuantizedPagedKVCache
    from kvlab.engine import LLM, SamplingParams
    nb = -(-len(ids) // block_size) + 1
    cache = (PagedKVCache.from_model(model, nb, block_size, dtype=torch.float32) if fmt == "fp32" else
             QuantizedPagedKVCache.from_model(model, nb, block_size, evq.named_config(fmt), calibration))
    llm = LLM(model, block_manager=BlockManager(nb, block_size, enable_prefix_caching=False), cache=cache,
              max_num_seqs=1, max_num_batched_tokens=64)
    forced = ids[prompt_len:]
    out = llm.generate([ids[:prompt_len]], evq.SamplingParams(max_tokens=len(forced), ignore_eos=True,
                                                              forced_token_ids=forced, return_logits=True))[0]
    m = llm.seqs[out.request_id].metrics
    return {"logits": out.logits[1:len(forced)],
            "held": {"blocks": m.held_blocks, "tokens": m.held_tokens, "bytes": m.held_blocks * cache.bytes_per_block}}


@pytest.mark.parametrize("fmt", ["fp16", "int8", "k8v4", "int4"])
def test_a_kept_cache_scores_in_two_forwards_what_it_scores_a_token_a_step(smollm2, fmt):
    """forced_logits (the text in two forwards, as_decodes) against _serve_text (the engine, a step per
    token), so eviction_quality may take the short way for caches that evict nothing. Not bit-equal: a
    float difference of 1e-6 can move a value to the next integer level, and the next layers carry it.
    So: (nearly) the same next tokens, a KL between the two far below the format's own, the same KL against FP32."""
    model, _ = smollm2
    ids = [3 + (7 * i) % 200 for i in range(53)]
    calibration = calibrate(model, [ids[:20]], progress=False)  # scales from the text's start: later values clip
    full = torch.stack(evq.forced_logits(model, ids, 30, "fp32", block_size=4)[0])
    if fmt == "fp16":  # the FP32 reference itself (test_eviction_quality_full_cache_is_the_reference on tiny too)
        fp32 = _stepwise(model, ids, 30, "fp32", None)
        assert torch.allclose(full, torch.stack(fp32["logits"]).float(), atol=1e-3)
    chunked, held = evq.forced_logits(model, ids, 30, fmt, calibration, block_size=4)
    stepwise = _stepwise(model, ids, 30, fmt, calibration)
    a, b = torch.stack(chunked), torch.stack(stepwise["logits"]).float()
    assert len(chunked) == 53 - 30 - 1 and held == stepwise["held"]
    with pytest.raises(ValueError, match="prompt_len"):
        evq.forced_logits(model, ids, 52, fmt, calibration, block_size=4)
    assert (a.argmax(-1) == b.argmax(-1)).double().mean() >= 0.9  # a near-tie may flip on another CPU
    own = _kl(full, b)  # what the format costs
    # the floor: float rounding alone, where the format costs ~nothing (FP16: 1.4e-7 on an AMD EPYC, 2026-12-07)
    assert _kl(b, a) < max(0.02 * own, 5e-7)
    assert _kl(full, a) == pytest.approx(own, rel=0.05, abs=5e-7)
    if fmt != "fp16":  # a plain prefill chunk (new tokens at full precision among themselves) is not the same
        runner = evq.PoolRunner(model, evq.named_config(fmt), calibration, [ids[:-1]], 4)
        runner.forward_many({0: ids[:30]})
        prefill = runner.forward_many({0: ids[30:-1]})[0]
        assert _kl(full, prefill) < 0.8 * own


def test_equal_byte_budgets(smollm2):
    model, _ = smollm2
    b = evq.equal_byte_budgets(model, 1023, ("int4",), block_size=16)
    share = evq.block_share(model, "int4", 16)
    assert b["int4"] == int(share * 64) * 16 and 0.25 < share < 0.35


def test_fit_step_time_recovers_a_planted_model():
    planted = StepTimeModel(0.02, 0.0005, 0.002)
    stats = [StepStats(i, 0, 0, 0, p, d, 0, 0, 0, 0, planted(p, d), 0.0, 0.0, 0.0)
             for i, (p, d) in enumerate([(0, 1), (0, 8), (128, 4), (512, 0), (64, 16), (0, 32)])]
    fit = fleet.fit_step_time(stats)
    assert math.isclose(fit.fixed, 0.02, rel_tol=1e-6) and math.isclose(fit.per_decode, 0.002, rel_tol=1e-6)
    assert fit.error < 1e-6 and "median error" in str(fit)
    with pytest.raises(ValueError, match="at least 3"):
        fleet.fit_step_time(stats[:2])


def test_fleet_routing_and_the_host_tier():
    wl = chat_workload(24, 3, seed=1)
    st = StepTimeModel(0.02, 0.0004, 0.001)
    runs = {r: simulate_fleet(wl, 4, r, st, num_blocks=128) for r in fleet.ROUTERS}
    assert all(x["requests"] == 72 for x in runs.values())
    assert runs["prefix-affinity"]["prefix_hit_rate"] > runs["round-robin"]["prefix_hit_rate"] + 0.1
    assert runs["prefix-affinity"]["prefix_hit_rate"] > runs["least-loaded"]["prefix_hit_rate"] + 0.1
    assert sum(runs["round-robin"]["served_by"]) == 72 and max(runs["round-robin"]["served_by"]) == 18
    plain = simulate_fleet(wl, 1, "least-loaded", st, num_blocks=96)
    tiered = simulate_fleet(wl, 1, "least-loaded", st, num_blocks=96, host_blocks=1024)
    assert plain["host_hits"] == 0 and tiered["host_hits"] > 0
    assert tiered["blocks_from_host"] == tiered["host_hits"] and tiered["prefix_hit_rate"] > plain["prefix_hit_rate"]
    with pytest.raises(ValueError, match="router"):
        simulate_fleet(wl, 2, "random", st)


def test_tier_projection_arithmetic():
    r = fleet.tier_projection(10, 160, "llama-3-8b")
    assert r["bytes_moved"] == 10 * 16 * 131072
    assert math.isclose(r["recompute_flops"], 2 * 8.03e9 * 160)
    pcie4 = r["links"]["PCIe 4.0 x16"]
    assert math.isclose(pcie4["seconds"], r["bytes_moved"] / 32e9)
    # a GQA model moves few bytes per parameter: loading beats recomputing; an MHA model of similar size less so
    assert pcie4["x_faster_than_recompute"] > 3 * fleet.tier_projection(10, 160, "llama-2-7b")["links"][
        "PCIe 4.0 x16"]["x_faster_than_recompute"]


def test_passkey_prompts(tiny):
    _, tok = tiny
    prompts, keys = data.passkey_prompts(tok, n=3, filler_repeats=4)
    assert len(prompts) == 3 and all(10000 <= k < 100000 for k in keys)
    assert all(str(k).encode() in bytes(t - 3 for t in p if t >= 3) for p, k in zip(prompts, keys))
    # the depths cycle through DEPTHS: the key's first mention moves back as the depth grows
    firsts = [min(data.passkey_blocks(tok, p, k, block_size=1)) for p, k in zip(prompts, keys)]
    assert firsts == sorted(firsts) and len(set(firsts)) == 3
    blocks = data.passkey_blocks(tok, prompts[0], keys[0], block_size=16)
    assert len(blocks) >= 2 and blocks == sorted(blocks)  # written twice: both mentions' blocks
    with pytest.raises(ValueError, match="does not occur"):
        data.passkey_blocks(tok, prompts[0], 99999 if keys[0] != 99999 else 11111)
    prompts, keys, starts = data.passkey_prompts(tok, n=2, filler_repeats=4, haystack="macbeth", question_starts=True)
    for p, k, s in zip(prompts, keys, starts):
        assert str(k) in tok.decode(p[:s]) and tok.decode(p[s:]).startswith("What is the pass key?")
    with pytest.raises(ValueError, match="haystack"):
        data.passkey_prompts(tok, n=2, haystack="no-such-play")
    with pytest.raises(ValueError, match="cut must be one of"):
        evq.passkey(None, tok, {"full": None}, n=2, cut="after the answer")


def test_equal_bytes_verdict():
    fmt = {"kl": 0.01, "delta_ppl_ci95": (0.0, 1.0)}
    assert evq.equal_bytes_verdict(fmt, {"kl": 0.1, "delta_ppl_ci95": (0.5, 9.0)}) == ("quantize", pytest.approx(10))
    assert evq.equal_bytes_verdict(fmt, {"kl": 0.001, "delta_ppl_ci95": (-3.0, -1.0)})[0] == "evict"
    # within TIE_KL and the intervals overlap: the measurements cannot tell them apart
    assert evq.equal_bytes_verdict(fmt, {"kl": 0.019, "delta_ppl_ci95": (0.9, 5.0)})[0] == "tie"
    assert evq.equal_bytes_verdict(fmt, {"kl": 0.006, "delta_ppl_ci95": (-1.0, 0.1)})[0] == "tie"
    # close KLs but separate intervals, or overlapping intervals but KLs TIE_KL apart: not a tie
    assert evq.equal_bytes_verdict(fmt, {"kl": 0.019, "delta_ppl_ci95": (1.1, 5.0)})[0] == "quantize"
    assert evq.equal_bytes_verdict(fmt, {"kl": 0.02, "delta_ppl_ci95": (0.9, 5.0)})[0] == "quantize"


def test_answers_after_cut_against_the_engine(tiny):
    """Cutting at the prompt's end is what LLM(eviction=...) does: the same greedy tokens; keeping
    every token, the cut does not matter and the answer is plain greedy generation."""
    from kvlab.engine import LLM, SamplingParams
    from kvlab.eval import answers_after_cut

    model, tok = tiny
    ids = [3 + (7 * i) % 50 for i in range(45)]

    def engine(policy):
        llm = LLM(model, tok, num_blocks=40, block_size=4, max_num_seqs=1, max_num_batched_tokens=64, eviction=policy,
                  enable_prefix_caching=False)
        return llm.generate([ids], SamplingParams(max_tokens=6, ignore_eos=True))[0].token_ids

    at_end = answers_after_cut(model, ids, 45, {"full": None, "window": ev.SlidingWindow(16)}, 6, block_size=4)
    early = answers_after_cut(model, ids, 30, {"full": None, "window": ev.SlidingWindow(16)}, 6, block_size=4)
    assert at_end["full"] == early["full"] == engine(None)
    assert at_end["window"] == engine(ev.SlidingWindow(16)) and len(early["window"]) == 6
    with pytest.raises(ValueError, match="cut must be an int"):
        answers_after_cut(model, ids, 0, {"full": None})
    with pytest.raises(TypeError, match="policy"):
        answers_after_cut(model, ids, 30, {"w": "window"})
    with pytest.raises(ValueError, match="policies"):
        answers_after_cut(model, ids, 30, {})


def test_router_findings_are_computed_from_the_runs():
    def row(router, n, hits, p50, p99, tok, served):
        return dict(router=router, replicas=n, prefix_hit_rate=hits, ttft_p50_s=p50, ttft_p99_s=p99, output_tok_s=tok,
                    served_by=served)
    sims = [row(r, 1, 0.3, 5.0, 8.0, 100, [40]) for r in fleet.ROUTERS]
    for n in (2, 4):
        sims += [row("round-robin", n, 0.5, 0.2, 0.4, 200 * n, [40 // n] * n),
                 row("least-loaded", n, 0.4, 0.3, 0.5, 190 * n, [40 // n] * n),
                 row("prefix-affinity", n, 0.45, 0.1, 0.6, 180 * n, [40 - 3 * n] + [1] * (n - 1))]
    lines = fleet.router_findings(sims, requests=40)
    assert lines[0] == ("prefix-affinity leads, of N = 2, 4: prefix hits at N = none; TTFT p50 at 2, 4; p99 at none; "
                        "tokens/s at none")
    assert "at most 50% prefix hits (round-robin, N=2), 20 points above one engine's 30%" in lines[1]
    assert "at N=4 its replicas served 1 to 28 requests (an even share: 10)" in lines[2]
    assert lines[3].endswith("round-robin +300, +400; least-loaded +280, +380; prefix-affinity +260, +360")
    with pytest.raises(ValueError, match="sims must hold"):
        fleet.router_findings([r for r in sims if r["replicas"] != 1], requests=40)


def test_kept_blocks_equal_each_run_in_a_pool_of_its_own(tiny):
    """kept_blocks runs every (budget, policy) through one engine, the prompt computed once and found in
    the prefix cache by the later runs: what each kept, dropped and left free equals that run alone in
    a pool of its own, with no prefix cache; H2O's and SnapKV's scores too, to float rounding."""
    from kvlab.validate import cdiv
    from kvlab.engine import LLM, SamplingParams
    model, _ = tiny
    prompt = list(range(5, 5 + 45))
    policies, budgets = ("window", "sinks+window", "h2o", "snapkv"), (24, 32)
    runs = evq.kept_blocks(model, prompt, policies, budgets, max_tokens=6, block_size=4)
    for budget in budgets:
        for name in policies:
            policy = ev.make_policy(name, budget)
            llm = LLM(model, None, num_blocks=cdiv(len(prompt) + 6, 4) + 4, block_size=4, max_num_seqs=1,
                      max_num_batched_tokens=512, eviction=policy, enable_prefix_caching=False)
            alone = {}

            def record(stats, llm=llm, alone=alone):
                bm = llm.block_manager
                for sid in bm.seqs:
                    alone.update(kept=bm.logical_blocks(sid), dropped=bm.counters["policy_evictions"],
                                 free=bm.num_free_blocks, scores=llm.eviction_scores(sid))
            llm.on_step = record
            llm.generate([prompt], SamplingParams(max_tokens=6, ignore_eos=True))
            got = runs[budget][name]
            assert (got["kept"], got["dropped"], got["free"]) == (alone["kept"], alone["dropped"], alone["free"])
            assert got["dropped"] > 0  # 45 tokens in a budget of 24 or 32: blocks went
            if policy.needs_scores:
                want = [float(alone["scores"][i * 4:(i + 1) * 4].sum()) for i in range(len(got["scores"]))]
                assert got["scores"] == pytest.approx(want, rel=1e-5)


def test_quantize_or_evict_serves_also_in_its_batch_and_scores_it_apart(tiny):
    """``also`` rides in the policies' batch (their steps shared) yet scores as served alone
    (eviction_quality with the same full-cache reference), and stays out of the configs and verdicts."""
    model, _ = tiny
    ids = [3 + (11 * i) % 250 for i in range(90)]
    tilted = {"h2o r=0.75 @32": ev.HeavyHitters(32, recent=0.75)}
    calibration = calibrate(model, [ids[:40]], progress=False)
    qe = evq.quantize_or_evict(model, ids, 50, calibration, formats=("int8",), policies=("window", "h2o"),
                               extra_budgets=(), block_size=4, also=tilted)
    assert set(qe["also"]) == set(tilted) and not set(tilted) & set(qe["result"]["configs"])
    assert [v["format"] for v in qe["verdicts"]] == ["int8"] and "h2o@" + str(qe["budgets"]["int8"]) in qe["result"]["configs"]
    alone = eviction_quality(model, ids, 50, tilted, calibration, block_size=4, reference=qe["result"])["configs"]
    for name in tilted:
        assert qe["also"][name]["kl"] == pytest.approx(alone[name]["kl"], rel=1e-4, abs=1e-7)
        assert qe["also"][name]["tokens"] == alone[name]["tokens"] and qe["also"][name]["top1"] == alone[name]["top1"]
    with pytest.raises(ValueError, match="also"):
        evq.quantize_or_evict(model, ids, 50, calibration, formats=("int8",), policies=("window",), block_size=4,
                              also={"window@" + str(qe["budgets"]["int8"]): ev.SlidingWindow(16)})
    with pytest.raises(ValueError, match="also"):
        evq.quantize_or_evict(model, ids, 50, calibration, formats=("int8",), policies=("window",), block_size=4, also=[1])


def test_after_cuts_equal_each_policy_served_alone(tiny):
    """passkey's path (_after_cuts): three prompts sharing a 30-token start, each prefilled once in one
    engine (the leads hit each other's blocks in the same step, the others hit the leads'), cut four
    tokens before the end: every policy's answers equal it served alone, no prefix cache."""
    from kvlab.engine import LLM, SamplingParams
    model, _ = tiny
    prompts = [list(range(5, 35)) + [40 + k] * 3 + list(range(100 + k, 110 + k)) for k in range(3)]
    cuts = [len(p) - 4 for p in prompts]
    policies = {"full": None, "window": ev.SlidingWindow(16), "h2o": ev.HeavyHitters(16),
                "snapkv": ev.PromptSelect(20, window=6, kernel=3)}
    got = evq._after_cuts(model, None, prompts, cuts, policies, 5, 4)
    for name, policy in policies.items():
        for k, (p, at) in enumerate(zip(prompts, cuts)):
            llm = LLM(model, None, num_blocks=64, block_size=4, max_num_seqs=1, enable_prefix_caching=False)
            out = llm.generate([p[:at]], SamplingParams(max_tokens=9, ignore_eos=True, eviction=policy,
                                                        forced_token_ids=p[at:]))[0]
            assert got[name][k] == out.token_ids[4:], (name, k)
