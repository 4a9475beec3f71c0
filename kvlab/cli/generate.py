"""``kvlab generate``: greedy tokens through a chosen KV cache (notebooks 01-03), or by the engine with
``--engine`` (04); every option that cannot work is refused before the model loads."""

from __future__ import annotations

from kvlab import models  # through the module: tests swap models.load_model
from kvlab.cache.paged import check_block_size
from kvlab.engine import LLM, SamplingParams
from kvlab.generate import encode_prompts, greedy_generate
from kvlab.validate import cdiv
from kvlab.cli.common import CLIError, batched_tokens, emit

# options that only the engine reads, with their defaults
ENGINE_OPTIONS = {"attn_backend": "torch", "kv_cache_dtype": "auto", "max_num_seqs": None, "max_num_batched_tokens": None,
                  "temperature": 0.0, "top_p": 1.0, "seed": None}


def check_generate(args) -> None:
    """Everything about ``kvlab generate``'s arguments that can be refused before the model loads."""
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
    args.block_size = check_block_size(args.block_size or 16)
    if args.engine:
        for name, default in ENGINE_OPTIONS.items():
            if getattr(args, name) is None and default is not None:
                setattr(args, name, default)
        SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p, seed=args.seed)
        args.max_num_seqs = args.max_num_seqs or len(args.prompt)
        args.max_num_batched_tokens = batched_tokens(args.max_num_batched_tokens, args.max_num_seqs)


def cmd_generate(args) -> int:
    check_generate(args)
    model, tokenizer = models.load_model(args.model)
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
    emit(obj, args.json, lines)
    return 0


def _generate_engine(args, model, tokenizer, prompts) -> int:
    """``kvlab generate --engine``: the prompts served concurrently by kvlab.engine.LLM."""
    bs = args.block_size
    num_blocks = args.num_blocks or sum(cdiv(len(p) + args.max_tokens, bs) for p in prompts)
    max_num_seqs = args.max_num_seqs
    llm = LLM(model, tokenizer, num_blocks=num_blocks, block_size=bs, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=args.max_num_batched_tokens,
              attn_backend=args.attn_backend, kv_cache_dtype=args.kv_cache_dtype, model_name=args.model)
    params = SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature, top_p=args.top_p,
                            seed=args.seed)
    outs = llm.generate(prompts, params)
    summary = llm.summary()
    engine = {"attn_backend": args.attn_backend, "kv_cache_dtype": args.kv_cache_dtype, "num_blocks": num_blocks,
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
                 f"tok/s, backend {args.attn_backend}, KV {args.kv_cache_dtype}, scheduler {summary['scheduler_share']:.1%} "
                 f"of step time]")
    emit(obj, args.json, lines)
    return 0
