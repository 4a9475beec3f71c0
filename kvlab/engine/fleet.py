"""Many turns on many engines (notebook 07): chats on real schedulers and block managers behind a
router, on a clock fitted to the real engine's steps; and the host tier's bytes as link times."""

from __future__ import annotations

import heapq
import random
from dataclasses import dataclass

import torch

from kvlab.cache import BlockManager
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.sequence import Sequence
from kvlab.sizing import kv_bytes_per_token, kv_config
from kvlab.validate import check_int


@dataclass
class Conversation:
    """One chat after a shared system prompt; turn k's prompt is everything before its answer."""

    system: list[int]
    turns: list[tuple[list[int], list[int]]]

    def prompt(self, k: int) -> list[int]:
        ids = list(self.system)
        for i, (user, answer) in enumerate(self.turns[:k + 1]):
            ids += user + (answer if i < k else [])
        return ids


def chat_workload(conversations: int = 32, turns: int = 4, system_tokens: int = 64, user=(16, 64), answer=(16, 96),
                  seed: int = 0, vocab: int = 49152) -> list[Conversation]:
    """Made-up chats: the scheduler needs counts and, for prefix hits, ids; lengths are uniform random."""
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
    hits = {r.index: len(r.bm.cached_prefix_blocks(prompt)) for r in replicas}
    best = max(replicas, key=lambda r: (hits[r.index], -r.load, -r.index))
    return best if best.load <= least.load + best.sched.max_num_seqs // 2 else least


def simulate_fleet(conversations: list[Conversation], replicas: int, router: str, step_time: StepTimeModel,
                   num_blocks: int = 512, block_size: int = 16, host_blocks: int = 0, max_num_seqs: int = 16,
                   max_num_batched_tokens: int = 512, think_s: float = 1.0, arrival_gap_s: float = 0.25) -> dict:
    """Serve chats on ``replicas`` real schedulers behind ``router``, each step ``step_time(...)``
    simulated seconds; a turn arrives ``think_s`` after the previous answer. Returns TTFT, throughput,
    the prefix hit rate (blocks found cached / asked for) and host-tier traffic."""
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
    """Prefill FLOPs: 2 x parameters per token (a multiply-add per weight; attention left out)."""
    return 2 * kv_config(model).num_params * tokens


def tier_projection(blocks_moved: int, tokens_saved: int, model: str = "llama-3-8b", block_size: int = 16) -> dict:
    """Moving blocks over each link vs recomputing their tokens, **projected** (on a CPU both tiers are one
    RAM). Both times are peak-rate lower bounds; their ratio says which way the choice leans."""
    cfg = kv_config(model)
    per_token = kv_bytes_per_token(model, "fp16")
    moved = blocks_moved * block_size * per_token
    flops = prefill_flops(cfg, tokens_saved)
    recompute_s = flops / GPU_FLOPS[1]
    return {"model": cfg.name, "bytes_per_token": per_token, "bytes_moved": moved, "recompute_flops": flops,
            "recompute_s": recompute_s, "gpu": GPU_FLOPS[0],
            "links": {name: {"seconds": moved / bw, "x_faster_than_recompute": recompute_s / (moved / bw) if moved else None}
                      for name, bw in LINKS.items()}}


def router_findings(sims: list[dict], requests: int) -> list[str]:
    """What notebook 07's router runs show, computed from ``simulate_fleet`` rows (every router at 1, 2 and more
    replicas; ``requests`` in all): where prefix-affinity leads, scattering's cost, uneven load, tokens/s gained."""
    sizes = sorted({r["replicas"] for r in sims if r["replicas"] > 1})
    if not any(r["replicas"] == 1 for r in sims) or len(sizes) < 2 or 2 not in sizes:
        raise ValueError("sims must hold simulate_fleet runs of every router at 1 replica, at 2, and at one more size")
    lead = {}
    for key, pick in (("prefix_hit_rate", max), ("ttft_p50_s", min), ("ttft_p99_s", min), ("output_tok_s", max)):
        lead[key] = [n for n in sizes
                     if pick((r for r in sims if r["replicas"] == n), key=lambda r: r[key])["router"] == "prefix-affinity"]
    at = lambda ns: ", ".join(map(str, ns)) or "none"  # noqa: E731
    one = next(r["prefix_hit_rate"] for r in sims if r["replicas"] == 1)
    scatter = max((r for r in sims if r["replicas"] > 1 and r["router"] != "prefix-affinity"),
                  key=lambda r: r["prefix_hit_rate"])
    pa = {r["replicas"]: r for r in sims if r["router"] == "prefix-affinity"}
    big, small = sizes[-1], sizes[-2]
    tok = {(r["router"], r["replicas"]): r["output_tok_s"] for r in sims}
    return [f"prefix-affinity leads, of N = {at(sizes)}: prefix hits at N = {at(lead['prefix_hit_rate'])}; TTFT p50 at "
            f"{at(lead['ttft_p50_s'])}; p99 at {at(lead['ttft_p99_s'])}; tokens/s at {at(lead['output_tok_s'])}",
            f"round-robin and least-loaded scatter a conversation's turns: at most {scatter['prefix_hit_rate']:.0%} prefix "
            f"hits ({scatter['router']}, N={scatter['replicas']}), {(scatter['prefix_hit_rate'] - one) * 100:.0f} points "
            f"above one engine's {one:.0%}",
            f"prefix-affinity's price, uneven load: at N={big} its replicas served {min(pa[big]['served_by'])} to "
            f"{max(pa[big]['served_by'])} requests (an even share: {requests // big}); from {small} to {big} replicas its "
            f"TTFT p99 went {pa[small]['ttft_p99_s']:.2f} -> {pa[big]['ttft_p99_s']:.2f} s",
            f"tokens/s gained from 1 to 2 replicas, and from {small} to {big}: " + "; ".join(
                f"{router} +{tok[router, 2] - tok[router, 1]:.0f}, +{tok[router, big] - tok[router, small]:.0f}"
                for router in ROUTERS)]
