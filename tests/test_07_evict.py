"""Eviction policies (notebook 07): each block policy in the engine equals its textbook rule on the
unmodified HF model with a dense, masked cache; the block manager stays consistent under eviction.

Differential: kvlab's engine (block tables that lose blocks, freed blocks back in the pool, slots
counted from the end of the table, attention observed in the pool) against
:func:`kvlab.generate.textbook_eviction` (HF's own DynamicCache keeping every token, eviction a
mask in every later softmax, the rule written over dense position masks).
"""

import random

import pytest
import torch

import kvlab
from kvlab.cache import BlockManager
from kvlab.cache import evict as ev
from kvlab.engine import LLM, SamplingParams
from kvlab.generate import textbook_eviction

POLICIES = {
    "window": lambda: ev.SlidingWindow(16),
    "sinks+window": lambda: ev.SinksWindow(16, sinks=4),
    "h2o": lambda: ev.HeavyHitters(16),
    "snapkv": lambda: ev.PromptSelect(16, window=6, kernel=3),
}


def _prompt(model, n, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist()


def engine_run(model, prompt, policy, max_tokens, block_size, attn_backend="torch", max_num_batched_tokens=512):
    """Greedy tokens, the logits each was sampled from, and the kept positions after every step."""
    eng = LLM(model, None, num_blocks=64, block_size=block_size, max_num_seqs=2, enable_prefix_caching=False,
              eviction=policy, attn_backend=attn_backend, max_num_batched_tokens=max_num_batched_tokens)
    logits, kept = [], []
    run = eng.runner.execute_model

    def recording(*args, **kwargs):
        out = run(*args, **kwargs)
        if len(out[0]):  # a prompt chunk that does not reach the end samples nothing
            logits.append(out[0][-1].float().clone())
        return out

    def after_step(stats):
        bm = eng.block_manager
        for sid in bm.seqs:
            if eng.seqs[sid].num_computed_tokens < len(prompt):  # a prompt chunk: the policy has not acted yet
                continue
            kept.append(ev.kept_positions(bm.logical_blocks(sid), bm.kept_tokens(sid), block_size))
            bm.check_invariants()
            assert len(bm.block_table(sid)) <= policy.max_blocks(len(prompt), max_tokens, block_size)

    eng.runner.execute_model, eng.on_step = recording, after_step
    out = eng.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))[0]
    assert eng.block_manager.num_free_blocks == eng.block_manager.num_blocks
    return out.token_ids, logits, kept, eng.block_manager.counters["policy_evictions"]


@pytest.mark.parametrize("name", list(POLICIES))
def test_engine_equals_textbook(tiny, name):
    model, _ = tiny
    prompt, policy = _prompt(model, 37), POLICIES[name]()
    tokens, logits, kept, evicted = engine_run(model, prompt, policy, 20, block_size=4)
    book = textbook_eviction(model, prompt, 20, policy, group=4)
    assert evicted > 0  # the budget (16 tokens) is far below 37 + 20: blocks were dropped
    assert tokens == book["tokens"]
    assert len(kept) == len(book["kept"]) == 19
    for step, (a, b) in enumerate(zip(kept, book["kept"])):
        assert torch.equal(a, b), f"step {step}: engine keeps {a.tolist()}, textbook {b.tolist()}"
    for a, b in zip(logits, book["logits"]):
        torch.testing.assert_close(a, b, atol=1e-4, rtol=1e-4)
    full = textbook_eviction(model, prompt, 20, ev.SlidingWindow(10**6))  # the cache that keeps everything
    assert max(float((a - b).abs().max()) for a, b in zip(full["logits"], book["logits"])) > 1e-2  # eviction bites


@pytest.mark.parametrize("name", ["sinks+window", "h2o"])
def test_token_level_rule(tiny, name):
    """block_size 1: the papers' token-level rules, exactly."""
    model, _ = tiny
    prompt, policy = _prompt(model, 30, seed=1), POLICIES[name]()
    tokens, logits, kept, _ = engine_run(model, prompt, policy, 12, block_size=1)
    book = textbook_eviction(model, prompt, 12, policy, group=1)
    assert tokens == book["tokens"]
    assert all(torch.equal(a, b) for a, b in zip(kept, book["kept"]))
    assert all(len(k) == 16 for k in kept)  # token level: exactly the budget
    assert kept[-1][:4].tolist() == [0, 1, 2, 3] if name == "sinks+window" else True


@pytest.mark.parametrize("name", ["h2o", "snapkv"])
def test_chunked_prompt_scores_like_one_prefill(tiny, name):
    """A prompt prefilled in chunks of 8: the scores add up over the chunks to what one prefill sees."""
    model, _ = tiny
    prompt, policy = _prompt(model, 37, seed=4), POLICIES[name]()
    tokens, _, kept, _ = engine_run(model, prompt, policy, 10, block_size=4, max_num_batched_tokens=8)
    book = textbook_eviction(model, prompt, 10, policy, group=4)
    assert tokens == book["tokens"] and all(torch.equal(a, b) for a, b in zip(kept, book["kept"]))


def test_reference_backend_agrees(tiny):
    model, _ = tiny
    prompt, policy = _prompt(model, 33, seed=2), POLICIES["snapkv"]()
    a = engine_run(model, prompt, policy, 10, block_size=4, attn_backend="reference")
    b = engine_run(model, prompt, policy, 10, block_size=4, attn_backend="torch")
    assert a[0] == b[0] and all(torch.equal(x, y) for x, y in zip(a[2], b[2]))


@pytest.mark.parametrize("name", ["sinks+window", "h2o", "snapkv"])
def test_no_leak_after_1000_requests(tiny, name):
    """A small pool (preemptions), shared prefixes (prefix hits on blocks that policies later drop),
    1,000 requests: every block free or owned throughout, all back at the end."""
    model, _ = tiny
    rng = random.Random(0)
    vocab = model.config.vocab_size
    prefixes = [[rng.randrange(3, vocab) for _ in range(24)] for _ in range(5)]
    prompts, params = [], []
    for i in range(1000):
        prompts.append((prefixes[i % 5] if i % 3 else []) + [rng.randrange(3, vocab) for _ in range(rng.randrange(4, 40))])
        params.append(SamplingParams(max_tokens=rng.randrange(2, 30), ignore_eos=True))
    policy = {"sinks+window": ev.SinksWindow(16), "h2o": ev.HeavyHitters(16),
              "snapkv": ev.PromptSelect(20, window=6, kernel=3)}[name]
    eng = LLM(model, None, num_blocks=96, block_size=4, max_num_seqs=32, max_num_batched_tokens=256, eviction=policy)
    bm = eng.block_manager
    steps = [0]

    def after_step(stats):
        steps[0] += 1
        if steps[0] % 25 == 0:
            bm.check_invariants()

    eng.on_step = after_step
    outs = eng.generate(prompts, params)
    assert [len(o.token_ids) for o in outs] == [p.max_tokens for p in params]
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks and not bm.seqs and not eng._evict_states
    assert bm.counters["policy_evictions"] > 1000 and bm.counters["prefix_hits"] > 0


# ---- the host tier ------------------------------------------------------------------------------------

def _conversations(model, num_blocks, host_blocks, turns=4):
    """Six conversations, each turn's prompt the conversation so far: answers per turn and the counters."""
    eng = LLM(model, None, num_blocks=num_blocks, block_size=4, max_num_seqs=4, max_num_batched_tokens=128,
              host_blocks=host_blocks)
    rng = random.Random(0)
    vocab = model.config.vocab_size
    convs = [[rng.randrange(3, vocab) for _ in range(20)] for _ in range(6)]
    answers = []
    for _ in range(turns):
        outs = eng.generate(convs, SamplingParams(max_tokens=6, ignore_eos=True))
        answers.append([o.token_ids for o in outs])
        convs = [c + o.token_ids + [rng.randrange(3, vocab) for _ in range(8)] for c, o in zip(convs, outs)]
        eng.block_manager.check_invariants()
    return answers, eng.block_manager


def test_host_tier_serves_the_same_tokens_from_fewer_device_blocks(tiny):
    """Blocks the small pool's LRU gives away go to the host and come back on a later turn's prefix hit:
    the same tokens as a roomy pool (a wrong copy would change them: the K/V are read back)."""
    model, _ = tiny
    roomy, _ = _conversations(model, 400, 0)
    small, bm_small = _conversations(model, 40, 0)
    tiered, bm = _conversations(model, 40, 200)
    assert tiered == roomy == small
    c = bm.counters
    assert c["host_hits"] > 100 and c["loaded_blocks"] == c["host_hits"] and c["offloaded_blocks"] >= c["loaded_blocks"]
    assert c["prefix_hits"] > 3 * bm_small.counters["prefix_hits"]  # the device pool alone forgot most prefixes
    assert bm.num_free_blocks == bm.num_blocks


def test_a_small_host_tier_forgets_its_oldest():
    bm = BlockManager(4, 4, host_blocks=2)
    for i in range(4):  # four one-block prompts (+1 token each), freed: all cached on the device
        bm.allocate(i, list(range(10 * i, 10 * i + 5)))
        bm.free(i)
    for i in range(4, 8):  # four more take the device: the LRU moves the old ones out, the host keeps 2
        bm.allocate(i, list(range(100 + 10 * i, 100 + 10 * i + 5)))
        bm.free(i)
    assert bm.counters["offloaded_blocks"] >= 4 and bm.counters["host_evictions"] >= 2
    assert len(bm.host) == 2
    bm.check_invariants()
    out, into = bm.take_transfers()
    assert len(out) == bm.counters["offloaded_blocks"] and not into
    with pytest.raises(ValueError, match="host_blocks"):
        BlockManager(4, 4, host_blocks=-1)
    with pytest.raises(ValueError, match="prefix_caching"):
        BlockManager(4, 4, enable_prefix_caching=False, host_blocks=2)


def test_a_host_slot_being_loaded_is_not_reused_in_the_same_step():
    """One host slot: a prompt loads its block back from it, and the same allocation pushes another block
    out. The offload must not take the slot the load still has to read (offloads are applied first)."""
    bm = BlockManager(2, 4, host_blocks=1)
    a, b = [1, 2, 3, 4, 9], [5, 6, 7, 8, 9]
    bm.allocate(0, a)
    bm.free(0)
    bm.allocate(1, b)  # takes A's cached block: A goes to the host
    bm.free(1)
    bm.take_transfers()
    bm.allocate(2, a)  # A comes back from the host, and B's block is pushed out while slot 0 is being read
    out, into = bm.take_transfers()
    assert into and all(slot not in {s for _, s in out} for slot, _ in into)
    bm.check_invariants()


def test_host_tier_refuses_a_quantized_pool(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match="float pools"):
        LLM(model, None, num_blocks=8, block_size=4, kv_cache_dtype="fp8", host_blocks=4)


# ---- the block manager's side ------------------------------------------------------------------------

def _bm_with(n_tokens, block_size=4, num_blocks=16):
    bm = BlockManager(num_blocks, block_size)
    bm.allocate(0, list(range(10, 10 + n_tokens)))
    return bm


def _snapshot(bm):
    return (bm.stats(), {s: bm.block_table(s) for s in bm.seqs}, {s: bm.logical_blocks(s) for s in bm.seqs},
            list(bm.free_ids), list(bm.cached_ids))


def test_evict_frees_and_keeps_order():
    bm = _bm_with(18)  # blocks 0..4, the last holds 2 tokens
    table = bm.block_table(0)
    assert bm.evict(0, [1, 3]) == 2
    assert bm.block_table(0) == [table[0], table[2], table[4]] and bm.logical_blocks(0) == [0, 2, 4]
    assert bm.kept_tokens(0) == 10 and bm.counters["policy_evictions"] == 2
    assert set(bm.eviction_order()) == {table[1], table[3]}  # registered blocks stay reusable by a prefix hit
    bm.check_invariants()
    slot = bm.append_slot(0, 99)  # position 18: block 4, offset 2
    assert slot == table[4] * 4 + 2 and bm.slot_mapping(0, 18, 19) == [slot]
    for _ in range(2):
        bm.append_slot(0, 99)
    assert bm.logical_blocks(0) == [0, 2, 4, 5]  # position 20 opened logical block 5
    bm.check_invariants()
    with pytest.raises(ValueError, match="evicted blocks"):
        bm.slot_mapping(0, 5, 7)
    bm.free(0)
    bm.check_invariants()
    assert bm.num_free_blocks == bm.num_blocks


@pytest.mark.parametrize("bad, err", [([4], ValueError), ([9], ValueError), ([1, 1], ValueError), ([1.0], TypeError),
                                      ("1", TypeError), (3, TypeError), ([0, 4], ValueError)])
def test_evict_bad_input_changes_nothing(bad, err):
    bm = _bm_with(18)
    bm.evict(0, [2])
    before = _snapshot(bm)
    with pytest.raises(err):
        bm.evict(0, bad if bad != [9] else [2])  # [2] again: already evicted
    assert _snapshot(bm) == before
    with pytest.raises(ValueError, match="not allocated"):
        bm.evict(7, [0])


def test_shared_block_stays_with_the_other_sequence():
    bm = _bm_with(12)
    bm.fork(0, 1)
    assert bm.evict(0, [0]) == 0  # still referenced by sequence 1: nothing goes back to the pool
    assert bm.logical_blocks(1) == [0, 1, 2] and bm.logical_blocks(0) == [1, 2]
    bm.fork(0, 2)  # a fork of an evicted sequence carries its gaps
    assert bm.logical_blocks(2) == [1, 2]
    bm.check_invariants()


def test_blocks_computed_after_an_eviction_are_not_prefix_hits():
    """A block filled after an eviction holds K/V computed without the dropped tokens: another request
    with the same tokens must not hit it."""
    bm = BlockManager(32, 4)
    ids = list(range(10, 22))  # 3 full blocks
    bm.allocate(0, ids)
    bm.evict(0, [0])
    more = list(range(50, 54))
    for t in more:
        bm.append_slot(0, t)
    bm.append_slot(0, 60)  # the block of 50..53 is full now
    assert bm.allocation_cost(ids + more + [60])[0] == 2  # hits blocks 0-2 (filled before the eviction), not 3
    bm.check_invariants()


def test_engine_refuses_bad_eviction(tiny):
    model, _ = tiny
    with pytest.raises(TypeError, match="eviction must be"):
        LLM(model, None, num_blocks=8, block_size=4, eviction="h2o")
    with pytest.raises(ValueError, match="needs at least"):
        LLM(model, None, num_blocks=8, block_size=4, eviction=ev.SinksWindow(4, sinks=4))
    with pytest.raises(ValueError, match="budget"):
        ev.make_policy("window")
    with pytest.raises(ValueError, match="one of"):
        ev.make_policy("lru", 64)
    with pytest.raises(ValueError, match="recent"):
        ev.HeavyHitters(64, recent=1.5)
    with pytest.raises(ValueError, match="kernel"):
        ev.PromptSelect(64, kernel=4)


def test_engine_refuses_eviction_on_a_sliding_window_model():
    model = kvlab.models.tiny_model("mistral")
    with pytest.raises(ValueError, match="slides"):
        LLM(model, None, num_blocks=8, block_size=4, eviction=ev.SlidingWindow(8))


def test_block_rule_equals_dense_rule_on_random_scores():
    """choose() over block ids and textbook_keep() over dense masks, stepped through a sequence's life
    with random scores: the same kept positions at every step, for many sizes."""
    rng = random.Random(3)
    for trial in range(60):
        bs = rng.choice([1, 2, 4, 8])
        policy = rng.choice([ev.SlidingWindow(8 * bs), ev.SinksWindow(6 * bs, sinks=rng.randrange(1, 2 * bs + 1)),
                             ev.HeavyHitters(6 * bs, recent=rng.choice([0.25, 0.5, 0.75])),
                             ev.PromptSelect(8 * bs, window=rng.randrange(1, 2 * bs + 1), kernel=rng.choice([1, 3, 5]))])
        prompt_len, total = rng.randrange(1, 80), None
        total = prompt_len + rng.randrange(1, 40)
        logical, kept, done = None, torch.ones(prompt_len, dtype=torch.bool), False
        scores = torch.zeros(total, dtype=torch.float64)
        for n in range(prompt_len, total):
            scores[:n] += torch.rand(n, generator=torch.Generator().manual_seed(trial * 1000 + n)).double() * kept
            logical = list(range(-(-n // bs))) if logical is None else logical
            if not (policy.once and done):
                drop = policy.choose(logical, n, prompt_len, bs, scores[:n])
                logical = [lb for lb in logical if lb not in drop]
                kept = policy.textbook_keep(kept, prompt_len, scores[:n], bs)
                done = True
            got = ev.kept_positions(logical, n - (-(-n // bs) - len(logical)) * bs, bs)
            assert torch.equal(got, torch.nonzero(kept).flatten()), (policy, n, bs)
            kept = torch.cat([kept, torch.ones(1, dtype=torch.bool)])
            if n % bs == 0:  # position n opens a new block
                logical.append(n // bs)


def test_a_policy_that_raises_leaves_the_engine_serving(tiny):
    """A participant's keep() that answers wrongly raises from step(); the step's tokens are still
    committed, so the engine serves on (it used to stall: every later step found nothing to run)."""
    model, tok = tiny
    answers = iter([[999], None])  # first call: a block that does not exist; then kvlab's own rule

    def keep(num_tokens, block_size, budget, sinks):
        answer = next(answers, None)
        return answer if answer is not None else ev.sinks_window_blocks(num_tokens, block_size, budget, sinks)

    llm = LLM(model, tok, num_blocks=32, block_size=4, max_num_seqs=2, enable_prefix_caching=False)
    params = SamplingParams(max_tokens=6, ignore_eos=True, eviction=ev.SinksWindow(16, sinks=4, keep=keep))
    rid = llm.add_request([3 + i % 40 for i in range(30)], params)
    with pytest.raises(ValueError, match="keep"):
        llm.step()
    assert len(llm.seqs[rid].output_token_ids) == 1  # the prefill's token was committed
    while llm.has_unfinished():
        llm.step()
    assert len(llm.seqs[rid].output_token_ids) == 6 and llm.block_manager.num_free_blocks == 32


def test_forced_tokens_are_checked_against_the_vocabulary(tiny):
    model, tok = tiny
    llm = LLM(model, tok, num_blocks=16, block_size=4)
    with pytest.raises(ValueError, match="forced_token_ids"):
        llm.add_request([5, 6, 7], SamplingParams(max_tokens=2, forced_token_ids=[10**6]))
    assert not llm.has_unfinished()


@pytest.mark.parametrize("name", ["h2o", "snapkv"])
def test_a_prompt_hit_in_the_prefix_cache_scores_like_one_computed(tiny, name):
    """A scoring request whose prompt blocks are prefix hits gets the attention of the rows it did not
    compute from the request that did (the engine keeps each prompt block's rows by its hash): the same
    scores, kept positions and tokens as with no prefix cache. Without those rows the scores differ."""
    model, _ = tiny
    prompt, params = _prompt(model, 37, seed=3), SamplingParams(max_tokens=12, ignore_eos=True)

    def follow(shared: bool, forget_rows: bool = False):
        eng = LLM(model, None, num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=64,
                  enable_prefix_caching=shared, eviction=POLICIES[name]())
        eng.generate([prompt], params)  # the first request computes the prompt (and, shared, leaves its blocks)
        if forget_rows:
            eng._prompt_rows.clear()
        scores, kept = [], []
        rid = eng.add_request(prompt, params)

        def after_step(stats):
            bm = eng.block_manager
            if rid in bm.seqs and eng.seqs[rid].num_computed_tokens >= len(prompt):
                scores.append(eng.eviction_scores(rid).clone())
                kept.append(bm.logical_blocks(rid))
        eng.on_step = after_step
        while eng.has_unfinished():
            eng.step()
        return eng.seqs[rid].output_token_ids, scores, kept, eng.block_manager.counters["prefix_hits"]

    tokens, scores, kept, hits = follow(True)
    ref_tokens, ref_scores, ref_kept, ref_hits = follow(False)
    assert hits == 9 and ref_hits == 0  # the 9 full blocks of 37 tokens were hits, the last one computed
    assert tokens == ref_tokens and kept == ref_kept
    assert len(scores) == len(ref_scores) == 11  # every step but the last, which finishes it
    for a, b in zip(scores, ref_scores):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    _, blind, _, _ = follow(True, forget_rows=True)
    assert not torch.allclose(blind[0], ref_scores[0], rtol=1e-3)  # the kept rows are what made them equal


@pytest.mark.parametrize("name", ["h2o", "snapkv"])
def test_prefix_hits_in_the_same_step_and_across_chunks_score_as_computed(tiny, name):
    """A request that hits blocks the one before it computes in that very forward (both in one step), and
    one that hits blocks computed in chunks of 18 tokens ending inside blocks of 4: each one's scores
    after its prompt equal those of the prompt computed alone with no prefix cache."""
    model, _ = tiny
    prompt, params = _prompt(model, 37, seed=5), SamplingParams(max_tokens=3, ignore_eos=True)

    def first_scores(shared: bool, budget: int, batches: list[int]) -> tuple[list, int]:
        eng = LLM(model, None, num_blocks=64, block_size=4, max_num_seqs=2, max_num_batched_tokens=budget,
                  enable_prefix_caching=shared, eviction=POLICIES[name]())
        got = {}

        def after_step(stats):
            for sid in eng.block_manager.seqs:
                if sid not in got and eng.seqs[sid].num_computed_tokens >= len(prompt):
                    got[sid] = (stats.step, eng.eviction_scores(sid).clone())
        eng.on_step = after_step
        for n in batches:
            eng.generate([prompt] * n, params)
        return [got[k] for k in sorted(got)], eng.block_manager.counters["prefix_hits"]

    ((_, alone),), _ = first_scores(False, 64, [1])
    pair, hits = first_scores(True, 64, [2])  # one step: A computes 37 tokens, B hits its 9 blocks
    assert hits == 9 and pair[0][0] == pair[1][0]  # both prompts done in the same step
    chunked, hits = first_scores(True, 18, [1, 1])  # A in chunks 18 + 18 + 1, then B hits its 9 blocks
    assert hits == 9
    for _, scores in pair + chunked:
        torch.testing.assert_close(scores, alone, rtol=1e-5, atol=1e-6)
