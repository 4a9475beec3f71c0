"""The notebook's stop button: a KeyboardInterrupt raised inside the model's forward, at random
steps and layers, must leave every object usable.

Each test interrupts a run, checks the state left behind (block manager invariants, no leaked
blocks, a quantized pool's counters), then finishes or repeats the work on the same objects and
compares the tokens with an uninterrupted run: a half-written block that stayed in the prefix
cache, or a cache layer holding one token more than the others, would change them.
"""

import os
import random
import signal

import pytest
import torch

from kvlab.cache import BlockManager, ContiguousCache, PagedKVCache, StaticCache
from kvlab.engine import LLM, SamplingParams
from kvlab.engine.llm import hold_interrupts
from kvlab.generate import greedy_generate, hf_generate, paged_generate

SYSTEM = [random.Random(99).randrange(3, 259) for _ in range(24)]  # a shared prefix: prefix-cache hits


@pytest.fixture(autouse=True)
def _sigint_reaches_python():
    """These tests send themselves a real SIGINT. Once, under xdist, a worker reached them with SIGINT
    blocked (its culprit not found: no kvlab code blocks signals, and the peer's and the profiler's tests
    leave the mask empty): unblock it for the test and say so, rather than fail on another test's leftovers."""
    blocked = signal.SIGINT in signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT])
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    if blocked:
        print("note: SIGINT was blocked in this test process before the test; unblocked for it")
    yield
    signal.signal(signal.SIGINT, previous)
    if blocked:
        signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGINT])


def _prompts(n, seed=0, lo=3, hi=40):
    rng = random.Random(seed)
    return [(SYSTEM if i % 2 else []) + [rng.randrange(3, 259) for _ in range(rng.randint(lo, hi))] for i in range(n)]


class Interrupt:
    """Raise KeyboardInterrupt when decoder layer ``layer`` starts its ``call``-th forward."""

    def __init__(self, model, call: int, layer: int):
        self.call, self.calls, self.fired = call, 0, False
        self.handle = model.model.layers[layer].register_forward_pre_hook(self)

    def __call__(self, module, args):
        self.calls += 1
        if self.calls == self.call:
            self.fired = True
            raise KeyboardInterrupt

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.handle.remove()


def _points(n, seed, max_call, layers=3):
    rng = random.Random(seed)
    return [(rng.randint(1, max_call), rng.randrange(layers)) for _ in range(n)]


# ---- greedy_generate: the store a learner passed in comes back empty, and works again ------------

@pytest.mark.parametrize("kind", ["dynamic", "static", "none", "own dynamic", "own static"])
@pytest.mark.parametrize("call,layer", _points(3, seed=1, max_call=8))
def test_greedy_generate_interrupted(tiny, kind, call, layer):
    model, _ = tiny
    prompts = _prompts(3, seed=2)
    ref = hf_generate(model, prompts, 10)
    store = {"own dynamic": ContiguousCache.from_model(model),
             "own static": StaticCache.from_model(model, max_batch=3, max_seq_len=80)}.get(kind, kind)
    with Interrupt(model, call, layer) as stop, pytest.raises(KeyboardInterrupt):
        greedy_generate(model, prompts, 10, cache=store)
    assert stop.fired
    if not isinstance(store, str):
        assert store.seq_len(0) == 0 and all(store.seq_len(i) == 0 for i in range(store.num_layers))
    assert greedy_generate(model, prompts, 10, cache=store).token_ids == ref


def test_greedy_generate_refuses_a_store_that_is_not_empty(tiny):
    model, _ = tiny
    store = ContiguousCache.from_model(model)
    greedy_generate(model, [[5, 6, 7]], 3, cache=store)
    with pytest.raises(ValueError, match="cache already holds 5 tokens"):
        greedy_generate(model, [[5, 6, 7]], 3, cache=store)


# ---- paged_generate on a manager and pool kept across calls --------------------------------------

@pytest.mark.parametrize("call,layer", _points(4, seed=3, max_call=12))
def test_paged_generate_interrupted_keeps_the_manager_clean(tiny, call, layer):
    model, _ = tiny
    prompts = _prompts(6, seed=4)
    ref = hf_generate(model, prompts, 12)
    bm = BlockManager(96, 4)
    cache = PagedKVCache.from_model(model, 96, 4)
    paged_generate(model, prompts[:2], 12, manager=bm, cache=cache)  # cached blocks from a finished run
    before = bm.stats()
    with Interrupt(model, call, layer) as stop, pytest.raises(KeyboardInterrupt):
        paged_generate(model, prompts, 12, manager=bm, cache=cache)
    assert stop.fired
    bm.check_invariants()
    after = bm.stats()
    assert not bm.seqs and after["blocks_used"] == 0 and after["blocks_free"] + after["blocks_cached"] == 96
    assert after["blocks_cached"] <= before["blocks_cached"] + 96  # nothing held; cached ones only fully written
    # a half-written block left in the prefix cache would be hit now and change the tokens
    assert paged_generate(model, prompts, 12, manager=bm, cache=cache).token_ids == ref
    bm.check_invariants()


# ---- the engine: interrupted at a random step, then stepped on to the end ------------------------

def _serve(llm, prompts, max_tokens, interrupt=None):
    ids = [llm.add_request(p, SamplingParams(max_tokens=m, ignore_eos=True)) for p, m in zip(prompts, max_tokens)]
    interrupted = 0
    while llm.has_unfinished():
        try:
            llm.step()
        except KeyboardInterrupt:
            interrupted += 1
            llm.block_manager.check_invariants()
            for seq in llm.scheduler.running:  # nothing runs half-way: everything was put back in the queue
                pytest.fail(f"{seq} still running after an interrupted step")
            assert llm.block_manager.stats()["blocks_used"] == 0
            if interrupt is not None:
                interrupt.handle.remove()
        llm.block_manager.check_invariants()
    return [llm.seqs[i].output_token_ids for i in ids], interrupted


@pytest.mark.parametrize("where,layer", [(random.Random(s).random(), s % 3) for s in range(6)])
def test_engine_step_interrupted_then_stepped_on(tiny, where, layer):
    model, tok = tiny
    prompts = _prompts(10, seed=6)
    max_tokens = [random.Random(i).randint(2, 20) for i in range(len(prompts))]
    kw = dict(num_blocks=40, block_size=4, max_num_seqs=6, max_num_batched_tokens=48, eos_token_id=None)
    clean = LLM(model, tok, **kw)
    ref, _ = _serve(clean, prompts, max_tokens)
    assert clean.scheduler.num_preemptions > 0 and any(e.action == "chunked" for e in clean.trace)
    call = 1 + int(where * (len(clean.step_stats) - 1))  # a step somewhere in the run
    llm = LLM(model, tok, **kw)
    stop = Interrupt(model, call, layer)
    got, interrupted = _serve(llm, prompts, max_tokens, stop)
    stop.handle.remove()
    assert stop.fired and interrupted == 1
    assert got == ref
    assert any(e.action == "preempted" and e.reason == "interrupted" for e in llm.trace)
    assert llm.block_manager.stats()["blocks_used"] == 0


@pytest.mark.parametrize("kv_cache_dtype", ["int8", "fp8"])
def test_quantized_pool_counters_stay_consistent(tiny, kv_cache_dtype):
    from kvlab.quant import named_config

    model, tok = tiny
    prompts = _prompts(6, seed=7)
    llm = LLM(model, tok, num_blocks=64, block_size=4, quant_config=named_config(kv_cache_dtype, policy="dynamic"),
              eos_token_id=None)
    for p in prompts:
        llm.add_request(p, SamplingParams(max_tokens=8, ignore_eos=True))
    llm.step()
    llm.step()
    before = llm.cache.saturation()
    with Interrupt(model, 1, 2), pytest.raises(KeyboardInterrupt):  # layers 0 and 1 were written, 2 not
        llm.step()
    after = llm.cache.saturation()
    for which in ("k", "v"):
        for c in ("values", "clipped", "at_qmax"):
            assert torch.equal(after[which][c], before[which][c]), (which, c)
        assert (after[which]["values"] == after[which]["values"][0]).all()  # every layer counts the same writes
    llm.block_manager.check_invariants()
    while llm.has_unfinished():
        llm.step()
    sat = llm.cache.saturation()
    assert (sat["k"]["values"] == sat["k"]["values"][0]).all() and torch.equal(sat["k"]["values"], sat["v"]["values"])
    assert all(len(s.output_token_ids) == 8 for s in llm.seqs.values())


def test_generate_interrupted_drops_its_requests_and_the_engine_serves_the_next(tiny):
    model, tok = tiny
    prompts = _prompts(4, seed=8)
    llm = LLM(model, tok, num_blocks=64, block_size=4, eos_token_id=None)
    with Interrupt(model, 3, 1), pytest.raises(KeyboardInterrupt):
        llm.generate(prompts, SamplingParams(max_tokens=6))
    assert not llm.has_unfinished() and llm.block_manager.stats()["blocks_used"] == 0
    assert {s.finish_reason for s in llm.seqs.values()} == {"aborted"}
    llm.block_manager.check_invariants()
    outs = llm.generate(prompts, SamplingParams(max_tokens=6))
    assert [o.token_ids for o in outs] == hf_generate(model, prompts, 6)
    assert llm.summary()["requests"] == 4  # the aborted ones are not in the figures


def test_abort_request(tiny):
    model, tok = tiny
    llm = LLM(model, tok, num_blocks=32, block_size=4, eos_token_id=None)
    a = llm.add_request([5, 6, 7, 8, 9], SamplingParams(max_tokens=5))
    b = llm.add_request([10, 11], SamplingParams(max_tokens=5))
    llm.step()
    llm.abort_request(a)
    assert llm.seqs[a].finish_reason == "aborted" and a not in llm.block_manager.seqs
    llm.block_manager.check_invariants()
    while llm.has_unfinished():
        llm.step()
    assert llm.seqs[b].output_token_ids == hf_generate(model, [[10, 11]], 5)[0]
    with pytest.raises(ValueError, match="request_id 99 is not a request"):
        llm.abort_request(99)


# ---- Ctrl-C during the bookkeeping is held until it is done ---------------------------------------

def test_hold_interrupts_delays_a_real_sigint_to_the_end_of_the_block():
    done = []
    with pytest.raises(KeyboardInterrupt):
        with hold_interrupts():
            os.kill(os.getpid(), signal.SIGINT)
            done.append("bookkeeping finished")
    assert done == ["bookkeeping finished"]
    assert signal.getsignal(signal.SIGINT) is signal.default_int_handler


def test_sigint_during_scheduling_rolls_the_step_back(tiny, monkeypatch):
    model, tok = tiny
    prompts = _prompts(5, seed=9)
    kw = dict(num_blocks=48, block_size=4, max_num_seqs=4, max_num_batched_tokens=32, eos_token_id=None)
    ref, _ = _serve(LLM(model, tok, **kw), prompts, [6] * 5)
    llm = LLM(model, tok, **kw)
    real = llm.scheduler.schedule
    calls = []

    def schedule():
        calls.append(1)
        if len(calls) == 3:
            os.kill(os.getpid(), signal.SIGINT)  # arrives in the middle of the scheduler's bookkeeping
        return real()

    monkeypatch.setattr(llm.scheduler, "schedule", schedule)
    got, interrupted = _serve(llm, prompts, [6] * 5)
    assert interrupted == 1 and got == ref


# ---- kvlab ppl and calibration -------------------------------------------------------------------

def test_kvlab_ppl_interrupted_exits_130_without_a_traceback(tiny, monkeypatch, capsys, tmp_path):
    from kvlab import models
    from kvlab.cli import main

    model, tok = tiny
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    monkeypatch.setattr(models, "load_model", lambda name, **kw: (model, tok))
    with Interrupt(model, 5, 1):
        code = main(["ppl", "--model", "tiny", "--kv-cache-dtype", "int8", "--policy", "dynamic", "--tokens", "96",
                     "--window", "64", "--stride", "32", "--chunk", "16"])
    assert code == 130
    assert capsys.readouterr().err.strip().splitlines() == ["kvlab: interrupted"]


def test_default_calibration_interrupted_leaves_no_file_and_runs_again(tiny, monkeypatch, tmp_path):
    from kvlab.calibrate import default_calibration

    model, tok = tiny
    monkeypatch.setenv("KVLAB_CACHE", str(tmp_path))
    with Interrupt(model, 1, 1), pytest.raises(KeyboardInterrupt):
        default_calibration(model, tok, "tiny", tokens=256, progress=False)
    assert not list(tmp_path.rglob("*.safetensors")) and not list(tmp_path.rglob("*.tmp"))
    cal = default_calibration(model, tok, "tiny", tokens=256, progress=False)
    assert cal.shape == (3, 2, 16) and len(list(tmp_path.rglob("*.safetensors"))) == 1
