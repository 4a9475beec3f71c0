"""The ``kvlab`` command: ``info``, ``size``, ``generate``, ``convert``. Every subcommand takes ``--json``.

Errors go to stderr as one ``kvlab: error: ...`` line with exit status 2, so scripts (and the
tests) can tell bad input from a crash.
"""

from __future__ import annotations

import argparse
import json
import sys


class CLIError(Exception):
    pass


def _positive_int(name: str):
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value

    return parse


def _emit(obj: dict, as_json: bool, lines: list[str]) -> None:
    if as_json:
        print(json.dumps(obj))
    else:
        print("\n".join(lines))


def cmd_info(args) -> None:
    from kvlab.env import lab_info
    from kvlab.kernels import triton_mode
    from kvlab.models import cache_dir, model_status

    info = lab_info()
    obj = {**info.__dict__, "triton_mode": triton_mode(), "cache_dir": str(cache_dir()), "models": model_status()}
    lines = [info.line(), f"cache dir: {obj['cache_dir']}"]
    for name, st in obj["models"].items():
        lines.append(f"model {name}: {'converted' if st['converted'] else 'not converted yet'} ({st['folder']})")
    _emit(obj, args.json, lines)


def cmd_size(args) -> None:
    from kvlab.sizing import PRESETS, fmt_bytes, kv_config, kv_size

    model = args.model
    if model.lower() not in PRESETS:
        from pathlib import Path

        from kvlab.models import check_model_folder, resolve_name

        name = resolve_name(model)
        if not Path(name).is_dir() and "/" not in name:
            raise CLIError(f"unknown model {args.model!r}: use a preset ({', '.join(sorted(PRESETS))}), "
                           "a local model folder or an HF id (org/name)")
        if Path(name).is_dir():
            check_model_folder(name)  # a one-line reason when the folder is not a model
        try:
            from transformers import AutoConfig

            model = AutoConfig.from_pretrained(name)
        except (OSError, ValueError):
            raise CLIError(f"unknown model {args.model!r}: use a preset ({', '.join(sorted(PRESETS))}), "
                           "a local model folder or a reachable HF id") from None
    cfg = kv_config(model)
    size = kv_size(cfg, args.dtype, tokens=args.tokens, batch=args.batch, scales=args.scales)
    obj = {**size.as_dict(), "attention": cfg.attention, "num_layers": cfg.num_layers,
           "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim}
    lines = [
        f"{cfg.name}: {cfg.num_layers} layers, {cfg.attention}, {cfg.num_kv_heads} KV heads x {cfg.head_dim} dims",
        f"{args.dtype} ({'no' if size.scales == 'none' else size.scales} scales): {fmt_bytes(size.bytes_per_token)} per token",
        f"{args.tokens} tokens x batch {args.batch}: {fmt_bytes(size.total_bytes)} ({size.total_bytes:,} bytes)",
    ]
    _emit(obj, args.json, lines)


# options that only the engine reads, with their defaults
ENGINE_OPTIONS = {"attn_backend": "torch", "kv_dtype": "auto", "max_num_seqs": None, "max_num_batched_tokens": None,
                  "temperature": 0.0, "top_p": 1.0, "seed": None}


def _check_generate(args) -> None:
    """Everything about ``kvlab generate``'s arguments that can be refused before the model loads."""
    from kvlab.cache.paged import _check_block_size

    given = [name for name in ENGINE_OPTIONS if getattr(args, name) is not None]
    if not args.engine and given:
        raise CLIError(f"--{given[0].replace('_', '-')} is an engine option: add --engine, or leave it out")
    if args.engine and args.cache not in ("dynamic", "paged"):
        raise CLIError(f"--engine serves from a paged pool; --cache {args.cache} cannot be combined with it")
    if not args.engine and args.cache != "paged":
        for name in ("block_size", "num_blocks"):
            if getattr(args, name) is not None:
                raise CLIError(f"--{name.replace('_', '-')} is for --cache paged or --engine, not --cache {args.cache}")
    if args.max_seq_len is not None and (args.cache != "static" or args.engine):
        raise CLIError("--max-seq-len is for --cache static (the slots it pre-allocates per sequence)")
    args.block_size = _check_block_size(args.block_size or 16)
    if args.engine:
        from kvlab.engine import SamplingParams

        for name, default in ENGINE_OPTIONS.items():
            if getattr(args, name) is None and default is not None:
                setattr(args, name, default)
        SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        args.max_num_seqs = args.max_num_seqs or len(args.prompt)
        args.max_num_batched_tokens = _batched_tokens(args.max_num_batched_tokens, args.max_num_seqs)


def _batched_tokens(value: int | None, max_num_seqs: int) -> int:
    if value is None:
        return max(512, max_num_seqs)  # the default budget, raised so every running sequence can decode
    if value < max_num_seqs:
        raise CLIError(f"--max-num-batched-tokens ({value}) must be >= --max-num-seqs ({max_num_seqs}): every "
                       "running sequence needs one token of budget per decode step")
    return value


def cmd_generate(args) -> None:
    from kvlab.generate import encode_prompts, greedy_generate
    from kvlab.models import load_model

    _check_generate(args)
    model, tokenizer = load_model(args.model)
    prompts = encode_prompts(tokenizer, args.prompt)
    if args.engine:
        return _generate_engine(args, model, tokenizer, prompts)
    result = greedy_generate(model, prompts, args.max_tokens, cache=args.cache,
                             eos_token_id=tokenizer.eos_token_id, pad_token_id=tokenizer.pad_token_id or 0,
                             max_seq_len=args.max_seq_len, block_size=args.block_size, num_blocks=args.num_blocks)
    texts = [tokenizer.decode(ids, skip_special_tokens=True) for ids in result.token_ids]
    obj = {"model": args.model, "cache": args.cache, "prefill_s": result.prefill_s,
           "decode_tokens_per_s": result.decode_tokens_per_s, "cache_stats": result.cache_stats}
    if len(prompts) == 1:
        obj.update(prompt=args.prompt[0], prompt_ids=prompts[0], text=texts[0], token_ids=result.token_ids[0])
    else:
        obj["requests"] = [{"prompt": p, "prompt_ids": ids, "text": t, "token_ids": out}
                           for p, ids, t, out in zip(args.prompt, prompts, texts, result.token_ids)]
    lines = [p + t for p, t in zip(args.prompt, texts)]
    lines += ["", f"[{sum(map(len, result.token_ids))} tokens, cache={args.cache}, "
                  f"decode {result.decode_tokens_per_s:.1f} tok/s]"]
    st = result.cache_stats
    if args.cache == "static":
        lines.append(f"[static cache utilization {st['utilization']:.1%}]")
    if args.cache == "paged":
        for key in ("blocks_used", "empty_slot_share", "prefix_hits"):
            obj[key] = st[key]
        lines.append(f"[paged: {st['blocks_used']} blocks of {st['block_size']} at peak, "
                     f"{st['empty_slot_share']:.1%} of their slots empty, prefix hits {st['prefix_hits']}]")
    _emit(obj, args.json, lines)


def _generate_engine(args, model, tokenizer, prompts) -> None:
    """``kvlab generate --engine``: the prompts served concurrently by kvlab.engine.LLM."""
    from kvlab.engine import LLM, SamplingParams

    bs = args.block_size
    num_blocks = args.num_blocks or sum(-(-(len(p) + args.max_tokens) // bs) for p in prompts)
    max_num_seqs = args.max_num_seqs
    llm = LLM(model, tokenizer, num_blocks=num_blocks, block_size=bs, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              attn_backend=args.attn_backend, kv_dtype=args.kv_dtype, model_name=args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    outs = llm.generate(prompts, params)
    summary = llm.summary()
    engine = {"attn_backend": args.attn_backend, "kv_dtype": args.kv_dtype, "num_blocks": num_blocks,
              "block_size": bs, "max_num_seqs": max_num_seqs, "max_num_batched_tokens": args.max_num_batched_tokens,
              **summary}
    cache_stats = {**llm.block_manager.stats(), "bytes_reserved": llm.cache.bytes_reserved}
    if hasattr(llm.cache, "saturation"):
        cache_stats.update(llm.cache.stats())
    reqs = [{"prompt": p, "prompt_ids": o.prompt_token_ids, "text": o.text, "token_ids": o.token_ids,
             "finish_reason": o.finish_reason, "metrics": o.metrics} for p, o in zip(args.prompt, outs)]
    obj = {"model": args.model, "cache": "paged", "engine": engine, "cache_stats": cache_stats,
           "decode_tokens_per_s": summary["output_tok_s"]}
    if len(reqs) == 1:
        obj.update(reqs[0])
    else:
        obj["requests"] = reqs
    lines = []
    for r in reqs:
        m = r["metrics"]
        lines.append(f"{r['prompt']}{r['text']}")
        lines.append(f"  [{m['output_tokens']} tokens, {r['finish_reason']}, TTFT {m['ttft_s'] * 1e3:.0f} ms, "
                     f"TPOT {(m['tpot_s'] or 0) * 1e3:.0f} ms, preemptions {m['preemptions']}]")
    lines.append(f"[engine: {len(reqs)} request(s), {summary['steps']} steps, {summary['output_tok_s']:.1f} output "
                 f"tok/s, backend {args.attn_backend}, KV {args.kv_dtype}, scheduler {summary['scheduler_share']:.1%} "
                 f"of step time]")
    _emit(obj, args.json, lines)


def cmd_bench(args) -> None:
    from kvlab import bench
    from kvlab.sizing import fmt_bytes

    if args.what == "recompute":
        from kvlab.models import load_model

        model, tokenizer = load_model(args.model)
        rows = bench.recompute_vs_cache(model, tokenizer, tuple(args.prompt_lens), args.new_tokens)
        lines = [f"{'prompt':>7}{'no cache (s)':>14}{'cache (s)':>11}{'speed-up':>10}{'same tokens':>13}"]
        lines += [f"{r['prompt_tokens']:>7}{r['no_cache_s']:>14.2f}{r['cache_s']:>11.2f}{r['speedup']:>9.1f}x"
                  f"{str(r['same_tokens']):>13}" for r in rows]
        _emit({"rows": rows}, args.json, lines)
    elif args.what == "static":
        from kvlab.models import load_model

        model, tokenizer = load_model(args.model)
        res = bench.static_vs_paged(model, tokenizer, args.new_tokens, args.block_size)
        lines = [f"{'cache':<36}{'slots':>8}{'tokens':>8}{'in use':>12}{'holding tokens':>16}"]
        lines += [f"{k:<36}{v['slots']:>8,}{v['tokens_stored']:>8,}{fmt_bytes(v['bytes_in_use']):>12}"
                  f"{v['utilization']:>16.1%}" for k, v in res.items()]
        _emit(res, args.json, lines)
    elif args.what == "quant":
        from kvlab.models import load_model

        model, tokenizer = load_model(args.model)
        res = bench.quant_table(model, tokenizer, tokens=args.tokens, mixed=not args.no_mixed, chunk=args.chunk,
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
        _emit(res, args.json, lines)
    elif args.what == "engine":
        _bench_engine(args)
    elif args.what == "kernels":  # GPU: timings; CPU: interpreter correctness sweep + bandwidth projection
        from kvlab.kernels import bench as kbench

        if args.out:
            from kvlab.files import check_writable_target

            check_writable_target(args.out, "--out file")

        res = kbench.run(args.shapes, args.batches, args.contexts,
                         progress=lambda m: print(m, file=sys.stderr) if not args.json else None)
        if args.out:
            from kvlab.files import write_atomic

            write_atomic(args.out, json.dumps(res, indent=1), "--out file")
        _emit(res, args.json, kbench.format_table(res).splitlines())
    else:  # memory: the PagedAttention Fig. 2 breakdown on a synthetic workload, no model
        from kvlab.cache import simulate

        reqs = simulate.workload(args.workload, args.requests, seed=args.seed)
        rows = [simulate.simulate(reqs, p, block_size=args.block_size) for p in simulate.POLICIES]
        sweep = simulate.block_size_sweep(reqs)
        lines = [f"{args.workload}, {args.requests} requests: {'policy':<8}{'token states':>14}{'reservation':>13}"
                 f"{'internal frag':>15}"]
        lines += [f"{'':<{len(lines[0]) - 49}}{r['policy']:<8}{r['token_states']:>14.1%}{r['reservation']:>13.1%}"
                  f"{r['internal_fragmentation']:>15.1%}" for r in rows]
        lines += ["block size sweep, slots wasted at completion: "
                  + ", ".join(f"{r['block_size']}: {r['waste_at_completion']:.1%}" for r in sweep)]
        _emit({"policies": rows, "block_size_sweep": sweep}, args.json, lines)


def _bench_engine(args) -> None:
    from kvlab.cache.paged import _check_block_size
    from kvlab.engine.bench import SYSTEMS, bench_engine, check_workload_args, make_workload
    from kvlab.models import load_model

    check_workload_args(args.scale, args.arrival, args.rate)  # before the model loads
    _check_block_size(args.block_size)
    args.max_num_batched_tokens = _batched_tokens(args.max_num_batched_tokens, args.max_num_seqs)
    model, tokenizer = load_model(args.model)
    wl = make_workload(tokenizer, args.num_requests, args.workload, scale=args.scale, seed=args.seed,
                       arrival=args.arrival, rate=args.rate, shared_prefix=not args.no_shared_prefix)
    systems = tuple(args.systems or SYSTEMS)
    res = bench_engine(model, tokenizer, wl, max_num_seqs=args.max_num_seqs, systems=systems,
                       progress=not args.json, block_size=args.block_size,
                       max_num_batched_tokens=args.max_num_batched_tokens, attn_backend=args.attn_backend)
    w = res["workload"]
    lines = [f"{w['requests']} requests ({w['shape']} x {w['scale']}, arrival {w['arrival']}): prompts "
             f"{w['prompt_tokens_mean']:.0f} tokens on average (shared prefix {w['shared_prefix_tokens']}), outputs "
             f"{w['output_tokens_mean']:.0f} on average, {w['output_tokens_max']} at most; max_num_seqs "
             f"{res['max_num_seqs']}, {res['threads']} threads, {res['device']}",
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
    if "hf_generate" in res["systems"]:
        lines.append(f"hf_generate computed {res['systems']['hf_generate']['generated_tokens']} tokens, "
                     f"{res['systems']['hf_generate']['useful_share']:.0%} of them useful (padded batches)")
    _emit(_nan_to_none(res), args.json, lines)


def _nan_to_none(obj):
    """Strict JSON has no NaN: a measure with nothing to measure (e.g. no step at max_num_seqs) is null."""
    if isinstance(obj, dict):
        return {k: _nan_to_none(v) for k, v in obj.items()}
    if isinstance(obj, float) and obj != obj:
        return None
    return obj


def _quant_config(args):
    from kvlab.quant.formats import named_config

    gran = args.scales if args.kv_dtype in ("int8", "fp8", "k8v4") else None
    if args.kv_dtype == "fp8" and args.scales == "per-head":
        gran = "per-tensor"  # fp8's default: one scale per tensor
    policy = args.policy or ("dynamic" if gran in ("per-token", "per-token-head") else "static")
    return named_config(args.kv_dtype, granularity=gran, policy=policy, stat=args.calib, rotate_k=args.rotate)


def _read_files_first(args):
    """Check the files a command reads before it loads a model: a wrong path fails in a second.
    Returns the ``--scales-file`` calibration (or None)."""
    if getattr(args, "file", None):
        from kvlab.files import read_text

        read_text(args.file, "--file")
    if getattr(args, "scales_file", None):
        from kvlab.quant.calibrate import Calibration

        return Calibration.load(args.scales_file)
    return None


def _calibration(args, model, tokenizer, cal=None):
    from kvlab.quant.calibrate import default_calibration

    if cal is not None:
        from kvlab.sizing import kv_config

        c = kv_config(model)
        cal.check_model(c.num_layers, c.num_kv_heads, c.head_dim, f"--scales-file {args.scales_file!r}")
        return cal
    return default_calibration(model, tokenizer, args.model, progress=not args.json)


def cmd_calibrate(args) -> None:
    from kvlab.data import calibration_chunks
    from kvlab.models import load_model
    from kvlab.files import check_writable_target
    from kvlab.quant.calibrate import calibrate

    check_writable_target(args.out, "--out file")  # before the model loads and the calibration runs
    _read_files_first(args)
    model, tokenizer = load_model(args.model)
    if args.file:
        from kvlab.data import text_tokens_from_file

        ids = text_tokens_from_file(tokenizer, args.file, args.tokens)
        chunks = [ids[i:i + args.chunk] for i in range(0, len(ids), args.chunk)]
    else:
        chunks = calibration_chunks(tokenizer, args.tokens, args.chunk)
    cal = calibrate(model, chunks, progress=not args.json, meta={"model": args.model, "text": args.file or "default"})
    path = cal.save(args.out)
    k = cal.stats["k"]["per-head"]
    obj = {"out": str(path), **cal.meta, "k_absmax_max": float(k["absmax"].max()),
           "v_absmax_max": float(cal.stats["v"]["per-head"]["absmax"].max())}
    _emit(obj, args.json, [f"calibration of {cal.meta['tokens']} tokens saved to {path}",
                           f"largest |K| {obj['k_absmax_max']:.2f}, largest |V| {obj['v_absmax_max']:.2f}"])


def _eval_tokens(args, tokenizer):
    from kvlab.data import EVAL_PLAY, text_tokens, text_tokens_from_file

    if args.file:
        return text_tokens_from_file(tokenizer, args.file, args.tokens)
    return text_tokens(tokenizer, args.tokens, play=EVAL_PLAY)


def cmd_ppl(args) -> None:
    from kvlab.eval import check_scoring, evaluate, kv_bytes_per_token
    from kvlab.models import load_model

    if args.stride is None:
        args.stride = max(1, args.window // 2)
    check_scoring(args.tokens, args.window, args.stride, args.chunk)  # before the model loads
    config = _quant_config(args)
    cal = _read_files_first(args)
    model, tokenizer = load_model(args.model)
    cal = _calibration(args, model, tokenizer, cal) if config.needs_calibration(model.config.num_hidden_layers) \
        else None
    tokens = _eval_tokens(args, tokenizer)
    res = evaluate(model, tokens, {"q": config}, cal, window=args.window, stride=args.stride, chunk=args.chunk)
    c = res["configs"]["q"]
    obj = {"ppl": c["ppl"], "ppl_fp": res["ppl_fp"], "delta_ppl_pct": c["delta_ppl_pct"], "kl": c["kl"],
           "top1": c["top1"], "config": c["label"], "bytes_per_token": kv_bytes_per_token(model, config),
           "k_clip_rate": c["k_clip_rate"], "v_clip_rate": c["v_clip_rate"], "corrections":
           c["k_corrections"] + c["v_corrections"], "tokens": res["tokens"], "scored": res["scored"],
           "window": args.window, "stride": args.stride, "chunk": args.chunk}
    _emit(obj, args.json, [f"{c['label']}: ppl {c['ppl']:.3f} vs FP {res['ppl_fp']:.3f} ({c['delta_ppl_pct']:+.2f} %), "
                           f"KL {c['kl']:.4f}, top-1 {c['top1']:.1%}, {obj['bytes_per_token']:.0f} B/token"])


def cmd_export_vllm(args) -> None:
    """``kvlab export-vllm``: the calibrated scales as vLLM checkpoint tensors + config (kvlab/export.py)."""
    from kvlab.export import export_vllm
    from kvlab.models import load_model

    cal = _read_files_first(args)
    model, tokenizer = load_model(args.model)
    cal = _calibration(args, model, tokenizer, cal)  # --scales-file, else the cached default calibration
    res = export_vllm(args.out, cal, strategy=args.strategy, stat=args.calib, model=model)
    _emit(res, args.json, [json.dumps(res, indent=2)])


def cmd_claims(args) -> None:
    """``kvlab claims``: every numeric claim of the source articles, measured now (kvlab/claims.py)."""
    from kvlab import claims

    ids = [x.strip() for x in args.only.split(",") if x.strip()] if args.only is not None else None
    if ids is not None and not ids:
        raise CLIError(f"--only names no claim id (got {args.only!r}): give ids separated by commas, e.g. --only "
                       "D1,Q2 (kvlab claims lists them)")
    say = None if args.json else (lambda cid: print(f"measuring {cid} ...", file=sys.stderr, flush=True))
    rows = claims.run(ids=ids, progress=say)
    _emit({"claims": rows, "counts": claims.counts(rows)}, args.json, [claims.format_table(rows)])


def cmd_convert(args) -> None:
    from kvlab.models import convert_smollm2

    folder = convert_smollm2(force=args.force)
    _emit({"folder": str(folder)}, args.json, [f"smollm2-135m ready in {folder}"])


def build_parser() -> argparse.ArgumentParser:
    from kvlab.cache import CACHE_KINDS
    from kvlab.sizing import DTYPE_BITS

    p = argparse.ArgumentParser(prog="kvlab", description="The KV-cache lab's command line.")
    sub = p.add_subparsers(dest="command", required=True)

    s = sub.add_parser("info", help="versions, device, triton mode, model cache status")
    s.set_defaults(func=cmd_info)

    s = sub.add_parser("size", help="KV-cache size calculator")
    s.add_argument("--model", default="smollm2-135m", help="preset name, local folder or HF id")
    s.add_argument("--dtype", default="fp16", choices=sorted(DTYPE_BITS))
    s.add_argument("--tokens", type=_positive_int("--tokens"), default=4096)
    s.add_argument("--batch", type=_positive_int("--batch"), default=1)
    s.add_argument("--scales", default=None, help="none, per-tensor, per-head, per-channel, per-token, "
                                                   "per-token-head, group-<g> (default depends on dtype)")
    s.set_defaults(func=cmd_size)

    s = sub.add_parser("generate", help="greedy generation through a chosen KV cache")
    s.add_argument("--model", default="smollm2-135m")
    s.add_argument("--cache", default="dynamic", choices=CACHE_KINDS)
    s.add_argument("--prompt", required=True, action="append",
                   help="a prompt; give it several times to serve several prompts (concurrently with --engine)")
    s.add_argument("--max-tokens", type=_positive_int("--max-tokens"), default=32)
    s.add_argument("--max-seq-len", type=_positive_int("--max-seq-len"), default=None,
                   help="static cache slots per sequence (default: prompt + max tokens)")
    s.add_argument("--block-size", type=_positive_int("--block-size"), default=None,
                   help="paged cache / engine: tokens per block, a power of two 1..256 (default 16)")
    s.add_argument("--num-blocks", type=_positive_int("--num-blocks"), default=None,
                   help="paged cache / engine: blocks in the pool (default: enough for prompt + max tokens)")
    s.add_argument("--engine", action="store_true", help="serve through kvlab.engine.LLM (continuous batching)")
    s.add_argument("--attn-backend", default=None, choices=["reference", "torch", "triton"],
                   help="engine: attention path (default torch; triton: the notebook 05 kernels, interpreted on a CPU)")
    s.add_argument("--kv-dtype", default=None, choices=["auto", "fp32", "fp16", "int8", "fp8", "int4", "k8v4"],
                   help="engine: storage of the block pool (default auto; quantized ones use the cached default "
                        "calibration)")
    s.add_argument("--max-num-seqs", type=_positive_int("--max-num-seqs"), default=None,
                   help="engine: requests running at once (default: all prompts)")
    s.add_argument("--max-num-batched-tokens", type=_positive_int("--max-num-batched-tokens"), default=None,
                   help="engine: tokens per step, decodes + prefill chunks (default 512, at least --max-num-seqs)")
    s.add_argument("--temperature", type=float, default=None, help="engine: 0 = greedy (the default)")
    s.add_argument("--top-p", type=float, default=None, help="engine: nucleus sampling (default 1.0)")
    s.add_argument("--seed", type=int, default=None, help="engine: sampling seed")
    s.set_defaults(func=cmd_generate)

    s = sub.add_parser("bench", help="measurements: recompute vs cache, static vs paged, memory breakdown, quant "
                                     "formats, the engine, the Triton kernels")
    s.add_argument("what", choices=["recompute", "static", "memory", "quant", "engine", "kernels"])
    s.add_argument("--model", default="smollm2-135m")
    s.add_argument("--prompt-lens", type=_positive_int("--prompt-lens"), nargs="+", default=[16, 128, 512])
    s.add_argument("--new-tokens", type=_positive_int("--new-tokens"), default=None)
    s.add_argument("--block-size", type=_positive_int("--block-size"), default=16)
    s.add_argument("--workload", default="sharegpt", choices=["sharegpt", "alpaca"])
    s.add_argument("--requests", type=_positive_int("--requests"), default=64)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--tokens", type=_positive_int("--tokens"), default=1024, help="quant: held-out tokens scored")
    s.add_argument("--chunk", type=_positive_int("--chunk"), default=32, help="quant: tokens per forward")
    s.add_argument("--no-mixed", action="store_true", help="quant: skip the mixed-precision search")
    s.add_argument("--num-requests", type=_positive_int("--num-requests"), default=32, help="engine: requests")
    s.add_argument("--arrival", default="all", choices=["all", "poisson"], help="engine: all at once or Poisson")
    s.add_argument("--rate", type=float, default=4.0, help="engine: Poisson arrival rate (requests/s)")
    s.add_argument("--max-num-seqs", type=_positive_int("--max-num-seqs"), default=32,
                   help="engine: running at once (and HF generate()'s batch size)")
    s.add_argument("--max-num-batched-tokens", type=_positive_int("--max-num-batched-tokens"), default=None,
                   help="engine: tokens per step (default 512, at least --max-num-seqs)")
    s.add_argument("--scale", type=float, default=0.25, help="engine: lengths x scale (ShareGPT means 161/338)")
    s.add_argument("--attn-backend", default="torch", choices=["reference", "torch", "triton"])
    s.add_argument("--systems", nargs="+", default=None,
                   choices=["kvlab_continuous", "kvlab_static", "hf_generate", "hf_generate_batch"])
    s.add_argument("--no-shared-prefix", action="store_true", help="engine: no shared system prompt")
    s.add_argument("--shapes", nargs="+", default=None, choices=["llama-3-8b", "smollm2-135m"],
                   help="kernels: attention shapes to sweep")
    s.add_argument("--batches", type=_positive_int("--batches"), nargs="+", default=[1, 8, 32], help="kernels")
    s.add_argument("--contexts", type=_positive_int("--contexts"), nargs="+", default=[1024, 4096, 16384],
                   help="kernels")
    s.add_argument("--out", default=None, help="kernels: also write the JSON result to this file")
    s.set_defaults(func=cmd_bench)

    s = sub.add_parser("calibrate", help="collect K/V abs-max and percentiles per layer x head; save scales")
    s.add_argument("--model", default="smollm2-135m")
    s.add_argument("--out", required=True, help="output .safetensors file")
    s.add_argument("--file", default=None, help="calibration text file (default: the lab's calibration play)")
    s.add_argument("--tokens", type=_positive_int("--tokens"), default=2048)
    s.add_argument("--chunk", type=_positive_int("--chunk"), default=512)
    s.set_defaults(func=cmd_calibrate)

    s = sub.add_parser("ppl", help="perplexity, KL and top-1 of a KV format vs the full-precision cache")
    s.add_argument("--model", default="smollm2-135m")
    s.add_argument("--kv-dtype", default="int8", choices=["fp32", "fp16", "int8", "fp8", "int4", "k8v4"])
    s.add_argument("--scales", default="per-head",
                   choices=["per-tensor", "per-head", "per-channel", "per-token", "per-token-head"])
    s.add_argument("--calib", default="absmax", choices=["absmax", "p99", "p99.9", "p99.99"],
                   help="calibration statistic for static scales")
    s.add_argument("--policy", default=None, choices=["static", "dynamic", "corrected"])
    s.add_argument("--rotate", action="store_true", help="Hadamard-rotate K (and Q) before quantizing")
    s.add_argument("--scales-file", default=None, help="a kvlab calibrate file (default: calibrate once, cached)")
    s.add_argument("--file", default=None, help="text to score (default: held-out Hamlet)")
    s.add_argument("--tokens", type=_positive_int("--tokens"), default=1024)
    s.add_argument("--window", type=_positive_int("--window"), default=512)
    s.add_argument("--stride", type=_positive_int("--stride"), default=None, help="default: half the window")
    s.add_argument("--chunk", type=_positive_int("--chunk"), default=32)
    s.set_defaults(func=cmd_ppl)

    s = sub.add_parser("export-vllm", help="write calibrated FP8 KV scales as vLLM checkpoint tensors + config.json")
    s.add_argument("--model", default="smollm2-135m")
    s.add_argument("--out", required=True, help="output folder (kv_cache_scales.safetensors, config.json)")
    s.add_argument("--scales-file", default=None, help="a kvlab calibrate file (default: calibrate once, cached)")
    s.add_argument("--strategy", default="tensor", choices=["tensor", "attn_head"],
                   help="one scale per layer, or one per KV head (vLLM's FlashAttention backend only)")
    s.add_argument("--calib", default="absmax", choices=["absmax", "p99", "p99.9", "p99.99"],
                   help="calibration statistic; FP8 scale = statistic / 448")
    s.set_defaults(func=cmd_export_vllm)

    s = sub.add_parser("claims", help="every numeric claim of the three source articles, measured now, with a verdict")
    s.add_argument("--only", default=None, metavar="ID,ID", help="measure only these claims (ids as in the table)")
    s.set_defaults(func=cmd_claims)

    s = sub.add_parser("convert", help="convert the bundled SmolLM2 GGUF to safetensors (once)")
    s.add_argument("--force", action="store_true")
    s.set_defaults(func=cmd_convert)

    for s in sub.choices.values():
        s.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p


def main(argv: list[str] | None = None) -> int:
    import kvlab  # noqa: F401  (sets the Triton mode before anything imports triton)
    from kvlab.env import silence_known_warnings

    silence_known_warnings()
    parser = build_parser()
    args = parser.parse_args(argv)
    if getattr(args, "func", None) is cmd_bench and args.new_tokens is None:
        args.new_tokens = 16 if args.what == "recompute" else 64
    from kvlab.cache import OutOfBlocksError

    try:
        args.func(args)
    except (CLIError, ValueError, TypeError, OSError, OutOfBlocksError) as e:
        print(f"kvlab: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:  # Ctrl-C: what kvlab writes is atomic, so nothing is left half-done
        print("kvlab: interrupted", file=sys.stderr)
        return 130
    return 0


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:  # e.g. "No space left on device: '/path'"
        return f"{e.strerror}: {e.filename!r}" if e.filename else e.strerror
    return " ".join(str(e).split()) or type(e).__name__


if __name__ == "__main__":
    sys.exit(main())
