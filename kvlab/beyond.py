"""When the cache does not fit (notebook 07): evict or quantize at the same bytes, and a retrieval
task that shows what eviction forgets.

* :func:`equal_byte_budgets` — for each quantized format, the FP16 token budget that holds the same
  bytes at the end of a text;
* :func:`quantize_or_evict` — every format and every eviction policy scored on one text against the
  full cache (:func:`kvlab.eval.eviction_quality`), and one computed verdict per budget;
* :func:`passkey_prompts`, :func:`passkey` — a number hidden early in a long prompt, asked for at its
  end, served by the engine with each policy;
* :func:`chat_workload`, :func:`simulate_fleet` — multi-turn chats (each prompt the conversation so
  far) on one or many engines' real schedulers and block managers, on a simulated clock whose steps
  take what :func:`fit_step_time` fitted to the real engine's measured steps, behind a router; and
  :func:`tier_projection`, the host tier's counted bytes as link times against recomputation.
"""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

import torch

from kvlab.cache import BlockManager, QuantizedPagedKVCache
from kvlab.cache.evict import POLICIES, PromptSelect, make_policy
from kvlab.data import play_text, plays
from kvlab.engine import LLM, SamplingParams, Sequence
from kvlab.engine.scheduler import Scheduler
from kvlab.eval import answers_after_cut, eviction_quality
from kvlab.quant import named_config
from kvlab.sizing import kv_bytes_per_token, kv_config
from kvlab.validate import cdiv, check_int

#: the quantized formats set against eviction, and their labels
FORMATS = ("int8", "k8v4", "int4")
TIE_KL = 2.0  # quantize_or_evict: KLs closer than this factor, with overlapping perplexity intervals, are a tie


def block_share(model, fmt: str, block_size: int = 16, calibration=None) -> float:
    """Bytes of one ``fmt`` block over one FP16 block (per-token scales included; a static format's
    per-layer scale tables are a fixed cost outside the blocks, and need its ``calibration``)."""
    def one(f):
        return QuantizedPagedKVCache.from_model(model, 1, block_size, named_config(f), calibration).bytes_per_block
    return one(fmt) / one("fp16")


def equal_byte_budgets(model, num_tokens: int, formats=FORMATS, block_size: int = 16, calibration=None) -> dict[str, int]:
    """For each format: the FP16 budget (tokens, whole blocks) that holds what the format's full cache of
    ``num_tokens`` tokens holds, in bytes, at the end of the text (the peak, which decides what fits)."""
    full = cdiv(num_tokens, block_size)
    return {f: int(block_share(model, f, block_size, calibration) * full) * block_size for f in formats}


def equal_bytes_verdict(fmt: dict, policy: dict) -> tuple[str, float | None]:
    """-> (verdict, factor) for a quantized format's scores against one eviction policy's at the same
    bytes (each a dict with ``kl`` and ``delta_ppl_ci95``): ``factor`` is the policy's KL over the
    format's; ``tie`` when the factor is within :data:`TIE_KL` either way and the perplexity intervals
    overlap, else ``quantize`` or ``evict`` by the lower KL."""
    factor = policy["kl"] / fmt["kl"] if fmt["kl"] > 0 else None
    (lo, hi), (plo, phi) = fmt["delta_ppl_ci95"], policy["delta_ppl_ci95"]
    if factor is not None and 1 / TIE_KL < factor < TIE_KL and lo <= phi and plo <= hi:
        return "tie", factor
    return ("evict" if policy["kl"] < fmt["kl"] else "quantize"), factor


def quantize_or_evict(model, tokens: list[int], prompt_len: int, calibration=None, formats=FORMATS,
                      policies=tuple(POLICIES), extra_budgets=(64,), block_size: int = 16, options=None) -> dict:
    """Score every format (full cache) and every policy (FP16, at the formats' equal-byte budgets and at
    ``extra_budgets``) on one text. SnapKV keeps every answer token, so at a budget it is given
    ``budget - answer tokens`` for its prompt (where that is too small, it does not take part).

    Returns the :func:`~kvlab.eval.eviction_quality` result, ``budgets`` (format -> tokens) and
    ``verdicts``: one per format, against the best policy at the same bytes (lowest next-token KL
    against the full FP32 cache): ``tie`` when neither KL is :data:`TIE_KL` times the other's or more
    and the two perplexity changes' 95 % intervals overlap (the measurements cannot separate them),
    else ``quantize`` or ``evict``, whichever has the lower KL. ``factor`` is the best policy's KL over
    the format's."""
    options = options or {}
    budgets = equal_byte_budgets(model, len(tokens) - 1, formats, block_size, calibration)
    answer = len(tokens) - 1 - prompt_len  # tokens fed after the prompt: SnapKV keeps them all
    configs = {f: (None, f) for f in formats}
    where = {}  # config name -> the budget (end-of-text tokens) it is compared at
    for b in sorted(set(budgets.values()) | set(extra_budgets)):
        for p in policies:
            own = b - answer if POLICIES[p] is PromptSelect else b
            try:
                policy = make_policy(p, own, **options.get(p, {})) if own > 0 else None
                if policy is not None:
                    policy.budget_blocks(block_size)
            except ValueError:
                policy = None
            if policy is not None:
                configs[f"{p}@{b}"] = (policy, "fp16")
                where[f"{p}@{b}"] = b
    result = eviction_quality(model, tokens, prompt_len, configs, calibration=calibration, block_size=block_size)
    cs = result["configs"]
    verdicts = []
    for f in formats:
        b = budgets[f]
        rivals = {n: cs[n] for n, bb in where.items() if bb == b}
        best = min(rivals, key=lambda n: rivals[n]["kl"]) if rivals else None
        verdict, factor = equal_bytes_verdict(cs[f], rivals[best]) if best else ("quantize", None)
        verdicts.append({
            "format": f, "budget": b, "bytes_share": cs[f]["bytes_share"], "kl_format": cs[f]["kl"],
            "best_policy": best, "kl_best_policy": rivals[best]["kl"] if best else None,
            "verdict": verdict, "factor": factor})
    return {"result": result, "budgets": budgets, "where": where, "verdicts": verdicts}


# ---- a retrieval task ----------------------------------------------------------------------------------

QUESTION = " What is the pass key?"
CUTS = ("after the prompt", "before the question")  # where passkey() cuts the cache
DEPTHS = (0.1, 0.3, 0.5)  # where passkey_prompts() hides the key, in turn: a share of the haystack
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def _depth(i: int) -> float:
    """The depth of pass-key prompt ``i``: :data:`DEPTHS` in turn."""
    return DEPTHS[i % len(DEPTHS)]


def passkey_prompts(tokenizer, n: int = 6, filler_repeats: int = 20, seed: int = 0,
                    haystack: str = "filler", question_starts: bool = False) -> tuple:
    """``n`` prompts, each hiding a five-digit pass key at a depth of 10, 30 and 50 % of a haystack in
    turn (:data:`DEPTHS`: prompt i at ``DEPTHS[i % 3]``), and asking for it at the end. Returns
    (token ids, keys).

    ``haystack``: "filler", ``filler_repeats`` copies of five plain sentences (the usual pass-key
    test: the key is the one sentence unlike the others), or a play's name (:func:`kvlab.data.plays`):
    as many of its lines, from a random place, as the filler would take tokens, so the key sits in
    text where every line is different. ``question_starts=True`` adds a third list: where each
    prompt's question begins."""
    check_int("n", n)
    check_int("filler_repeats", filler_repeats)
    if haystack != "filler" and haystack not in plays():
        raise ValueError(f"haystack must be 'filler' or a play's name ({', '.join(plays()[:3])}, ...), got {haystack!r}")
    rng, place = random.Random(seed), random.Random(seed + 1)
    lines = [] if haystack == "filler" else [line for line in play_text(haystack).splitlines() if line.strip()]
    budget = len(tokenizer.encode(FILLER * filler_repeats))
    prompts, keys, starts = [], [], []
    for i in range(n):
        key = rng.randrange(10000, 100000)
        depth = _depth(i)
        if haystack == "filler":
            before = int(filler_repeats * depth)
            head, tail = FILLER * before, FILLER * (filler_repeats - before)
        else:
            start, hay, used = place.randrange(len(lines) - 400), [], 0
            while used < budget:
                hay.append(lines[start + len(hay)] + "\n")
                used += len(tokenizer.encode(hay[-1]))
            at = max(1, round(len(hay) * depth))
            head, tail = "".join(hay[:at]), "".join(hay[at:])
        document = ("There is an important piece of information hidden in a lot of irrelevant text. Find it and "
                    f"memorize it.\n{head}The pass key is {key}. Remember it. {key} is the pass key.\n{tail}")
        # the document's ids, then the question's: where the question starts is known exactly
        question = (QUESTION if document.endswith(" ") else QUESTION.lstrip()) + " The pass key is"
        ids = list(tokenizer.encode(document.rstrip(" ")))
        prompts.append(ids + list(tokenizer.encode(question)))
        starts.append(len(ids))
        keys.append(key)
    return (prompts, keys, starts) if question_starts else (prompts, keys)


def passkey_blocks(tokenizer, prompt: list[int], key: int, block_size: int = 16) -> list[int]:
    """-> the logical blocks of ``prompt`` that hold a token of ``key``, everywhere it is written (the
    prompt states it twice)."""
    ids = list(tokenizer.encode(f" {key}"))
    at = [i for i in range(len(prompt) - len(ids) + 1) if prompt[i:i + len(ids)] == ids]
    if not at:
        raise ValueError(f"key {key} does not occur in the prompt")
    return sorted({(i + j) // block_size for i in at for j in range(len(ids))})


def passkey(model, tokenizer, policies: dict, n: int = 6, filler_repeats: int = 20, seed: int = 0,
            block_size: int = 16, cut: str = "after the prompt", haystack: str = "filler") -> dict:
    """Serve the pass-key prompts once per policy (name -> EvictionPolicy or None: the full cache) and
    count the answers that contain the key. Returns name -> {"correct", "n", "answers", "found" (per prompt), "depths", ...}.

    ``cut`` (:data:`CUTS`): "after the prompt" serves each prompt through ``LLM(eviction=...)``, which
    cuts once the whole prompt, question included, is prefilled; "before the question" cuts the cache
    when the document is prefilled and feeds the question after it
    (:func:`kvlab.eval.answers_after_cut`): the policies choose without knowing what will be asked."""
    if cut not in CUTS:
        raise ValueError(f"cut must be one of {CUTS}, got {cut!r}")
    prompts, keys, starts = passkey_prompts(tokenizer, n, filler_repeats, seed, haystack, question_starts=True)
    longest = max(map(len, prompts))
    answers = {name: [] for name in policies}
    if cut == "after the prompt":
        for name, policy in policies.items():
            llm = LLM(model, tokenizer, num_blocks=n * cdiv(longest + 8, block_size) + 8, block_size=block_size,
                      max_num_seqs=n, max_num_batched_tokens=max(512, longest), eviction=policy,
                      enable_prefix_caching=False)
            answers[name] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))]
    else:
        for prompt, at in zip(prompts, starts):
            for name, ids in answers_after_cut(model, prompt, at, policies, 8, block_size).items():
                answers[name].append(ids)
    out = {}
    for name, ids in answers.items():
        text = [tokenizer.decode(a) for a in ids]
        found = [str(k) in a for a, k in zip(text, keys)]
        out[name] = {"correct": sum(found), "n": n, "answers": text, "found": found,
                     "depths": [_depth(i) for i in range(n)],
                     "prompt_tokens": longest, "cut": cut, "haystack": haystack}
    return out


# ---- many turns, many engines: the scheduler without a model, on a clock ------------------------------

@dataclass
class Conversation:
    """One chat: a system prompt shared by every conversation, then turns of (user tokens, answer
    tokens). Turn k's prompt is everything before its answer: the conversation so far."""

    system: list[int]
    turns: list[tuple[list[int], list[int]]]

    def prompt(self, k: int) -> list[int]:
        ids = list(self.system)
        for i, (user, answer) in enumerate(self.turns[:k + 1]):
            ids += user + (answer if i < k else [])
        return ids


def chat_workload(conversations: int = 32, turns: int = 4, system_tokens: int = 64, user=(16, 64), answer=(16, 96),
                  seed: int = 0, vocab: int = 49152) -> list[Conversation]:
    """Multi-turn chats with made-up token ids (the scheduler needs counts and, for prefix hits, ids):
    one shared system prompt, user turns and answers of uniform random lengths."""
    for name, v in (("conversations", conversations), ("turns", turns), ("system_tokens", system_tokens)):
        check_int(name, v)
    rng = random.Random(seed)
    tok = lambda n: [rng.randrange(100, vocab) for _ in range(n)]  # noqa: E731
    system = tok(system_tokens)
    return [Conversation(system, [(tok(rng.randint(*user)), tok(rng.randint(*answer))) for _ in range(turns)])
            for _ in range(conversations)]


@dataclass
class StepTimeModel:
    """``seconds = fixed + per_prefill_token * prefill tokens + per_decode * decodes``, fitted by least
    squares to an engine's measured steps; ``error`` the median relative error on those steps."""

    fixed: float
    per_prefill_token: float
    per_decode: float
    error: float = float("nan")
    steps: int = 0

    def __call__(self, prefill_tokens: int, decodes: int) -> float:
        return self.fixed + self.per_prefill_token * prefill_tokens + self.per_decode * decodes

    def __str__(self) -> str:
        return (f"step = {1e3 * self.fixed:.1f} ms + {1e3 * self.per_prefill_token:.3f} ms x prefill tokens + "
                f"{1e3 * self.per_decode:.2f} ms x decodes (median error {self.error:.0%} on {self.steps} steps)")


def fit_step_time(step_stats) -> StepTimeModel:
    """Fit :class:`StepTimeModel` to ``LLM.step_stats`` (at least 3 steps of different shapes)."""
    rows = [(1.0, s.prefill_tokens, s.decode_tokens) for s in step_stats]
    if len(rows) < 3:
        raise ValueError(f"fit_step_time needs at least 3 steps, got {len(rows)}")
    x = torch.tensor(rows, dtype=torch.float64)
    y = torch.tensor([s.total_s for s in step_stats], dtype=torch.float64)
    free = [0, 1, 2]  # least squares with every coefficient >= 0: a negative one is pinned at 0, the rest refitted
    while True:
        sol = torch.linalg.lstsq(x[:, free], y[:, None]).solution[:, 0]
        if (sol >= 0).all() or len(free) == 1:
            break
        free.pop(int(sol.argmin()))
    coef = [0.0, 0.0, 0.0]
    for i, c in zip(free, sol.clamp(min=0).tolist()):
        coef[i] = c
    model = StepTimeModel(*coef, steps=len(rows))
    rel = sorted(abs(model(p, d) - t) / t for (_, p, d), t in zip(rows, y.tolist()))
    model.error = rel[len(rel) // 2]
    return model


#: the clock notebook 07 simulates on: the fit made on the lab's machine when the notebook was written (AMD EPYC,
#: 2 cores, 2026-12-04, 161 measured steps of SmolLM2), kept so that every run tells the same simulated story; each
#: run's own fit is printed beside it, and passing that one instead simulates on this machine
RECORDED_STEP_TIME = StepTimeModel(fixed=0.0196, per_prefill_token=0.000776, per_decode=0.00129, error=0.07, steps=161)

ROUTERS = ("round-robin", "least-loaded", "prefix-affinity")


class _Replica:
    def __init__(self, i, num_blocks, block_size, host_blocks, max_num_seqs, max_num_batched_tokens):
        self.index = i
        self.bm = BlockManager(num_blocks, block_size, host_blocks=host_blocks)
        self.sched = Scheduler(self.bm, max_num_seqs, max_num_batched_tokens, "continuous", 0.01)
        self.busy_until = None  # the end of the step in flight, or None: idle
        self.batch = None
        self.moved_out = self.moved_in = 0  # host tier blocks

    @property
    def load(self) -> int:
        return len(self.sched.running) + len(self.sched.waiting)


def _route(router: str, replicas, prompt, counter: int):
    if router == "round-robin":
        return replicas[counter % len(replicas)]
    least = min(replicas, key=lambda r: (r.load, r.index))
    if router == "least-loaded":
        return least
    # prefix-affinity: the replica whose prefix cache (device or host) holds the most of this prompt's
    # leading blocks, by the block manager's own hash chain; unless it is far busier than the least loaded
    hits = {r.index: len(r.bm._match_prefix(prompt)) for r in replicas}
    best = max(replicas, key=lambda r: (hits[r.index], -r.load, -r.index))
    return best if best.load <= least.load + best.sched.max_num_seqs // 2 else least


def simulate_fleet(conversations: list[Conversation], replicas: int, router: str, step_time: StepTimeModel,
                   num_blocks: int = 512, block_size: int = 16, host_blocks: int = 0, max_num_seqs: int = 16,
                   max_num_batched_tokens: int = 512, think_s: float = 1.0, arrival_gap_s: float = 0.25) -> dict:
    """Serve multi-turn chats on ``replicas`` engines behind a ``router`` (:data:`ROUTERS`), each engine
    its real :class:`~kvlab.engine.scheduler.Scheduler` and :class:`~kvlab.cache.BlockManager` (prefix
    cache on, an optional host tier), each step taking ``step_time(prefill tokens, decodes)`` seconds of
    simulated time. Conversation *c* starts at ``c * arrival_gap_s``; each next turn arrives
    ``think_s`` after the previous answer is complete (its prompt: the conversation so far).

    Returns TTFT p50/p99 (s), output tokens per second over the run, the prefix hit rate (blocks found
    cached / blocks asked for, device and host), host-tier blocks moved each way, and per-replica counts."""
    if router not in ROUTERS:
        raise ValueError(f"router must be one of {ROUTERS}, got {router!r}")
    check_int("replicas", replicas)
    fleet = [_Replica(i, num_blocks, block_size, host_blocks, max_num_seqs, max_num_batched_tokens)
             for i in range(replicas)]
    events = [(c * arrival_gap_s, 0, c, 0) for c in range(len(conversations))]  # (time, kind 0 arrival, conv, turn)
    heapq.heapify(events)
    ttft, outputs, finished_at, served_by = [], 0, 0.0, [0] * replicas
    next_id, routed = 0, 0
    meta = {}  # seq_id -> (conversation, turn, arrival time, answer ids)

    def start(rep, now):
        if rep.busy_until is not None or not rep.sched.has_unfinished():
            return
        batch = rep.sched.schedule()
        out, into = rep.bm.take_transfers()
        rep.moved_out += len(out)
        rep.moved_in += len(into)
        if not batch.seqs:
            return
        rep.batch = batch
        rep.busy_until = now + step_time(batch.num_prefill_tokens, batch.num_decodes)
        heapq.heappush(events, (rep.busy_until, 1, rep.index, -1))

    while events:
        now, kind, a, b = heapq.heappop(events)
        if kind == 0:  # a turn arrives
            conv = conversations[a]
            prompt, answer = conv.prompt(b), conv.turns[b][1]
            rep = _route(router, fleet, prompt, routed)
            routed += 1
            seq = Sequence(next_id, prompt, SamplingParams(max_tokens=len(answer)), now)
            meta[next_id] = (a, b, now, answer)
            next_id += 1
            rep.sched.add(seq)
            served_by[rep.index] += 1
            start(rep, now)
            continue
        rep = fleet[a]  # a step ends
        batch, rep.batch, rep.busy_until = rep.batch, None, None
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens < seq.num_tokens:
                continue
            c, k, arrived, answer = meta[seq.seq_id]
            if not seq.output_token_ids:
                ttft.append(now - arrived)
            seq.append_token(answer[len(seq.output_token_ids)])
            outputs += 1
            if len(seq.output_token_ids) == len(answer):
                rep.sched.finish(seq, "length")
                finished_at = max(finished_at, now)
                if k + 1 < len(conversations[c].turns):
                    heapq.heappush(events, (now + think_s, 0, c, k + 1))
        start(rep, now)
    q = sum(r.bm.counters["prefix_queries"] for r in fleet)
    h = sum(r.bm.counters["prefix_hits"] for r in fleet)
    ttft.sort()
    pick = lambda p: ttft[min(len(ttft) - 1, int(p * len(ttft)))]  # noqa: E731
    for r in fleet:
        r.bm.check_invariants()
    return {"replicas": replicas, "router": router, "requests": len(ttft), "ttft_p50_s": pick(0.5),
            "ttft_p99_s": pick(0.99), "output_tok_s": outputs / finished_at if finished_at else 0.0,
            "prefix_hit_rate": h / q if q else 0.0, "prefix_hits": h, "prefix_queries": q,
            "host_hits": sum(r.bm.counters["host_hits"] for r in fleet),
            "blocks_to_host": sum(r.moved_out for r in fleet), "blocks_from_host": sum(r.moved_in for r in fleet),
            "device_evictions": sum(r.bm.counters["evictions"] for r in fleet),
            "preemptions": sum(r.sched.num_preemptions for r in fleet), "served_by": served_by,
            "makespan_s": finished_at}


#: links a host tier moves blocks over, GB/s per direction (the published peak; real copies reach less)
LINKS = {"PCIe 4.0 x16": 32e9, "PCIe 5.0 x16": 64e9, "NVLink-C2C (GH200)": 450e9}
#: the GPU a recomputation is projected on: H100 SXM, dense BF16 tensor-core peak (FLOP/s)
GPU_FLOPS = ("H100 SXM, BF16 dense peak", 989e12)


def prefill_flops(model, tokens: int) -> float:
    """FLOPs a prefill of ``tokens`` tokens costs: 2 x parameters per token (a multiply-add per
    weight; attention left out), for a model preset or :class:`~kvlab.sizing.KVConfig`."""
    return 2 * kv_config(model).num_params * tokens


def tier_projection(blocks_moved: int, tokens_saved: int, model: str = "llama-3-8b", block_size: int = 16) -> dict:
    """The host tier's counts as times, **projected** (nothing here is measured: on a CPU both tiers are
    the same RAM). ``blocks_moved`` host -> device for ``tokens_saved`` prompt tokens not recomputed, for
    a model preset of :mod:`kvlab.sizing`: the bytes over each named link at its peak, against the
    prefill FLOPs (2 x parameters per token, attention left out) at :data:`GPU_FLOPS`' peak. Both are
    lower bounds; their ratio says which way the choice leans."""
    cfg = kv_config(model)
    per_token = kv_bytes_per_token(model, "fp16")
    moved = blocks_moved * block_size * per_token
    flops = prefill_flops(cfg, tokens_saved)
    recompute_s = flops / GPU_FLOPS[1]
    return {"model": cfg.name, "bytes_per_token": per_token, "bytes_moved": moved, "recompute_flops": flops,
            "recompute_s": recompute_s, "gpu": GPU_FLOPS[0],
            "links": {name: {"seconds": moved / bw, "x_faster_than_recompute": recompute_s / (moved / bw) if moved else None}
                      for name, bw in LINKS.items()}}


def kept_blocks(model, prompt: list[int], policies, budgets, max_tokens: int = 8, block_size: int = 16) -> dict:
    """Serve one prompt once per (budget, policy name) and record, at the last step before it finishes,
    which logical blocks the sequence kept, each block's score (scoring policies), and the pool's
    counters. Returns ``{budget: {policy: {"kept", "num_blocks", "scores", "dropped", "free", "tokens"}}}``."""
    out = {}
    for budget in budgets:
        out[budget] = {}
        for name in policies:
            policy = make_policy(name, budget)
            llm = LLM(model, None, num_blocks=cdiv(len(prompt) + max_tokens, block_size) + 4, block_size=block_size,
                      max_num_seqs=1, max_num_batched_tokens=max(512, len(prompt)), eviction=policy,
                      enable_prefix_caching=False)
            snap = {}

            def record(stats, llm=llm, snap=snap):
                bm = llm.block_manager
                for sid in bm.seqs:
                    state = llm._evict_states.get(sid)
                    n = bm.num_tokens(sid)
                    scores = None
                    if state is not None and policy.needs_scores and len(state.scores):
                        s = state.scores
                        scores = [float(s[i * block_size:(i + 1) * block_size].sum()) for i in range(cdiv(n, block_size))]
                    snap.update(kept=bm.logical_blocks(sid), num_blocks=cdiv(n, block_size), scores=scores,
                                dropped=bm.counters["policy_evictions"], free=bm.num_free_blocks, tokens=n,
                                pool=bm.num_blocks)

            llm.on_step = record
            llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            out[budget][name] = snap
    return out
