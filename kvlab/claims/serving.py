"""The claims about paged blocks and batching (notebooks 01, 02 and 04): simulators and the engine.

Blocks come from the slot simulator and the block manager (no model), batching from the engine's dry run,
step times and recompute from SmolLM2. Each ``c_...`` function returns ``(measured, verdict, why)``.
"""

from __future__ import annotations

import statistics

from kvlab.bench.engine import make_workload
from kvlab.capstone import WORKLOAD
from kvlab.cache import simulate
from kvlab.cache.paged import BlockManager
from kvlab.claims.rules import in_range, judged_on, parts, ratio, truth
from kvlab.engine.dry_run import dry_run
from kvlab.validate import cdiv


_BATCHES = "the lab's ShareGPT- and Alpaca-like batches of 64 (seeds 0-4)"


def c_static_30(lab):
    below = {name: sum(v < 0.30 for v in w["max"]) for name, w in lab.seed_shares.items()}
    n = {name: len(w["max"]) for name, w in lab.seed_shares.items()}
    often = {name: below[name] > n[name] / 2 for name in below}
    ranges = "; ".join(f"{name} {min(w['max']):.1%}-{max(w['max']):.1%}" for name, w in lab.seed_shares.items())
    (a, b) = list(often)[:2]
    return (f"reserve 2,048: below 30 % in " + ", ".join(f"{below[k]} of {n[k]} {k} batches" for k in below)
            + f" ({ranges})",
            judged_on(parts(often[a], often[b], f"on {a}-like traffic", f"on {b}-like traffic"), _BATCHES,
                      "the article's serving traffic"),
            "'often' read as: in most batches of each workload; every request reserves the serving limit, so short "
            "answers (Alpaca-like) use far less than 30 %, long chats (ShareGPT-like) sit near it")


def c_static_50(lab):
    shares = [v for w in lab.seed_shares.values() for v in w["max"]]
    exact = [v for w in lab.seed_shares.values() for v in w["oracle"]]
    return (f"reserve 2,048: {min(shares):.1%}-{max(shares):.1%} of slots hold tokens in {len(shares)} batches of 64; "
            f"an exact reservation {min(exact):.1%}-{max(exact):.1%}",
            judged_on(truth(max(shares) < 0.5), _BATCHES, "the article's serving traffic"),
            "holds for max-length reservation in every batch; even an exact reservation wastes the not-yet-generated "
            "part")


def c_paged_90(lab):
    med = {name: statistics.median(w["paged"]) for name, w in lab.seed_shares.items()}
    ranges = "; ".join(f"{name} {min(w['paged']):.1%}-{max(w['paged']):.1%}" for name, w in lab.seed_shares.items())
    return (f"paged blocks of 16: {ranges} of slots hold tokens",
            judged_on(truth(all(m >= 0.9 for m in med.values())), _BATCHES, "the article's serving traffic"),
            "judged on each workload's median batch; only each sequence's last block has empty slots, a larger "
            "share of a short request")


def c_paged_near_100(lab, near: float = 0.95):
    med = {name: statistics.median(w["paged"]) for name, w in lab.seed_shares.items()}
    (a, b) = list(med)[:2]
    return (f"paged blocks of 16, median batch: " + ", ".join(f"{k} {v:.1%}" for k, v in med.items())
            + " of slots hold tokens", judged_on(parts(med[a] >= near, med[b] >= near, f"on {a}-like traffic",
                                                        f"on {b}-like traffic"), _BATCHES, "the article's serving traffic"),
            f"rule: 'nearly 100 %' = at least {near:.0%}; the last block's empty slots are a larger share of a short "
            "request, and the article's own §4.3 puts them at 5-10 % for 50-token sequences")


def c_frag_50(lab, lengths: tuple[int, int] = (40, 60)):
    reqs = simulate.uniform(500, *lengths, seed=1)  # about 50 tokens each: notebook 02's sample
    frag = simulate.block_size_sweep(reqs, sizes=(16,))[0]["waste_at_completion"]
    held = sum(cdiv(r.stored, 16) * 16 for r in reqs) / len(reqs)
    return (f"{frag:.1%} of reserved slots empty (lengths {lengths[0]}-{lengths[1]}, complete)", in_range(0.05, 0.10, frag),
            f"the last block is about half empty: {frag * held:.1f} of ~{held:.0f} slots held per sequence")


def _prefix_saving(lab) -> tuple[float, int, float]:
    wl = make_workload(lab.tokenizer, **WORKLOAD)  # notebook 06's workload
    used = {}
    for share in (True, False):
        bm = BlockManager(4096, 16, enable_prefix_caching=share)
        for i, p in enumerate(wl.prompts):
            bm.allocate(i, p)
        used[share] = bm.stats()["blocks_used"]
    return 1 - used[True] / used[False], wl.meta["shared_prefix_tokens"], wl.meta["prompt_tokens_mean"]


def c_prefix(lab, measured: tuple[float, int, float] | None = None):
    saving, shared, mean = measured or _prefix_saving(lab)
    return (f"{saving:.0%} of prompt blocks saved ({shared}-token system prompt, prompts {mean:.0f} tokens)",
            judged_on(in_range(0.40, 0.60, saving), "this chat workload", "any workload with a shared prompt"),
            f"it is the shared share of the prompt blocks: a {shared}-token system prompt in ~{mean:.0f}-token prompts; 40-60 % "
            "needs a system prompt about as long as the rest (and less once answers fill blocks too)")


def _seats_busy() -> dict[str, float]:
    reqs = simulate.workload("sharegpt", 32, seed=0)
    lengths = [(max(4, round(r.prompt_len * 0.25)), max(1, round(r.output_len * 0.25))) for r in reqs]
    busy = {}
    for policy in ("static", "continuous"):
        _, steps = dry_run(lengths, num_blocks=4096, block_size=16, max_num_seqs=8, max_num_batched_tokens=512,
                           policy=policy, check=False)
        dec = [s for s in steps if s["decode_tokens"]]
        busy[policy] = sum(s["decode_tokens"] for s in dec) / (8 * len(dec))
    return busy


def c_utilization(lab, busy: dict[str, float] | None = None):
    busy = busy or _seats_busy()
    ends = [in_range(0.30, 0.40, busy["static"]) == "holds", in_range(0.80, 1.0, busy["continuous"]) == "holds"]
    return (f"seats busy: static {busy['static']:.0%}, continuous {busy['continuous']:.0%}",
            judged_on(parts(*ends, "static at 30-40 %", "continuous at 80 % or more"),
                      "seat occupancy of 8 seats (ShareGPT-like answers)",
                      "GPU utilization (a CPU has none)"),
            "seat occupancy in decode steps, 8 seats, ShareGPT-like answers (utilization of the batch, not of the GPU)")


def c_10_30ms(lab):
    ms = lab.step_ms
    r = {c: ms[c, 16] / ms[c, 1] for c in ("short", "1k")}
    return (f"batch 1 -> 16 at 1,000-token contexts: {ms['1k', 1]:.0f} -> {ms['1k', 16]:.0f} ms ({r['1k']:.1f}x); "
            f"at short contexts {r['short']:.1f}x (this machine)",
            judged_on(ratio(3.0, r["1k"]), "SmolLM2 on this CPU", "a GPU serving a larger model"),
            "the ±15 % every figure gets (claims.rules.READING); the article's cause, more KV read per step, shows "
            "once batch x context makes the cache about as big as the weights (1k tokens here): a step reading "
            "weights and cache grows (W + 16 KV) / (W + KV), about 2x there; 3x needs a cache about 2.5x the "
            f"weights. With short contexts the step grows {r['short']:.1f}x, as the weights dominate")


def c_5_20x(lab):
    rows = lab.speedups
    longest = max(rows, key=lambda r: r["prompt_tokens"])
    shortest = min(rows, key=lambda r: r["prompt_tokens"])
    runs = rows[0].get("repeats", 1)
    spread = lambda r: f" ({r['speedup_min']:.1f}-{r['speedup_max']:.1f}x)" if runs > 1 else ""  # noqa: E731
    inside = {r["prompt_tokens"]: in_range(5, 20, r["speedup"]) == "holds" for r in rows}
    return (", ".join(f"{r['speedup']:.1f}x{spread(r)} at {r['prompt_tokens']} tokens" for r in rows)
            + (f" (medians of {runs} runs, their range in brackets)" if runs > 1 else " (one run each)"),
            judged_on(parts(inside[longest["prompt_tokens"]], inside[shortest["prompt_tokens"]],
                            f"at long prompts ({longest['prompt_tokens']} tokens)",
                            f"at short ones ({shortest['prompt_tokens']} tokens)"),
                      "SmolLM2 on this CPU", "any model"),
            "16 new tokens each, batch 1; the gain grows with both lengths (quadratic work becomes linear), so "
            "short prompts fall below the range: a range without lengths says little")


def c_max_batch(lab, ms: dict | None = None):
    ms = lab.step_ms if ms is None else ms
    one, many = ms["1k", 1], ms["1k", 16]
    return (f"1,000-token contexts: batch 1 {one:.0f} ms a step ({1e3 / one:.0f} tok/s), batch 16 {many:.0f} ms "
            f"({16e3 / many:.0f} tok/s), this machine",
            judged_on(parts(one < many, 1 / one < 16 / many, "that a cap bounds the step's latency",
                            "that it costs throughput"), "SmolLM2 on this CPU", "any engine"),
            "the steps 10-30ms measures: a smaller batch keeps each step short and reads the weights for fewer tokens")

