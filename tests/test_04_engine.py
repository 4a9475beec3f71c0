"""The serving engine: batched == sequential, token for token, under every scheduling situation.

Each request's greedy tokens from the engine must equal HF ``generate()`` for that prompt ALONE:
concurrency, chunked prefill, preemption, prefix hits and late arrivals change when a token is
computed, never which token it is.
"""

import random

import pytest
import torch

import kvlab
from kvlab.attention import (DecodeIndex, PrefillIndex, batched_decode_attention, batched_prefill_attention,
                             paged_attention)
from kvlab.cache import BlockManager
from kvlab.engine import LLM, SamplingParams, Scheduler, Sequence
from kvlab.generate import hf_generate, paged_generate

TRITON = pytest.param("triton", marks=pytest.mark.triton)  # skipped with the reason where triton is missing
BACKENDS = ["reference", "torch", TRITON]
# every scheduling situation on the PyTorch backends; the Triton kernels (interpreted on a CPU, ~0.1 s a
# launch) on the hardest one, preemption with chunked prefill; tests/test_05_kernels.py does the rest
CASES = ["roomy", "chunked", "preempting", "late arrivals"]
SCENARIOS = [(b, c) for b in ("reference", "torch") for c in CASES] + [
    pytest.param("triton", "preempting", marks=pytest.mark.triton)]
SYSTEM = [30 + (i * 7) % 200 for i in range(40)]


def _prompts(n, seed=0, lo=1, hi=60, system=None):
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = [rng.randrange(3, 259) for _ in range(rng.randint(lo, hi))]
        out.append((system or []) + p)
    return out


def _alone(model, prompts, max_tokens):
    """HF generate() for each prompt on its own (the sequential reference)."""
    return [hf_generate(model, [p], m)[0] for p, m in zip(prompts, max_tokens)]


def _run(llm, prompts, max_tokens, arrivals=None, check=True):
    """Serve prompts, adding prompt i before step arrivals[i]; check invariants after every step."""
    arrivals = arrivals or [0] * len(prompts)
    ids, step = {}, 0
    pending = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    while pending or llm.has_unfinished():
        while pending and arrivals[pending[0]] <= step:
            i = pending.pop(0)
            ids[i] = llm.add_request(prompts[i], SamplingParams(max_tokens=max_tokens[i], ignore_eos=True))
        if llm.has_unfinished():
            llm.step()
            if check:
                llm.block_manager.check_invariants()
        step += 1
    return [llm.seqs[ids[i]].output_token_ids for i in range(len(prompts))]


# ---- token identity -------------------------------------------------------------------------------

@pytest.mark.parametrize("backend,case", SCENARIOS)
def test_engine_matches_hf_generate_alone(tiny, backend, case):
    model, tok = tiny
    prompts = _prompts(10, seed=1) + _prompts(4, seed=2, system=SYSTEM)
    max_tokens = [random.Random(i).randint(1, 24) for i in range(len(prompts))]
    kw = dict(num_blocks=128, block_size=4, max_num_seqs=8, max_num_batched_tokens=256)
    arrivals = None
    if case == "chunked":
        kw["max_num_batched_tokens"] = 16
    elif case == "preempting":
        kw.update(num_blocks=32, max_num_batched_tokens=32)
    elif case == "late arrivals":
        arrivals = [random.Random(7 + i).randint(0, 30) for i in range(len(prompts))]
    llm = LLM(model, tok, attn_backend=backend, eos_token_id=None, **kw)
    got = _run(llm, prompts, max_tokens, arrivals)
    assert got == _alone(model, prompts, max_tokens)
    actions = {e.action for e in llm.trace}
    if case == "chunked":
        assert "chunked" in actions
    if case == "preempting":
        assert "preempted" in actions and llm.scheduler.num_preemptions > 0
    assert sum(llm.seqs[i].metrics.cached_prompt_tokens for i in llm.seqs) > 0  # the shared system prompt hit
    assert llm.block_manager.stats()["blocks_used"] == 0


@pytest.mark.parametrize("backend", BACKENDS)
def test_eos_and_stop_ids_finish_requests_early(tiny, backend):
    model, tok = tiny
    prompts = _prompts(5, seed=3)
    free = _alone(model, prompts, [12] * 5)
    eos = free[0][3]
    llm = LLM(model, tok, num_blocks=64, block_size=4, attn_backend=backend, eos_token_id=eos)
    outs = llm.generate(prompts, SamplingParams(max_tokens=12))
    for o, ref in zip(outs, hf_generate(model, prompts, 12, eos_token_id=eos)):
        assert o.token_ids == ref
        assert o.finish_reason == ("eos" if ref[-1] == eos else "length")
    stop = free[1][2]
    o = llm.generate([prompts[1]], SamplingParams(max_tokens=12, stop_token_ids=[stop]))[0]
    assert o.token_ids == free[1][:3] and o.finish_reason == "stop"
    o = llm.generate([prompts[0]], SamplingParams(max_tokens=12, ignore_eos=True))[0]
    assert o.token_ids == free[0] and o.finish_reason == "length"


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["reference", "torch"])  # triton: tests/test_05_kernels.py
def test_engine_matches_hf_on_smollm2(smollm2, backend):
    from kvlab.data import chat_prompts

    model, tok = smollm2
    prompts = chat_prompts(tok)
    ref = _alone(model, prompts, [10] * len(prompts))
    llm = LLM(model, tok, num_blocks=64, block_size=16, max_num_seqs=4, max_num_batched_tokens=48,
              attn_backend=backend, eos_token_id=None)
    got = _run(llm, prompts, [10] * len(prompts), arrivals=[0, 0, 3, 6])
    assert got == ref
    assert any(e.action == "chunked" for e in llm.trace)


def test_static_policy_admits_nothing_while_a_batch_runs(tiny):
    model, tok = tiny
    prompts = _prompts(7, seed=4)
    max_tokens = [2, 9, 4, 12, 3, 6, 8]
    llm = LLM(model, tok, num_blocks=128, block_size=4, max_num_seqs=3, policy="static", eos_token_id=None)
    assert _run(llm, prompts, max_tokens) == _alone(model, prompts, max_tokens)
    admitted = {}
    for e in llm.trace:
        if e.action == "admitted":
            admitted.setdefault(e.step, []).append(e.seq_id)
    finished = {e.seq_id: e.step for e in llm.trace if e.action == "finished"}
    batches = [admitted[s] for s in sorted(admitted)]
    assert [len(b) for b in batches] == [3, 3, 1]
    for prev, step in zip(batches, sorted(admitted)[1:]):  # the next batch starts after the last one ended
        assert step > max(finished[i] for i in prev)
    assert any(e.reason == "batch running" for e in llm.trace)


# ---- quantized pool -----------------------------------------------------------------------------------

@pytest.mark.parametrize("backend", BACKENDS)
def test_quantized_engine_equals_paged_generate_on_the_same_quantized_cache(tiny, backend):
    from kvlab.cache import QuantizedPagedKVCache
    from kvlab.calibrate import calibrate
    from kvlab.quant import KVQuantConfig, TensorFormat, named_config

    model, tok = tiny
    prompts = _prompts(6, seed=5, system=SYSTEM[:9])
    cal = calibrate(model, _prompts(3, seed=9, lo=40, hi=60), progress=False)
    for config in (named_config("int8"), named_config("int8", granularity="per-token-head", policy="dynamic"),
                   KVQuantConfig(TensorFormat("int8"), TensorFormat("int4", group_size=8)),  # K8V4
                   named_config("int8", rotate_k=True)):
        def pool(n=96):
            return BlockManager(n, 4), QuantizedPagedKVCache.from_model(model, n, 4, config, cal)

        bm, cache = pool()
        ref = paged_generate(model, prompts, 10, manager=bm, cache=cache).token_ids
        # a different schedule (4 at a time, staggered arrivals), the same quantization decisions: static
        # and per-token scales do not depend on the batch. (Chunked prefill and preemption do change
        # them: a later chunk reads the earlier ones back from the quantized pool; notebook 04 measures it.)
        bm, cache = pool()
        llm = LLM(model, tok, block_manager=bm, cache=cache, max_num_seqs=4, max_num_batched_tokens=256,
                  attn_backend=backend, eos_token_id=None)
        assert _run(llm, prompts, [10] * 6, arrivals=[0, 0, 2, 5, 5, 9]) == ref, config.label()


# ---- the batched attention path ------------------------------------------------------------------------

@pytest.mark.parametrize("max_groups", [1, 4])
@pytest.mark.parametrize("h_q,h_kv,block_size", [(4, 2, 4), (3, 3, 16), (8, 1, 1), (6, 2, 8)])
def test_batched_decode_attention_equals_the_reference_on_ragged_contexts(h_q, h_kv, block_size, max_groups,
                                                                          monkeypatch):
    """One padded gather for all decodes (max_groups=1) and rows cut into groups of similar context
    length (the default): both equal the specification."""
    monkeypatch.setattr(DecodeIndex, "max_groups", max_groups)
    monkeypatch.setattr(DecodeIndex, "group_overhead", 0)  # split wherever it saves any padding
    g = torch.Generator().manual_seed(0)
    d, n_blocks = 16, 64
    k_cache = torch.randn(n_blocks, block_size, h_kv, d, generator=g)
    v_cache = torch.randn(n_blocks, block_size, h_kv, d, generator=g)
    ctx = [1, block_size, block_size + 1, 3 * block_size - 1, 17]
    perm = torch.randperm(n_blocks, generator=g).tolist()
    tables, used = [], 0
    for c in ctx:
        nb = -(-c // block_size)
        tables.append(perm[used:used + nb])
        used += nb
    for t in range(used, n_blocks):  # garbage in every block no sequence owns (the batched path gathers
        k_cache[perm[t]] = 1e4  # padding, then masks it: finite stale values must not leak in)
        v_cache[perm[t]] = -1e4
    for table, c in zip(tables, ctx):  # and in the unused tail of each last block
        k_cache[table[-1], c % block_size or block_size:] = 1e4
    q = torch.randn(len(ctx), h_q, d, generator=g)
    ref = paged_attention(q, k_cache, v_cache, tables, ctx, [1] * len(ctx), scale=d ** -0.5)
    index = DecodeIndex(tables, ctx, block_size)
    out = batched_decode_attention(q, k_cache, v_cache, index, scale=d ** -0.5)
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()
    # the next layer through the same step's index: its own answer, in the buffers the first layer's gather
    # made (one per step, not a fresh tensor per layer), and the first layer's answer is not overwritten
    buffers = {w: b.data_ptr() for w, b in index.scratch.items()}
    k2, v2 = 0.5 * k_cache + 1, 0.5 * v_cache - 1
    out2 = batched_decode_attention(q, k2, v2, index, scale=d ** -0.5)
    ref2 = paged_attention(q, k2, v2, tables, ctx, [1] * len(ctx), scale=d ** -0.5)
    assert torch.allclose(out2, ref2, atol=1e-5) and torch.allclose(out, ref, atol=1e-5)
    assert {w: b.data_ptr() for w, b in index.scratch.items()} == buffers
    assert set(buffers) == ({"k", "v"} if max_groups == 1 else set())  # groups gather in their own indexes
    groups = index.groups()
    assert (len(groups) > 1) == (max_groups > 1)
    if max_groups > 1:  # every row in exactly one group, each group's rows sorted by context length
        rows = torch.cat([r for r, _ in groups]).tolist()
        assert sorted(rows) == list(range(len(ctx)))
        assert [ctx[i] for i in rows] == sorted(ctx)


@pytest.mark.parametrize("window", [None, 5])
@pytest.mark.parametrize("h_q,h_kv,block_size", [(4, 2, 4), (3, 3, 16), (6, 2, 8)])
def test_batched_prefill_attention_equals_the_reference(h_q, h_kv, block_size, window):
    """All prefill chunks of a step in one SDPA (the torch backend over a float pool) = the spec, for
    ragged chunks (a whole prompt, a later chunk, one token) over contexts whose pages hold the chunks."""
    g = torch.Generator().manual_seed(1)
    d, n_blocks = 16, 64
    k_cache = torch.randn(n_blocks, block_size, h_kv, d, generator=g)
    v_cache = torch.randn(n_blocks, block_size, h_kv, d, generator=g)
    ctx, qlens = [9, 3 * block_size + 2, 1, 2 * block_size], [9, block_size + 1, 1, 3]
    perm = torch.randperm(n_blocks, generator=g).tolist()
    tables, used = [], 0
    for c in ctx:
        nb = -(-c // block_size)
        tables.append(perm[used:used + nb])
        used += nb
    for t in range(used, n_blocks):  # stale values in blocks no sequence owns must not leak in
        k_cache[perm[t]] = 1e4
        v_cache[perm[t]] = -1e4
    q = torch.randn(sum(qlens), h_q, d, generator=g)
    ref = paged_attention(q, k_cache, v_cache, tables, ctx, qlens, scale=d ** -0.5, window=window)
    out = batched_prefill_attention(q, k_cache, v_cache, PrefillIndex(tables, ctx, qlens, block_size),
                                    scale=d ** -0.5, window=window)
    assert out.shape == ref.shape
    assert torch.allclose(out, ref, atol=1e-5), (out - ref).abs().max()


def test_prefill_is_batched_only_where_padding_pays():
    assert PrefillIndex.pays([60], [60], 16)  # one chunk: one call, no padding (faster than the spec's loop)
    assert not PrefillIndex.pays([], [], 16)  # decodes only: no prefill
    assert PrefillIndex.pays([60, 45, 80, 62], [60, 45, 80, 62], 16)  # admissions of similar prompts
    assert not PrefillIndex.pays([300, 40, 30], [300, 40, 30], 16)  # one long chunk would pad the others 10x


def test_prepacked_weights_change_no_token_and_leave_the_model_as_it_was(tiny):
    """LLM(prepack_weights=True), the default: the linear layers multiply by oneDNN-packed weights
    during the engine's forward only; the tokens equal the plain F.linear engine's and HF's."""
    from kvlab.engine.prepack import PrepackedLinears, prepack_available

    model, tok = tiny
    prompts = [[5, 9, 11, 3, 7], [2, 4, 6], [13, 1, 8, 8, 2, 9, 10]]
    packed = LLM(model, tok, num_blocks=64, max_num_seqs=4, eos_token_id=None)
    plain = LLM(model, tok, num_blocks=64, max_num_seqs=4, eos_token_id=None, prepack_weights=False)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    assert len(packed.runner.prepacked) == (sum(isinstance(m, torch.nn.Linear) for m in model.modules())
                                            if prepack_available(model) else 0)
    assert len(plain.runner.prepacked) == 0
    ours = [o.token_ids for o in packed.generate(prompts, params)]
    assert ours == [o.token_ids for o in plain.generate(prompts, params)]
    assert not any("forward" in m.__dict__ for m in model.modules())  # nothing left on the model
    if prepack_available(model):  # a weight changed in place is packed again at its next call
        lin = next(m for m in model.modules() if isinstance(m, torch.nn.Linear))
        pl = PrepackedLinears(model)
        x = torch.randn(3, lin.in_features)
        old = lin.weight.detach().clone()
        try:
            with torch.no_grad():
                lin.weight.mul_(2)
            with pl.active(), torch.inference_mode():
                y = lin(x)
            assert torch.allclose(y, torch.nn.functional.linear(x, lin.weight), atol=1e-5)
        finally:
            with torch.no_grad():
                lin.weight.copy_(old)
    with pytest.raises(TypeError, match="prepack must be True or False"):
        LLM(model, tok, num_blocks=8, prepack_weights="yes")


def test_engines_on_one_model_share_one_packing_and_it_goes_with_the_model():
    """A notebook keeps a dozen engines on one model: they share ONE packed copy of the weights (not
    one each), whatever their seat count; the copy is freed when no engine holds it, and its entry goes
    with the model."""
    import gc
    import weakref

    from kvlab.engine.prepack import _SHARED, prepack_available

    model, tok = kvlab.load_model("tiny")  # its own copy: the session's tiny model keeps its entry
    if not prepack_available(model):
        pytest.skip("no oneDNN on this build: nothing is packed")
    a = LLM(model, tok, num_blocks=16, max_num_seqs=1, eos_token_id=None)
    b = LLM(model, tok, num_blocks=16, max_num_seqs=32, eos_token_id=None)
    assert a.runner.prepacked is b.runner.prepacked and len(a.runner.prepacked) > 0
    other, _ = kvlab.load_model("tiny")
    assert LLM(other, tok, num_blocks=16).runner.prepacked is not a.runner.prepacked  # per model
    packed = weakref.ref(a.runner.prepacked)
    del a, b
    gc.collect()
    assert packed() is None  # no engine left: the copy is freed
    assert len(LLM(model, tok, num_blocks=16).runner.prepacked) > 0  # and made again for the next engine
    alive = weakref.ref(model)
    n = len(_SHARED)
    del model
    gc.collect()
    assert alive() is None and len(_SHARED) == n - 1


def test_fused_siblings_give_each_layer_its_own_product(tiny):
    """q/k/v and gate/up packed as one weight: each sibling called with the shared input gets exactly
    its own slice; a sibling called with another input still multiplies that input (one GEMM again)."""
    from kvlab.engine.prepack import PrepackedLinears, prepack_available

    model, _ = tiny
    if not prepack_available(model):
        pytest.skip("no oneDNN on this build: nothing is packed")
    pl = PrepackedLinears(model)
    attn = next(m for m in model.modules() if hasattr(m, "q_proj"))
    mlp = next(m for m in model.modules() if hasattr(m, "gate_proj"))
    assert len(pl.fused) == 2 * model.config.num_hidden_layers
    assert {id(m) for m in pl.modules} >= {id(attn.k_proj), id(mlp.up_proj)}
    x, other = torch.randn(5, attn.q_proj.in_features), torch.randn(5, attn.q_proj.in_features)
    lin = torch.nn.functional.linear
    with pl.active(), torch.inference_mode():
        q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        k_other = attn.k_proj(other)  # not the input the group multiplied last
        g, u = mlp.gate_proj(x), mlp.up_proj(x)
        v_again = attn.v_proj(x)  # a slice is handed out once; a second call multiplies again
    for out, m, inp in ((q, attn.q_proj, x), (k, attn.k_proj, x), (v, attn.v_proj, x), (k_other, attn.k_proj, other),
                        (g, mlp.gate_proj, x), (u, mlp.up_proj, x), (v_again, attn.v_proj, x)):
        assert out.shape == (5, m.out_features)
        assert torch.allclose(out, lin(inp, m.weight, m.bias), atol=1e-5)
    assert all(f.outs is None for f in pl.fused)  # no activation kept past the forward


def test_step_profile_parts_add_up(tiny):
    """kvlab bench engine --profile: every part of a step measured, the shares adding up to one."""
    from kvlab.bench.profile import PARTS, format_profile, profile_steps

    model, tok = tiny
    llm = LLM(model, tok, num_blocks=64, max_num_seqs=4, eos_token_id=None)
    for p in ([5, 9, 11, 3, 7], [2, 4, 6], [13, 1, 8, 8, 2, 9, 10], [3, 3, 3, 3]):
        llm.add_request(p, SamplingParams(max_tokens=12, ignore_eos=True))
    prof = profile_steps(llm, steps=6, skip=2)
    assert prof["steps"] == 6 and set(prof["share"]) == set(PARTS)
    assert abs(sum(prof["share"].values()) - 1) < 1e-9
    assert prof["ms_per_step"]["model GEMMs"] > 0 and prof["ms_per_step"]["attention: compute"] > 0
    assert 0 < prof["outside_model_math_share"] < 1 and 0 < prof["engine_share"] < prof["outside_model_math_share"]
    assert not any("forward" in m.__dict__ for m in model.modules())
    assert "outside the model's GEMMs and norms" in "\n".join(format_profile(prof))


# ---- stress ---------------------------------------------------------------------------------------------

def test_stress_1000_requests_random_arrivals_small_pool(tiny):
    model, tok = tiny
    rng = random.Random(0)
    n = 1000
    prompts = [[rng.randrange(3, 259) for _ in range(rng.randint(1, 40))] for _ in range(n)]
    max_tokens = [rng.randint(1, 12) for _ in range(n)]
    arrivals = sorted(rng.randint(0, 600) for _ in range(n))
    llm = LLM(model, tok, num_blocks=40, block_size=4, max_num_seqs=16, max_num_batched_tokens=48,
              attn_backend="torch", eos_token_id=None, watermark=0.05)
    got = _run(llm, prompts, max_tokens, arrivals)
    bm = llm.block_manager
    assert all(s.is_finished for s in llm.seqs.values()) and not bm.seqs
    assert bm.stats()["blocks_used"] == 0 and bm.num_free_blocks == bm.num_blocks
    assert [len(t) for t in got] == max_tokens
    assert llm.scheduler.num_preemptions > 0
    # the trace tells the same story as the outputs
    events: dict[int, list] = {}
    for e in llm.trace:
        events.setdefault(e.seq_id, []).append(e)
    for sid, seq in llm.seqs.items():
        acts = [e.action for e in events[sid]]
        assert acts.count("admitted") == acts.count("preempted") + 1 == seq.metrics.num_preemptions + 1
        assert acts[-1] == "finished" and acts.count("finished") == 1
        assert events[sid][-1].detail == f"{len(seq.output_token_ids)} tokens"
    s = llm.summary()
    assert s["requests"] == n and s["output_tokens"] == sum(max_tokens)
    # a sample of requests checked against HF alone (all 1000 would take minutes)
    for i in rng.sample(range(n), 25):
        assert got[i] == hf_generate(model, [prompts[i]], max_tokens[i])[0]


# ---- bad input and failures -----------------------------------------------------------------------------

@pytest.mark.parametrize("prompt,params,message", [
    ([], None, "prompt must not be empty"),
    ("   ", None, "prompt must not be empty or blank"),
    ([5] * 600, None, "does not fit the model's context of 512"),
    ([5] * 30, SamplingParams(max_tokens=200), "the whole pool has 16"),
    ([5, 6], {"max_tokens": 3}, "sampling_params must be a SamplingParams"),
    ([5, 999], None, "prompt token ids must be ints in 0..258"),
    ([5, "a"], None, "prompt token ids must be ints"),
    (3.5, None, "prompt must be a string or a list of token ids"),
])
def test_bad_requests_are_refused_and_the_engine_keeps_serving(tiny, prompt, params, message):
    model, tok = tiny
    llm = LLM(model, tok, num_blocks=16, block_size=4, max_num_seqs=2, eos_token_id=None)
    good = llm.add_request([5, 6, 7], SamplingParams(max_tokens=6))
    llm.step()
    before = (llm.block_manager.stats(), len(llm.seqs), list(llm.scheduler.waiting))
    with pytest.raises(ValueError, match=message):
        llm.add_request(prompt, params)
    assert (llm.block_manager.stats(), len(llm.seqs), list(llm.scheduler.waiting)) == before
    while llm.has_unfinished():
        llm.step()
    assert llm.seqs[good].output_token_ids == hf_generate(model, [[5, 6, 7]], 6)[0]


@pytest.mark.parametrize("kw,message", [
    (dict(max_tokens=0), "max_tokens must be an integer >= 1"),
    (dict(max_tokens=2.5), "max_tokens must be an integer"),
    (dict(temperature=-0.1), "temperature must be a finite number >= 0"),
    (dict(temperature=float("nan")), "temperature must be a finite number"),
    (dict(top_p=0.0), r"top_p must be in \(0, 1\]"),
    (dict(top_p=1.5), r"top_p must be in \(0, 1\]"),
    (dict(top_k=-1), "top_k must be an integer >= 0"),
    (dict(stop_token_ids="2"), "stop_token_ids must be a token id or a list of token ids"),
    (dict(stop_token_ids=[2, None]), "stop_token_ids must be"),
    (dict(seed=-3), "seed must be an integer >= 0"),
    (dict(ignore_eos="yes"), "ignore_eos must be True or False"),
])
def test_sampling_params_validation(kw, message):
    with pytest.raises(ValueError, match=message):
        SamplingParams(**kw)


def test_generate_is_all_or_nothing(tiny):
    model, tok = tiny
    llm = LLM(model, tok, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="prompt must not be empty"):
        llm.generate([[5, 6], []])
    assert not llm.seqs and not llm.has_unfinished()


def test_a_failed_step_frees_every_block_and_the_engine_recovers(tiny, monkeypatch):
    model, tok = tiny
    llm = LLM(model, tok, num_blocks=32, block_size=4, eos_token_id=None)
    a = llm.add_request(SYSTEM[:12], SamplingParams(max_tokens=5))
    llm.step()
    real = llm.runner.execute_model

    def interrupted(batch, bm, **kwargs):
        raise KeyboardInterrupt  # a learner stops the cell mid-forward

    monkeypatch.setattr(llm.runner, "execute_model", interrupted)
    with pytest.raises(KeyboardInterrupt):
        llm.step()
    bm = llm.block_manager
    assert not bm.seqs and bm.stats()["blocks_used"] == 0 and not bm.hash_to_block
    bm.check_invariants()
    monkeypatch.setattr(llm.runner, "execute_model", real)
    while llm.has_unfinished():
        llm.step()
    assert llm.seqs[a].output_token_ids == hf_generate(model, [SYSTEM[:12]], 5)[0]


@pytest.mark.parametrize("kw,message", [
    (dict(max_num_seqs=0), "max_num_seqs must be a positive integer"),
    (dict(max_num_seqs=8, max_num_batched_tokens=4), "must be >= max_num_seqs"),
    (dict(policy="fifo"), "policy must be one of"),
    (dict(attn_backend="cuda"), "attn_backend must be one of"),
    (dict(kv_cache_dtype="int3"), "kv_cache_dtype must be one of"),
    (dict(watermark=1.5), "watermark must be a fraction"),
])
def test_bad_engine_arguments(tiny, kw, message):
    model, tok = tiny
    with pytest.raises(ValueError, match=message):
        LLM(model, tok, num_blocks=16, block_size=4, **kw)


# ---- sampling ---------------------------------------------------------------------------------------------

def test_seeded_samples_do_not_depend_on_the_batch(tiny):
    model, tok = tiny
    p = SamplingParams(max_tokens=10, temperature=0.8, top_k=50, top_p=0.9, seed=123)
    alone = LLM(model, tok, num_blocks=64, block_size=4, eos_token_id=None).generate([[5, 6, 7]], p)[0].token_ids
    crowd = LLM(model, tok, num_blocks=64, block_size=4, eos_token_id=None)
    others = [SamplingParams(max_tokens=8, temperature=1.0, seed=s) for s in range(4)]
    outs = crowd.generate([[9, 9], [5, 6, 7], [40] * 9, [7], [8, 8, 8]], [others[0], p, *others[1:]])
    assert outs[1].token_ids == alone
    greedy = hf_generate(model, [[5, 6, 7]], 10)[0]
    assert alone != greedy  # it really sampled


def test_top_k_1_and_tiny_top_p_are_greedy(tiny):
    model, tok = tiny
    ref = hf_generate(model, [[5, 6, 7]], 8)[0]
    for p in (SamplingParams(max_tokens=8, temperature=1.0, top_k=1, seed=1),
              SamplingParams(max_tokens=8, temperature=1.0, top_p=1e-6, seed=1)):
        llm = LLM(model, tok, num_blocks=16, block_size=4, eos_token_id=None)
        assert llm.generate([[5, 6, 7]], p)[0].token_ids == ref


# ---- the scheduler's rules on their own (no model) ----------------------------------------------------------

def _seq(i, n, max_tokens=4):
    return Sequence(i, list(range(10 + i, 10 + i + n)), SamplingParams(max_tokens=max_tokens), 0.0)


def test_scheduler_budget_seq_limit_blocks_and_watermark():
    bm = BlockManager(10, 4, enable_prefix_caching=False)
    s = Scheduler(bm, max_num_seqs=2, max_num_batched_tokens=8, watermark=0.1)  # 1 block reserved
    for i, n in enumerate((6, 12, 3)):
        s.add(_seq(i, n))
    b = s.schedule()
    assert [x.seq_id for x in b.seqs] == [0, 1] and b.num_new_tokens == [6, 2]  # seq 1 chunked under the budget
    assert [(e.seq_id, e.action, e.reason) for e in s.trace] == [
        (0, "admitted", ""), (1, "admitted", ""), (1, "chunked", "token budget"), (2, "deferred", "token budget")]
    b.seqs[0].num_computed_tokens += 6
    b.seqs[1].num_computed_tokens += 2
    b.seqs[0].append_token(1)  # seq 0 sampled its first token
    b = s.schedule()
    assert b.num_decodes == 1 and b.num_new_tokens == [1, 7]  # the decode first, then the chunk continues
    assert s.trace[-1].reason == "token budget"
    s1 = Scheduler(BlockManager(10, 4), max_num_seqs=1, max_num_batched_tokens=64)
    s1.add(_seq(0, 3))
    s1.add(_seq(1, 3))
    s1.schedule()
    assert [(e.seq_id, e.action, e.reason) for e in s1.trace][-1] == (1, "deferred", "seq limit")
    s2 = Scheduler(BlockManager(4, 4), max_num_seqs=4, max_num_batched_tokens=64, watermark=0.25)
    s2.add(_seq(0, 12))  # 3 blocks: alone it may use the watermark
    s2.add(_seq(1, 1))  # 1 block: would leave 0 < 1 reserved block
    s2.schedule()
    assert [x.seq_id for x in s2.running] == [0] and s2.trace[-1].reason == "no blocks"


def test_preemption_takes_the_most_recently_admitted_and_requeues_it_first():
    bm = BlockManager(3, 2, enable_prefix_caching=False)
    s = Scheduler(bm, max_num_seqs=4, max_num_batched_tokens=16, watermark=0.0)
    a, b = _seq(0, 2), _seq(1, 2)
    s.add(a)
    s.add(b)
    s.schedule()
    for x in (a, b):  # both prefilled and sampled a token; their blocks are full
        x.num_computed_tokens = 2
        x.append_token(7)
    c = _seq(2, 1)
    s.add(c)
    batch = s.schedule()  # a takes the last free block; b has none left: b is preempted
    assert [x.seq_id for x in batch.seqs] == [0] and list(s.waiting) == [b, c]
    assert b.status.value == "preempted" and b.num_computed_tokens == 0 and b.token_ids[-1] == 7
    assert [(e.seq_id, e.action) for e in s.trace if e.action == "preempted"] == [(1, "preempted")]
    bm.check_invariants()


def test_the_recorded_vllm_run_is_whole_and_its_note_says_what_it_holds():
    """kvlab/bench/vllm_recorded.json (notebook 04 reads it where there is no peer): both seat counts, all
    six systems, medians of the runs, a profile whose parts add up, and a note whose ratios are the data's."""
    import re

    from kvlab.bench.engine import ALL_SYSTEMS
    from kvlab.bench.profile import PARTS
    from kvlab.bench.vllm_peer import recorded

    rec = recorded()
    assert set(rec["seats"]) == {"16", "64"} and rec["machine"] and rec["date"]
    for n, res in rec["seats"].items():
        assert res["max_num_seqs"] == int(n) and set(res["systems"]) == set(ALL_SYSTEMS)
        for row in res["systems"].values():
            runs = row["output_tok_s_runs"]
            assert len(runs) == res["repeat"] and row["output_tok_s"] == sorted(runs)[len(runs) // 2]
        p = res["profile"]
        assert set(p["ms_per_step"]) == set(PARTS) and abs(sum(p["share"].values()) - 1) < 1e-9
    # "vLLM compiled against kvlab continuous (...): 0.99x (16 seats) and 0.97x (64)": vLLM / kvlab, paired medians
    said = re.search(r"vLLM compiled against kvlab continuous[^:]*: ([\d.]+)x \(16 seats\) and ([\d.]+)x \(64\)",
                     rec["note"])
    assert said, rec["note"]
    for n, text in zip(("16", "64"), said.groups()):
        assert text == f"{rec['seats'][n]['systems']['vllm']['throughput_vs_kvlab_paired_median']:.2f}"


def test_dry_run_runs_the_participants_rules_without_a_model():
    """dry_run takes all three scheduler rules (notebook 04 watches Tasks 2 and 3 in a whole run in
    milliseconds): kvlab's own give the default run; a rule that never preempts stalls a tight pool,
    one that never chunks leaves a long prompt waiting for a budget it never fits."""
    from kvlab.engine.dry_run import dry_run
    from kvlab.engine.scheduler import chunk_prefills, schedule_decodes

    load = [(10, 12), (20, 14), (6, 16), (8, 10), (40, 4, 3)]
    kw = dict(num_blocks=14, block_size=4, max_num_seqs=4, max_num_batched_tokens=16)
    _, ref = dry_run(load, **kw)
    _, same = dry_run(load, schedule_decodes=schedule_decodes, chunk_prefills=chunk_prefills, **kw)
    assert same == ref
    sched, _ = dry_run(load, **kw)
    assert any(e.action == "preempted" for e in sched.trace)  # the pool is tight enough to need a preemption

    def never_preempts(running, decoding, append, preempt):
        return [sid for sid in running if sid in decoding and append(sid)]

    with pytest.raises(ValueError, match="schedule_decodes returned"):  # the scheduler names the broken rule
        dry_run(load, schedule_decodes=never_preempts, max_steps=500, **kw)

    def never_chunks(uncomputed, budget):
        out = []
        for n in uncomputed:
            out.append(n if n <= budget else 0)
            budget -= out[-1]
        return out

    with pytest.raises(RuntimeError):  # the 40-token prompt never fits a 16-token step
        dry_run(load, chunk_prefills=never_chunks, max_steps=500, **kw)
