"""``kvlab bench WHAT``: the lab's measurements, one table (or one JSON object) each: ``recompute`` (notebook
01), ``static`` and ``memory`` (02), ``quant`` (03), ``engine`` (04), ``kernels`` (05).
"""

from __future__ import annotations

import json
import sys

from kvlab.bench import caches
from kvlab import models  # through the module: tests swap models.load_model
from kvlab.cache import simulate
from kvlab.cache.paged import check_block_size
from kvlab.bench.engine import ALL_SYSTEMS, bench_engine, check_workload_args, make_workload
from kvlab.bench.profile import format_profile, profile_engine
from kvlab.files import check_writable_target, write_atomic
from kvlab.bench import kernels as kbench
from kvlab.sizing import fmt_bytes
from kvlab.cli.common import batched_tokens, emit


def cmd_bench(args) -> int:
    if args.new_tokens is None:
        args.new_tokens = 16 if args.what == "recompute" else 64
    obj, lines = {"recompute": _recompute, "static": _static, "quant": _quant, "engine": _engine,
                  "kernels": _kernels, "memory": _memory}[args.what](args)
    emit(obj, args.json, lines)
    return 0


def _recompute(args) -> tuple[dict, list[str]]:
    model, tokenizer = models.load_model(args.model)
    rows = caches.recompute_vs_cache(model, tokenizer, tuple(args.prompt_lens), args.new_tokens)
    lines = [f"{'prompt':>7}{'no cache (s)':>14}{'cache (s)':>11}{'speed-up':>10}{'same tokens':>13}"]
    lines += [f"{r['prompt_tokens']:>7}{r['no_cache_s']:>14.2f}{r['cache_s']:>11.2f}{r['speedup']:>9.1f}x"
              f"{str(r['same_tokens']):>13}" for r in rows]
    return {"rows": rows}, lines


def _static(args) -> tuple[dict, list[str]]:
    model, tokenizer = models.load_model(args.model)
    res = caches.static_vs_paged(model, tokenizer, args.new_tokens, args.block_size)
    lines = [f"{'cache':<36}{'slots':>8}{'tokens':>8}{'in use':>12}{'holding tokens':>16}"]
    lines += [f"{k:<36}{v['slots']:>8,}{v['tokens_stored']:>8,}{fmt_bytes(v['bytes_in_use']):>12}"
              f"{v['utilization']:>16.1%}" for k, v in res.items()]
    return res, lines


def _quant(args) -> tuple[dict, list[str]]:
    model, tokenizer = models.load_model(args.model)
    res = caches.quant_table(model, tokenizer, tokens=args.tokens, mixed=not args.no_mixed, chunk=args.chunk,
                            model_name=args.model, progress=not args.json)
    for c in res["configs"].values():
        c.pop("saturation", None)  # tensors: not JSON
    fp16 = res["fp16_bytes_per_token"]
    lines = [f"{res['tokens']} held-out tokens, window {res['window']}/{res['stride']}, chunk {res['chunk']}: "
             f"FP ppl {res['ppl_fp']:.3f}",
             f"{'format':<36}{'bytes':>7}{'ppl':>9}{'d ppl':>9}{'KL':>9}{'top-1':>8}{'K clip':>9}{'V clip':>9}"]
    for name, c in res["configs"].items():
        lines.append(f"{name:<36}{c['bytes_per_token'] / fp16:>6.0%}{c['ppl']:>9.3f}{c['delta_ppl_pct']:>+8.2f}%"
                     f"{c['kl']:>9.4f}{c['top1']:>8.1%}{c['k_clip_rate']:>9.1e}{c['v_clip_rate']:>9.1e}")
    return res, lines


def _kernels(args) -> tuple[dict, list[str]]:
    """GPU: timings; CPU: the interpreter's correctness sweep and the bandwidth projection."""
    if args.out:
        check_writable_target(args.out, "--out file")
    res = kbench.run(args.shapes, args.batches, args.contexts,
                     progress=lambda m: print(m, file=sys.stderr) if not args.json else None,
                     converts=args.converts or kbench.CONVERSIONS)
    if args.out:
        write_atomic(args.out, json.dumps(res, indent=1), "--out file")
    return res, kbench.format_table(res).splitlines()


def _memory(args) -> tuple[dict, list[str]]:
    """The PagedAttention Fig. 2 breakdown on a synthetic workload, no model."""
    reqs = simulate.workload(args.workload, args.requests, seed=args.seed)
    rows = [simulate.simulate(reqs, p, block_size=args.block_size) for p in simulate.POLICIES]
    sweep = simulate.block_size_sweep(reqs)
    lines = [f"{args.workload}, {args.requests} requests: {'policy':<8}{'token states':>14}{'reservation':>13}"
             f"{'internal frag':>15}"]
    lines += [f"{'':<{len(lines[0]) - 49}}{r['policy']:<8}{r['token_states']:>14.1%}{r['reservation']:>13.1%}"
              f"{r['internal_fragmentation']:>15.1%}" for r in rows]
    lines += ["block size sweep, slots wasted at completion: "
              + ", ".join(f"{r['block_size']}: {r['waste_at_completion']:.1%}" for r in sweep)]
    return {"policies": rows, "block_size_sweep": sweep}, lines


def _engine(args) -> tuple[dict, list[str]]:
    check_workload_args(args.scale, args.arrival, args.rate)  # before the model loads
    check_block_size(args.block_size)
    args.max_num_batched_tokens = batched_tokens(args.max_num_batched_tokens, args.max_num_seqs)
    model, tokenizer = models.load_model(args.model)
    wl = make_workload(tokenizer, args.num_requests, args.workload, scale=args.scale, seed=args.seed,
                       arrival=args.arrival, rate=args.rate, shared_prefix=not args.no_shared_prefix)
    systems = tuple(args.systems or ALL_SYSTEMS)
    engine_kw = dict(block_size=args.block_size, max_num_batched_tokens=args.max_num_batched_tokens,
                     attn_backend=args.attn_backend)  # the same engine for the benchmark and the profile
    res = bench_engine(model, tokenizer, wl, max_num_seqs=args.max_num_seqs, systems=systems,
                       progress=not args.json, repeat=args.repeat, **engine_kw)
    if args.profile:
        res["profile"] = profile_engine(model, tokenizer, wl, max_num_seqs=args.max_num_seqs, **engine_kw)
    w = res["workload"]
    lines = [f"{w['requests']} requests ({w['shape']} x {w['scale']}, arrival {w['arrival']}): prompts "
             f"{w['prompt_tokens_mean']:.0f} tokens on average (shared prefix {w['shared_prefix_tokens']}), outputs "
             f"{w['output_tokens_mean']:.0f} on average, {w['output_tokens_max']} at most; max_num_seqs "
             f"{res['max_num_seqs']}, {res['threads']} threads, {res['device']}, {res['cpu']}",
             f"{'system':<20}{'out tok/s':>10}{'x kvlab':>9}{'TTFT p50':>10}{'TTFT p99':>10}{'TPOT p50':>10}"
             f"{'TPOT p99':>10}"]
    for name, r in res["systems"].items():
        lines.append(f"{name:<20}{r['output_tok_s']:>10.1f}{r.get('throughput_vs_kvlab', float('nan')):>8.2f}x"
                     f"{r['ttft_p50_s']:>9.2f}s{r['ttft_p99_s']:>9.2f}s{r['tpot_p50_s'] * 1e3:>8.0f}ms"
                     f"{r['tpot_p99_s'] * 1e3:>8.0f}ms")
    if "kvlab_continuous" in res["systems"]:
        c = res["systems"]["kvlab_continuous"]
        lines.append(f"kvlab continuous step time: scheduler + block manager {c['scheduler_share']:.1%}, packing "
                     f"{c['packing_share']:.1%}, model forward {c['forward_share']:.1%}, sampling "
                     f"{c['sample_share']:.1%}; scheduler share in steps at max_num_seqs running: "
                     f"{c['scheduler_share_at_max_num_seqs']:.1%}")
    if res["repeat"] > 1:
        lines.append(f"{res['repeat']} runs each, the systems taking turns; rows are median runs. Each run against "
                     "the kvlab continuous run beside it:")
        for name, r in res["systems"].items():
            if "throughput_vs_kvlab_paired" in r and name != "kvlab_continuous":
                lines.append(f"  {name:<18} " + " ".join(f"{x:.2f}x" for x in r["throughput_vs_kvlab_paired"])
                             + f"  (median {r['throughput_vs_kvlab_paired_median']:.2f}x; tok/s "
                             + ", ".join(f"{x:.0f}" for x in r["output_tok_s_runs"]) + ")")
    for name, why in res["skipped"].items():
        lines.append(f"{name}: skipped: {why}")
    for name, r in res["systems"].items():
        if "greedy_equal_to_kvlab" in r:
            first = [d for d in r["greedy_first_difference"] if d is not None]
            lines.append(f"{name}: greedy tokens equal to kvlab continuous's in {r['greedy_equal_to_kvlab']} of "
                         f"{len(r['greedy_first_difference'])} requests"
                         + (f"; the others first differ at output positions {sorted(first)}" if first else ""))
    if "profile" in res:
        lines += format_profile(res["profile"])
    if "hf_generate" in res["systems"]:
        lines.append(f"hf_generate computed {res['systems']['hf_generate']['generated_tokens']} tokens, "
                     f"{res['systems']['hf_generate']['useful_share']:.0%} of them useful (padded batches)")
    return _nan_to_none(res), lines


def _nan_to_none(obj):
    """Strict JSON has no NaN: a measure with nothing to measure (e.g. no step at max_num_seqs) is null."""
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, float) and obj != obj:
        return None
    return obj
