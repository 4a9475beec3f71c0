"""What a decode step costs as the batch and the context grow, and what a long prompt joining the decoders
does to their waits, chunked or not (notebook 04, section 5).

Rounds interleave the configurations, so a slow stretch of the machine hits all of them. Every conclusion
is computed from the numbers, never typed beside them, with a noise guard: where a ratio moves by more
than :data:`NOISE` between rounds, the machine was too busy to decide, the verdict says so, and the
recorded quiet run (``steps_recorded.json``, made by ``tools/record_steps.py`` on a machine with nothing
else running) is judged by the same rules beside it.
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from kvlab.engine import LLM, SamplingParams
from kvlab.sizing import kv_bytes_per_token
from kvlab.validate import check_int

NOISE = 2.0  # a ratio whose rounds spread more than this (max / min) is not read
CONTEXTS = ("short", "1k")
RECORDED = Path(__file__).with_name("steps_recorded.json")


def _spread(xs) -> float:
    return max(xs) / min(xs) if min(xs) > 0 else float("inf")


# ---- decode steps: batch x context ---------------------------------------------------------------------

def decode_sweep(model, tokenizer, prompts: list[list[int]], shared_text: list[int], batches=(1, 4, 16),
                 rounds: int = 3, max_tokens: int = 6) -> dict:
    """The median pure-decode step (ms) per (context, batch): "short" = the chat ``prompts``, "1k" = one
    shared text (+1 own token each). One engine per context, reused by every batch and round (its prefix
    cache keeps the shared text: only the first run prefills it), warmed up first."""
    if not isinstance(batches, (tuple, list)) or len(batches) < 2 or list(batches) != sorted(set(batches)):
        raise ValueError(f"batches must be two or more increasing positive ints, got {batches!r}")
    for b in batches:
        check_int("each batch", b)
    check_int("rounds", rounds)
    check_int("max_tokens", max_tokens, minimum=2, what="a decode step needs a token after the first")
    if not prompts or not shared_text:
        raise ValueError("prompts and shared_text must be non-empty token lists")
    engines = {c: LLM(model, tokenizer, num_blocks=200, block_size=16, max_num_seqs=max(batches),
                      max_num_batched_tokens=1024) for c in CONTEXTS}
    engines["short"].generate(prompts[:4], SamplingParams(max_tokens=4, ignore_eos=True))  # first steps run slow

    def requests(context, batch):
        return ([prompts[i % len(prompts)] for i in range(batch)] if context == "short"
                else [shared_text + [200 + i] for i in range(batch)])

    configs = [(c, b) for c in CONTEXTS for b in batches]
    runs = {cfg: [] for cfg in configs}
    for _ in range(rounds):
        for context, batch in configs:
            eng, seen = engines[context], len(engines[context].step_stats)
            eng.generate(requests(context, batch), SamplingParams(max_tokens=max_tokens, ignore_eos=True))
            pure = [s.total_s for s in eng.step_stats[seen:] if s.prefill_tokens == 0 and s.decode_tokens == batch]
            runs[context, batch].append(1e3 * statistics.median(pure))
    weights, per_token = sum(p.nbytes for p in model.parameters()), kv_bytes_per_token(model, "fp32")
    kv = {(c, b): b * statistics.mean(map(len, requests(c, b))) * per_token for c, b in configs}
    return {"batches": list(batches), "rounds": rounds,
            "runs": {f"{c} {b}": r for (c, b), r in runs.items()},
            "kv_share": {f"{c} {b}": kv[c, b] / weights for c, b in configs},  # KV bytes / weight bytes
            "bytes_x": {str(b): (weights + kv["1k", b]) / (weights + kv["1k", batches[0]]) for b in batches}}


def _ratio(sweep: dict, context: str) -> tuple[float, list[float]]:
    """Biggest batch over the smallest: the median of the rounds' medians, and round by round."""
    lo, hi = sweep["batches"][0], sweep["batches"][-1]
    a, b = sweep["runs"][f"{context} {lo}"], sweep["runs"][f"{context} {hi}"]
    return statistics.median(b) / statistics.median(a), [y / x for x, y in zip(a, b)]


def sweep_verdicts(sweep: dict) -> list[str]:
    """The section's conclusions, computed: a bigger batch nearly free at short contexts (the weights
    dominate), dearer at 1k (the KV read and its padded copy show), and step time against the bytes a step reads."""
    lo, hi = sweep["batches"][0], sweep["batches"][-1]
    n, (short, short_rounds), (long, long_rounds) = hi // lo, _ratio(sweep, "short"), _ratio(sweep, "1k")
    if max(_spread(short_rounds), _spread(long_rounds)) > NOISE:
        return [f"the rounds disagree by more than {NOISE:.0f}x ({n}x the batch cost {min(short_rounds + long_rounds):.1f}-"
                f"{max(short_rounds + long_rounds):.1f}x the step time): too busy to decide"]
    bytes_x, time_x = sweep["bytes_x"][str(hi)], long
    follows = ("more than" if time_x > 1.1 * bytes_x else "less than" if time_x < bytes_x / 1.1 else "about as")
    return [f"short contexts: {n}x the batch costs {short:.1f}x the step time: "
            + (f"nearly free (a request's share of a step falls {n / short:.0f}x)" if short < 2 else
               "not free on this machine"),
            f"1k contexts: {n}x the batch costs {long:.1f}x: "
            + ("dearer than at short contexts, the KV read (and its padded copy) shows" if long > 1.1 * short else
               "no dearer than at short contexts here"),
            f"1k contexts, batch {hi}: the step reads {bytes_x:.2f}x batch {lo}'s bytes and takes {time_x:.2f}x its "
            f"time: time grows {follows} the bytes"]


# ---- a long prompt joins the decoders ----------------------------------------------------------------

def join_long_prompt(model, tokenizer, prompts: list[list[int]], long_prompt: list[int], budget: int,
                     admission_rule=None, chunk_prefills=None, decoders: int = 6, joins_after: int = 4) -> dict:
    """``decoders`` requests decoding; after ``joins_after`` steps the long prompt arrives. The decoders'
    longest wait between two tokens, the long prompt's TTFT, and the steps that carried its prompt."""
    rules = {k: v for k, v in (("admission_rule", admission_rule), ("chunk_prefills", chunk_prefills)) if v}
    eng = LLM(model, tokenizer, num_blocks=96, block_size=16, max_num_seqs=8, max_num_batched_tokens=budget, **rules)
    short = [eng.add_request(p, SamplingParams(max_tokens=20, ignore_eos=True)) for p in prompts[:decoders]]
    for _ in range(joins_after):
        eng.step()
    big = eng.add_request(long_prompt, SamplingParams(max_tokens=4, ignore_eos=True))
    while eng.has_unfinished():
        eng.step()
    gaps = [b - a for i in short for a, b in zip(eng.seqs[i].metrics.token_times, eng.seqs[i].metrics.token_times[1:])]
    carried = [s.total_s for s in eng.step_stats if s.prefill_tokens > 0 and s.step > joins_after]
    return dict(engine=eng, ttft_s=eng.seqs[big].metrics.as_dict(4)["ttft_s"], worst_gap_ms=1e3 * max(gaps),
                prefill_steps=len(carried), prefill_sum_ms=1e3 * sum(carried))


def chunking_rounds(model, tokenizer, prompts, long_prompt, budgets=(1024, 64), rounds: int = 3, **rules) -> dict:
    """:func:`join_long_prompt` per budget, the budgets interleaved round by round; only the last round's
    engines are kept (their pools are memory), under ``engines``."""
    if not isinstance(budgets, (tuple, list)) or len(budgets) != 2:
        raise ValueError(f"budgets must be two token budgets (unchunked, chunked), got {budgets!r}")
    check_int("the unchunked budget", budgets[0], minimum=9, what="tokens a step, more than the chunked one")
    check_int("the chunked budget", budgets[1], minimum=8, maximum=budgets[0] - 1, what="tokens a step, 8 seats")
    check_int("rounds", rounds)
    out, engines = {str(b): [] for b in budgets}, {}
    for _ in range(rounds):
        for b in budgets:
            r = join_long_prompt(model, tokenizer, prompts, long_prompt, b, **rules)
            engines[b] = r.pop("engine")
            out[str(b)].append(r)
    return {"budgets": list(budgets), "rounds": out, "engines": engines}


def _effects(ch: dict, none: str) -> tuple:
    """Unchunked and chunked rounds, chunking's effects round by round and their directions (``none`` unless every round agrees)."""
    whole, chunked = (ch["rounds"][str(b)] for b in ch["budgets"])
    waits = [a["worst_gap_ms"] / b["worst_gap_ms"] for a, b in zip(whole, chunked)]  # > 1: chunking cut it
    ttfts = [b["ttft_s"] / a["ttft_s"] for a, b in zip(whole, chunked)]  # > 1: chunking delayed it
    way = lambda xs, up, down: up if all(x > 1.05 for x in xs) else down if all(x < 0.95 for x in xs) else none  # noqa: E731
    return whole, chunked, waits, ttfts, way(waits, "cut", "lengthened"), way(ttfts, "delayed", "sped up")


def chunking_verdicts(ch: dict) -> list[str]:
    """Chunking's effect on the decoders' longest wait and on the long prompt's first token, computed
    round by round (a direction needs every round); a noise guard on the waits."""
    whole, chunked, waits, ttfts, wait, first = _effects(ch, "had no consistent effect on")
    if _spread([r["worst_gap_ms"] for r in whole]) > NOISE or _spread([r["worst_gap_ms"] for r in chunked]) > NOISE:
        return [f"the decoders' longest waits spread more than {NOISE:.0f}x across the rounds: too busy to decide"]
    med = statistics.median
    return [f"chunking {wait} the decoders' longest "
            f"wait ({med(r['worst_gap_ms'] for r in whole):.0f} ms unchunked, {med(r['worst_gap_ms'] for r in chunked):.0f}"
            f" ms chunked; round by round {', '.join(f'{x:.1f}x' for x in waits)})",
            f"chunking {first} the long prompt's first "
            f"token ({med(r['ttft_s'] for r in whole):.2f} s unchunked, {med(r['ttft_s'] for r in chunked):.2f} s chunked; "
            f"round by round {', '.join(f'{x - 1:+.0%}' for x in ttfts)})",
            "its prompt rode {:.0f} step(s), {:,.0f} ms, unchunked; {:.0f}, {:,.0f} ms, chunked (medians)".format(
                *(med(r[k] for r in rs) for rs in (whole, chunked) for k in ("prefill_steps", "prefill_sum_ms")))]


def sweep_table(sweep: dict) -> tuple[list[str], list[list[str]]]:
    """The sweep as (header, rows): the median decode step per context and batch, (KV bytes read / weight
    bytes); notebook 04 shows it with ``kvlab.viz.table``."""
    return ["context"] + [f"batch {b}" for b in sweep["batches"]], [
        [c] + [f"{statistics.median(sweep['runs'][f'{c} {b}']):.1f} ms ({sweep['kv_share'][f'{c} {b}']:.0%})"
               for b in sweep["batches"]] for c in CONTEXTS]


# ---- the recorded quiet run --------------------------------------------------------------------------

def recorded() -> dict:
    """The quiet run kept with kvlab: ``machine``, ``date``, ``sweep``, ``chunking`` (no engines)."""
    return json.loads(RECORDED.read_text())


def judged(verdicts, result: dict, key: str) -> list[str]:
    """``verdicts(result)``; where this run was too busy to decide, the recorded quiet run judged by the
    same rules beside it (``key``: "sweep" or "chunking")."""
    lines = verdicts(result)
    if any("too busy to decide" in line for line in lines):
        quiet = recorded()
        lines += [f"recorded quiet run ({quiet['machine']}, {quiet['date']}), same rules:"] + ["  " + v for v in verdicts(quiet[key])]
    return lines


def brief(result: dict, key: str) -> str:
    """04's summary line: the biggest batch's cost, chunking's medians and verdicts; too busy: the recorded run's."""
    verdicts = {"sweep": sweep_verdicts, "chunking": chunking_verdicts}[key]
    busy = any("too busy" in line for line in verdicts(result))
    result, tail = (recorded()[key], " (too busy here: the recorded quiet run)") if busy else (result, "")
    if key == "sweep":
        return (f"{result['batches'][-1] // result['batches'][0]}x the batch costs {_ratio(result, 'short')[0]:.1f}x the "
                f"step time at short contexts, {_ratio(result, '1k')[0]:.1f}x at 1k{tail}")
    whole, chunked, _, _, wait, first = _effects(result, "no consistent effect")
    (gap, chunked_gap), (ttft, chunked_ttft) = ([statistics.median(r[k] for r in rs) for rs in (whole, chunked)] for k in ("worst_gap_ms", "ttft_s"))
    return (f"chunked, the decoders' longest wait {gap:.0f} -> {chunked_gap:.0f} ms ({wait}), "
            f"the prompt's first token {ttft:.2f} -> {chunked_ttft:.2f} s ({first}){tail}")
