"""Measurements of the caches that notebooks 00-03 and ``kvlab bench recompute | static | quant`` share.
Every ratio is against a baseline run a moment before in the same process, never a remembered number.
"""

from __future__ import annotations

import statistics
import time

import torch

from kvlab.cache import StaticCache
from kvlab.calibrate import default_calibration
from kvlab.data import CALIBRATION_PLAY, EVAL_PLAY, chat_prompts, text_tokens
from kvlab.eval import auto_config, evaluate, kv_bytes_per_token, layer_sensitivity
from kvlab.generate import greedy_generate
from kvlab.quant.config import KVQuantConfig, TensorFormat, named_config
from kvlab.sizing import kv_size
from kvlab.validate import is_int


def memory_bandwidth(megabytes: int = 256, repeats: int = 5) -> float:
    """Bytes/s this device streams through a sum: it reads every byte once, as a decode step does."""
    device = "cuda" if torch.cuda.is_available() else "cpu"
    x = torch.ones(megabytes * 2**20 // 4, dtype=torch.float32, device=device)
    best = float("inf")
    sync = torch.cuda.synchronize if device == "cuda" else (lambda: None)
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        x.sum()
        sync()
        best = min(best, time.perf_counter() - t0)
    return x.nbytes / best


def _prompt(tokenizer, n: int) -> list[int]:
    if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
        return [(7 * i) % 250 + 3 for i in range(n)]  # tiny model: any byte tokens do
    return text_tokens(tokenizer, n)


def decode_step_time(model, tokenizer, context: int, steps: int = 8) -> float:
    """Median wall time of one cached decode step with ``context`` tokens already in the cache."""
    g = greedy_generate(model, [_prompt(tokenizer, context)], steps + 1, cache="dynamic")
    return statistics.median(g.step_s)


def memory_floor(model, tokenizer, kv_cache_dtype: str, contexts=(16, 256, 1024), rounds: int = 3, steps: int = 6) -> dict:
    """Notebook 00 section 5: real decode steps at each context against their floor, (weights + KV bytes) /
    bandwidth. A warm-up first; the bandwidth before and after the steps (the better one counts: a busy
    moment only lowers it); each context's step the fastest of ``rounds`` medians of ``steps`` steps. Also
    the arithmetic a step does (weights, and attention over the first and last context)."""
    if not is_int(rounds) or rounds < 1:
        raise ValueError(f"rounds must be an integer >= 1, got {rounds!r}")
    contexts = list(contexts)
    decode_step_time(model, tokenizer, contexts[0], steps=2)  # the first steps of a fresh model run slow
    before = memory_bandwidth(repeats=10)
    runs = [{c: decode_step_time(model, tokenizer, c, steps=steps) for c in contexts} for _ in range(rounds)]
    after = memory_bandwidth(repeats=10)
    bw, weights = max(before, after), sum(p.nbytes for p in model.parameters())
    rows = []
    for c in contexts:
        kv = kv_size(model, kv_cache_dtype, tokens=c).total_bytes
        rows.append(dict(context=c, kv=kv, floor=(weights + kv) / bw, measured=min(r[c] for r in runs),
                         copy=2 * kv / bw,  # a growing cache is concatenated every step: read once more, written again
                         rounds=(min(r[c] for r in runs), max(r[c] for r in runs))))
    cfg = model.config  # q.k and p.v: 2 FLOPs per query head, dimension, layer and cached token, each
    per_token = 2 * 2 * cfg.num_attention_heads * (cfg.hidden_size // cfg.num_attention_heads) * cfg.num_hidden_layers
    return dict(bandwidth=bw, before=before, after=after, rows=rows,
                matmul_flops=2 * sum(p.numel() for p in model.parameters()),  # a multiply-add per weight and token
                attention_flops={c: per_token * c for c in (contexts[0], contexts[-1])})


def token_forwards(prompt_len: int, new_tokens: int, cached: bool) -> int:
    """Token positions pushed through the model: without a cache step i re-runs the whole prefix
    (quadratic); with one, each step after the prompt feeds one token. The last token is never fed back."""
    if cached:
        return prompt_len + new_tokens - 1
    return sum(prompt_len + i for i in range(new_tokens))


def recompute_vs_cache(model, tokenizer, prompt_lens=(16, 128, 512), new_tokens: int = 16,
                       repeats: int = 3) -> list[dict]:
    """Greedy generation without and with a cache per prompt length, back to back so a drifting machine moves
    both alike; the speed-up is the median of the runs' ratios. The tokens must agree: a cache is exact."""
    if not is_int(repeats) or repeats < 1:
        raise ValueError(f"repeats must be an integer >= 1, got {repeats!r}")
    rows = []
    for n in prompt_lens:
        prompt = _prompt(tokenizer, n)
        t_cache, t_none, same = [], [], True
        for _ in range(repeats):
            t0 = time.perf_counter()
            cached = greedy_generate(model, [prompt], new_tokens, cache="dynamic")
            t_cache.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            recomputed = greedy_generate(model, [prompt], new_tokens, cache="none")
            t_none.append(time.perf_counter() - t0)
            same = same and cached.token_ids == recomputed.token_ids
        ratios = [a / b for a, b in zip(t_none, t_cache)]
        rows.append({
            "prompt_tokens": n, "new_tokens": new_tokens, "repeats": repeats,
            "no_cache_s": statistics.median(t_none), "cache_s": statistics.median(t_cache),
            "speedup": statistics.median(ratios), "speedups": ratios,
            "speedup_min": min(ratios), "speedup_max": max(ratios),
            "token_forwards_no_cache": token_forwards(n, new_tokens, False),
            "token_forwards_cache": token_forwards(n, new_tokens, True),
            "same_tokens": same,
        })
    return rows


def static_vs_paged(model, tokenizer, max_new_tokens: int = 64, block_size: int = 16,
                    loose_max_seq_len: int = 2048) -> dict:
    """Notebooks 01/02's chat through a loose static, a tight static and a paged cache (same tokens)."""
    prompts = chat_prompts(tokenizer)
    eos, pad = tokenizer.eos_token_id, tokenizer.pad_token_id or 0
    out, tokens = {}, None
    for name, max_seq_len in (("static, reserve %d" % loose_max_seq_len, loose_max_seq_len),
                              ("static, reserve prompt + budget", max(map(len, prompts)) + max_new_tokens)):
        cache = StaticCache.from_model(model, max_batch=len(prompts), max_seq_len=max_seq_len)
        g = greedy_generate(model, prompts, max_new_tokens, cache=cache, eos_token_id=eos, pad_token_id=pad)
        tokens = tokens or g.token_ids
        if g.token_ids != tokens:
            raise AssertionError(f"{name}: tokens differ")
        s = cache.stats()
        out[name] = {"utilization": s["utilization"], "bytes_in_use": s["bytes_reserved"],
                     "tokens_stored": s["tokens_stored"], "slots": s["slots_reserved"]}
    g = greedy_generate(model, prompts, max_new_tokens, cache="paged", block_size=block_size, eos_token_id=eos)
    if g.token_ids != tokens:
        raise AssertionError("paged: tokens differ")
    s = g.cache_stats
    out[f"paged, {block_size}-token blocks (peak)"] = {
        "utilization": 1 - s["empty_slot_share"], "bytes_in_use": s["slots_reserved"] * s["bytes_reserved"]
        // (s["num_blocks"] * s["block_size"]), "tokens_stored": s["tokens_stored"], "slots": s["slots_reserved"]}
    return out


def quant_configs(mixed=None) -> dict:
    """The format table of notebook 03 and the quantization issue: name -> KVQuantConfig."""
    out = {"fp16": named_config("fp16")}
    for gran in ("per-tensor", "per-channel", "per-head"):
        for stat in ("absmax", "p99.9"):
            out[f"int8 {gran} {stat}"] = named_config("int8", granularity=gran, stat=stat)
    out["int8 per-head absmax + correction"] = named_config("int8", policy="corrected")
    out["int8 per-token-head (dynamic)"] = named_config("int8", granularity="per-token-head", policy="dynamic")
    out["fp8 per-tensor absmax"] = named_config("fp8")
    out["K8V4 (K int8 per-head, V int4)"] = named_config("k8v4")
    out["K4V8 (K int4, V int8 per-head)"] = KVQuantConfig(TensorFormat("int4"), TensorFormat("int8"))
    out["int4 g32"] = named_config("int4")
    out["int4 g32, Hadamard K"] = named_config("int4", rotate_k=True)
    if mixed is not None:
        out["mixed (auto, 75% of int8 bytes)"] = mixed
    return out


def quant_table(model, tokenizer, tokens: int = 1024, calib_tokens: int = 2048, mixed: bool = True,
                chunk: int = 32, model_name: str = "smollm2-135m", progress: bool = False) -> dict:
    """Every format of :func:`quant_configs` on held-out text, in lockstep with the FP cache."""
    cal = default_calibration(model, tokenizer, model_name, calib_tokens, progress=progress)
    mix = None
    if mixed:  # sensitivity on the END of the calibration play: still not the evaluation text
        sens_tokens = text_tokens(tokenizer, 256, play=CALIBRATION_PLAY, offset=calib_tokens)
        sens = layer_sensitivity(model, sens_tokens, cal)
        hi, lo = named_config("int8"), named_config("int4")
        mix = auto_config(model, sens, 0.75 * kv_bytes_per_token(model, hi), hi, lo)
    configs = quant_configs(mix)
    res = evaluate(model, text_tokens(tokenizer, tokens, play=EVAL_PLAY), configs, cal, chunk=chunk)
    for name, cfg in configs.items():
        res["configs"][name]["bytes_per_token"] = kv_bytes_per_token(model, cfg)
    res["fp16_bytes_per_token"] = kv_bytes_per_token(model, configs["fp16"])
    return res
