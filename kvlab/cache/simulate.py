"""Where KV memory goes, for a whole workload, without running a model (notebook 02).

As in the PagedAttention paper (Fig. 2), each reserved slot is token states, reservation (a later
token fills it) or internal fragmentation (none ever will). ``max``, ``pow2`` and ``oracle`` are the
paper's Orca baselines; ``paged`` runs the real block manager.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

from kvlab.cache.paged import BlockManager
from kvlab.validate import cdiv

POLICIES = ("max", "pow2", "oracle", "paged")

# mean prompt / output tokens of the paper's two traces (Fig. 11); lengths are drawn from
# exponential-like distributions with these means, clipped to the model's context
WORKLOADS = {"sharegpt": (161, 338), "alpaca": (19, 58)}


@dataclass(frozen=True)
class Request:
    prompt_len: int
    output_len: int

    @property
    def total(self) -> int:
        return self.prompt_len + self.output_len

    @property
    def stored(self) -> int:
        """Tokens whose K/V the cache ends up holding: the last sampled token is never fed back."""
        return self.total - 1


def workload(name: str = "sharegpt", n: int = 64, seed: int = 0, max_seq_len: int = 2048) -> list[Request]:
    """``n`` seeded requests whose lengths follow one of :data:`WORKLOADS` (mean prompt / output)."""
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {sorted(WORKLOADS)}, got {name!r}")
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    mean_p, mean_o = WORKLOADS[name]
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        p = max(1, round(rng.expovariate(1 / mean_p)))
        o = max(1, round(rng.expovariate(1 / mean_o)))
        p = min(p, max_seq_len - 1)
        out.append(Request(p, min(o, max_seq_len - p)))
    return out


def uniform(n: int, lo: int, hi: int, output_share: float = 0.5, seed: int = 0) -> list[Request]:
    """``n`` seeded requests of ``lo..hi`` total tokens, ``output_share`` of them generated."""
    if not 1 < lo <= hi:
        raise ValueError(f"need 1 < lo <= hi, got lo={lo}, hi={hi}")
    rng = random.Random(seed)
    out = []
    for _ in range(n):
        total = rng.randint(lo, hi)
        o = min(total - 1, max(1, round(total * output_share)))
        out.append(Request(total - o, o))
    return out


def _reserved(policy: str, r: Request, max_seq_len: int) -> int:
    if policy == "max":
        return max_seq_len
    if policy == "pow2":
        return min(max_seq_len, 1 << (r.stored - 1).bit_length())
    assert policy == "oracle", policy  # simulate() checked it
    return r.stored


def simulate(requests: list[Request], policy: str, block_size: int = 16, max_seq_len: int = 2048) -> dict:
    """All requests as one batch: the slot breakdown averaged over decode steps, as fractions of the
    reserved slots that sum to 1, plus the peak slots reserved."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
    if not requests:
        raise ValueError("requests must not be empty")
    if any(r.total > max_seq_len for r in requests):
        raise ValueError(f"a request is longer than max_seq_len={max_seq_len}")
    steps = max(r.output_len for r in requests)
    sums = dict(token_states=0, reservation=0, internal_fragmentation=0)
    peak = 0
    bm = None
    if policy == "paged":
        bm = BlockManager(sum(cdiv(r.stored, block_size) for r in requests), block_size, enable_prefix_caching=False)
        for i, r in enumerate(requests):
            bm.allocate(i, [0] * r.prompt_len)
    stored = [r.stored for r in requests]
    reserved = [None if bm is not None else _reserved(policy, r, max_seq_len) for r in requests]
    for step in range(steps):
        # after this step's token, request i holds prompt + min(step + 1, output) - (finished? then freed)
        live = [i for i, r in enumerate(requests) if step < r.output_len]
        if bm is not None:
            if step > 0:
                for i, r in enumerate(requests):
                    if step == r.output_len:
                        bm.free(i)
                    elif step < r.output_len:
                        bm.append_slot(i, 0)
            reserved_now = 0  # no prefix caching, no forks: the live tables hold every block in use
            for i in live:
                held = bm.num_tokens(i)
                slots = len(bm.seqs[i].block_table) * block_size
                sums["token_states"] += held
                sums["reservation"] += min(slots, stored[i]) - held
                sums["internal_fragmentation"] += max(0, slots - stored[i])
                reserved_now += slots
        else:
            reserved_now = 0
            for i in live:
                held = requests[i].prompt_len + step
                sums["token_states"] += held
                sums["reservation"] += stored[i] - held
                sums["internal_fragmentation"] += reserved[i] - stored[i]
                reserved_now += reserved[i]
        peak = max(peak, reserved_now)
    total = sum(sums.values())
    return {"policy": policy, "block_size": block_size if policy == "paged" else None, "requests": len(requests),
            **{k: v / total for k, v in sums.items()}, "peak_slots": peak}


def over_seeds(name: str = "sharegpt", seeds=range(5), n: int = 64, block_size: int = 16) -> dict[str, list[float]]:
    """Token-state share per policy, one per seed: a batch of 64 wanders about 1/sqrt(64) = 12 % around
    the means, so a verdict near its threshold is read over several seeds."""
    seeds = list(seeds)
    if not seeds:
        raise ValueError("seeds must not be empty")
    runs = [{p: simulate(workload(name, n=n, seed=s), p, block_size)["token_states"] for p in POLICIES} for s in seeds]
    return {p: [r[p] for r in runs] for p in POLICIES}


def external_fragmentation(name: str = "sharegpt", n: int = 400, pool_slots: int = 4096, block_size: int = 16,
                           leave: float = 0.1, seed: int = 0) -> dict:
    """External fragmentation, which paging is claimed to remove: the requests a first-fit contiguous
    allocator and a real block manager refuse although their free slots in total would hold them."""
    if not 0 < leave < 1:
        raise ValueError(f"leave must be a probability in (0, 1), got {leave!r}")
    reqs, rng = workload(name, n, seed=seed), random.Random(seed)
    bm = BlockManager(pool_slots // block_size, block_size, enable_prefix_caching=False)
    slots = [None] * pool_slots  # contiguous: which request holds each slot
    live_c, live_p, refused = {}, set(), {"contiguous": 0, "paged": 0}
    for i, r in enumerate(reqs):
        for j in [j for j in sorted(live_c) if rng.random() < leave]:  # the same departures for both
            start, length = live_c.pop(j)
            slots[start:start + length] = [None] * length
            if j in live_p:
                bm.free(j)
                live_p.discard(j)
        need, free_total = r.total, slots.count(None)
        start, run = None, 0  # first fit: the first hole of `need` free slots
        for k, owner in enumerate(slots):
            run = run + 1 if owner is None else 0
            if run == need:
                start = k - need + 1
                break
        if start is not None:
            slots[start:start + need] = [i] * need
            live_c[i] = (start, need)
        elif free_total >= need:
            refused["contiguous"] += 1
        if bm.can_allocate([0] * need):
            bm.allocate(i, [0] * need)
            live_p.add(i)
            live_c.setdefault(i, (0, 0))  # departures are drawn over every live request
        elif bm.num_free_blocks * block_size >= need:
            refused["paged"] += 1
    bm.check_invariants()
    return {"requests": n, "refused_with_room": refused}


def block_size_sweep(requests: list[Request], sizes=(1, 2, 4, 8, 16, 32, 64, 128, 256)) -> list[dict]:
    """Bigger blocks mean fewer table entries but more slots wasted in each last block.
    ``waste_at_completion`` is taken once every request is complete, not averaged as :func:`simulate` does."""
    rows = []
    for bs in sizes:
        bm = BlockManager(sum(cdiv(r.stored, bs) for r in requests), bs, enable_prefix_caching=False)
        for i, r in enumerate(requests):
            bm.allocate(i, [0] * r.stored)
        s = bm.stats()
        rows.append({"block_size": bs, "waste_at_completion": s["empty_slot_share"],
                     "blocks_used": s["blocks_used"],
                     "table_entries_per_seq": s["blocks_used"] / len(requests),
                     "table_bytes": 4 * s["blocks_used"]})  # int32 entries
    return rows


def fork_blocks(prompt_len: int, block_size: int, n: int, steps: int) -> int:
    """Physical blocks a real :class:`BlockManager` holds after a ``prompt_len``-token prompt is forked
    into ``n`` samples (the original counts as one) and each sample writes ``steps`` new tokens."""
    if prompt_len < 1 or n < 1 or steps < 0:
        raise ValueError(f"need prompt_len >= 1, n >= 1, steps >= 0; got {prompt_len}, {n}, {steps}")
    per_sample = cdiv(prompt_len + steps, block_size)
    bm = BlockManager(n * per_sample + 1, block_size, enable_prefix_caching=False)
    bm.allocate(0, list(range(prompt_len)))
    for child in range(1, n):
        bm.fork(0, child)
    for t in range(steps):
        for sample in range(n):
            bm.append_slot(sample, 10_000 + t)
    bm.check_invariants()
    return bm.stats()["blocks_used"]


def parallel_sampling(requests: list[Request], n: int, block_size: int = 16) -> dict:
    """Blocks held at the end when every request draws ``n`` samples, forked (sharing the prompt) or not."""
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    need = sum(n * cdiv(r.stored, block_size) for r in requests)
    shared = BlockManager(need, block_size, enable_prefix_caching=False)
    sid = 0
    for r in requests:
        parent = sid
        shared.allocate(parent, [0] * r.prompt_len)
        children = [parent] + list(range(sid + 1, sid + n))
        for c in children[1:]:
            shared.fork(parent, c)
        for c in children:
            for t in range(r.output_len - 1):
                shared.append_slot(c, t + 1)
        sid += n
    with_fork = shared.stats()["blocks_used"]
    without = sum(n * cdiv(r.stored, block_size) for r in requests)
    return {"n": n, "blocks_with_fork": with_fork, "blocks_without": without, "saved": 1 - with_fork / without,
            "cow_copies": shared.counters["cow_copies"]}
