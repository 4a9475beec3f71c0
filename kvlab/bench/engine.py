"""``kvlab bench engine``: the engine against Hugging Face, side by side in ONE process (notebook 04).

One workload (ShareGPT- or Alpaca-like lengths, real text, all at once or Poisson arrivals) served by
kvlab (continuous, static), HF ``generate`` (a streamer times each request's own tokens, so HF is not
charged for waiting on its batch), HF's continuous batching and, with ``make peer``, vLLM's CPU build on
identical token ids (pages of 32 tokens: its CPU attention needs them). Every request asks for exactly
its output length (EOS ignored); ratios are against ``kvlab_continuous`` of the same run.
"""

from __future__ import annotations

import random
import sys
import time
from contextlib import ExitStack
from dataclasses import dataclass, field
from pathlib import Path

import torch

from kvlab.attention import BACKEND_NAMES
from kvlab.bench import vllm_peer
from kvlab.cache.paged import check_block_size
from kvlab.cache.simulate import workload
from kvlab.data import play_text
from kvlab.engine import LLM, SamplingParams
from kvlab.engine.metrics import percentile
from kvlab.env import cpu_name
from kvlab.generate import left_pad
from kvlab.validate import cdiv, check_int

SYSTEMS = ("kvlab_continuous", "kvlab_static", "hf_generate", "hf_generate_batch")  # in this process
PEER_SYSTEMS = ("vllm", "vllm_eager")  # vLLM's CPU build, a subprocess in the peer environment (make peer)
ALL_SYSTEMS = SYSTEMS + PEER_SYSTEMS
SYSTEM_PROMPT = ("You are a helpful assistant in a literature class. Answer questions about the passage the "
                 "student quotes, briefly and precisely, in plain English.")


@dataclass
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]
    arrivals: list[float]  # seconds after the start
    meta: dict = field(default_factory=dict)


def check_workload_args(scale: float, arrival: str = "all", rate: float = 4.0) -> None:
    """The workload's knobs, checked before anything is loaded (``kvlab bench engine`` calls it first)."""
    if arrival not in ("all", "poisson"):
        raise ValueError(f"arrival must be 'all' or 'poisson', got {arrival!r}")
    if isinstance(scale, bool) or not isinstance(scale, (int, float)) or not 0 < scale <= 1:  # NaN too
        raise ValueError(f"scale must be in (0, 1], got {scale!r}")
    if isinstance(rate, bool) or not isinstance(rate, (int, float)) or not 0 < rate < float("inf"):
        raise ValueError(f"rate must be > 0 requests/s (and finite), got {rate!r}")


def make_workload(tokenizer, n: int = 32, shape: str = "sharegpt", scale: float = 0.25, seed: int = 0,
                  arrival: str = "all", rate: float = 4.0, shared_prefix: bool = True,
                  max_len: int = 1024) -> Workload:
    """``n`` requests: lengths from ``shape`` (x ``scale``), Hamlet's text, Poisson at ``rate`` req/s or 0."""
    check_workload_args(scale, arrival, rate)
    reqs = workload(shape, n, seed=seed, max_seq_len=max_len)
    text = tokenizer.encode(play_text("hamlet"))
    prefix = tokenizer.encode(SYSTEM_PROMPT) if shared_prefix else []
    rng = random.Random(seed)
    prompts, outs = [], []
    for r in reqs:
        p = max(4, round(r.prompt_len * scale))
        start = rng.randrange(len(text) - p)
        prompts.append(prefix + text[start:start + p])
        outs.append(max(1, round(r.output_len * scale)))
    t, arrivals = 0.0, []
    for _ in reqs:
        arrivals.append(t if arrival == "poisson" else 0.0)
        t += rng.expovariate(rate)
    meta = {"requests": n, "shape": shape, "scale": scale, "seed": seed, "arrival": arrival,
            "rate": rate if arrival == "poisson" else None, "shared_prefix_tokens": len(prefix),
            "prompt_tokens_mean": sum(map(len, prompts)) / n, "output_tokens_mean": sum(outs) / n,
            "output_tokens_max": max(outs), "output_tokens_total": sum(outs)}
    return Workload(prompts, outs, arrivals, meta)


def _row(reqs: list[dict], wall: float, **extra) -> dict:
    """reqs: per request arrival, first_token, finish (perf_counter s) and output_tokens."""
    ttft = [r["first_token"] - r["arrival"] for r in reqs]
    tpot = [(r["finish"] - r["first_token"]) / (r["output_tokens"] - 1) for r in reqs if r["output_tokens"] > 1]
    e2e = [r["finish"] - r["arrival"] for r in reqs]
    tokens = sum(r["output_tokens"] for r in reqs)
    return {"output_tok_s": tokens / wall, "output_tokens": tokens, "wall_s": wall,
            **{f"{name}_p{q}_s": percentile(xs, q)
               for name, xs in (("ttft", ttft), ("tpot", tpot), ("e2e", e2e)) for q in (50, 99)}, **extra}


def _wait_until(t: float) -> None:
    delay = t - time.perf_counter()
    if delay > 0:
        time.sleep(delay)


def run_kvlab(model, tokenizer, wl: Workload, policy: str = "continuous", max_num_seqs: int = 32,
              num_blocks: int | None = None, block_size: int = 16, max_num_batched_tokens: int = 512,
              attn_backend: str = "torch", kv_cache_dtype: str = "auto", progress=None) -> tuple[dict, object, list]:
    """``wl`` served by kvlab's engine: its row, the engine, and every request's output tokens (workload order)."""
    if num_blocks is None:  # room for the max_num_seqs longest requests at once: no preemption by default
        need = sorted((cdiv(len(p) + o, block_size) for p, o in zip(wl.prompts, wl.output_lens)), reverse=True)
        num_blocks = sum(need[:max_num_seqs])
    llm = LLM(model, tokenizer, num_blocks=num_blocks, block_size=block_size, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=max(max_num_batched_tokens, max_num_seqs), policy=policy,
              attn_backend=attn_backend, kv_cache_dtype=kv_cache_dtype)
    order = sorted(range(len(wl.prompts)), key=lambda i: wl.arrivals[i])
    t0, ids = time.perf_counter(), {}
    while order or llm.has_unfinished():
        while order and t0 + wl.arrivals[order[0]] <= time.perf_counter():
            i = order.pop(0)
            ids[i] = llm.add_request(wl.prompts[i], SamplingParams(max_tokens=wl.output_lens[i], ignore_eos=True),
                                     arrival=t0 + wl.arrivals[i])
        if llm.has_unfinished():
            done = sum(o.finished for o in llm.step())
            if progress is not None:
                progress.update(done)
        elif order:
            _wait_until(t0 + wl.arrivals[order[0]])
    s = llm.summary(list(ids.values()))
    full = [st for st in llm.step_stats if st.running >= max_num_seqs]
    share_full = (sum(st.schedule_s for st in full) / sum(st.total_s for st in full)) if full else float("nan")
    seqs = [llm.seqs[ids[i]] for i in sorted(ids)]  # workload order
    reqs = [{"arrival": q.metrics.arrival, "first_token": q.metrics.first_token, "finish": q.metrics.finished,
             "output_tokens": len(q.output_token_ids)} for q in seqs]
    kept = ("steps", "preemptions", "scheduler_share", "packing_share", "forward_share", "sample_share")
    row = _row(reqs, s["wall_s"], **{k: s[k] for k in kept}, scheduler_share_at_max_num_seqs=share_full,
               num_blocks=num_blocks)
    return row, llm, [list(q.output_token_ids) for q in seqs]


class _TokenTimes:
    """An HF streamer that only notes when each generation step's tokens come out."""

    def __init__(self):
        self.times: list[float] = []
        self._prompt_seen = False

    def put(self, value):
        if self._prompt_seen:
            self.times.append(time.perf_counter())
        self._prompt_seen = True

    def end(self):
        pass


@torch.inference_mode()
def run_hf_generate(model, tokenizer, wl: Workload, max_num_seqs: int = 32, progress=None) -> dict:
    pad = getattr(tokenizer, "pad_token_id", None) or 0
    device = next(model.parameters()).device
    order = sorted(range(len(wl.prompts)), key=lambda i: wl.arrivals[i])
    t0, reqs, computed = time.perf_counter(), [], 0
    while order:
        _wait_until(t0 + wl.arrivals[order[0]])
        now = time.perf_counter()
        batch = [i for i in order if t0 + wl.arrivals[i] <= now][:max_num_seqs]
        order = [i for i in order if i not in batch]
        ids, mask = left_pad([wl.prompts[i] for i in batch], pad)
        longest = max(wl.output_lens[i] for i in batch)
        clock = _TokenTimes()
        model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=longest,
                       min_new_tokens=longest, do_sample=False, pad_token_id=pad, streamer=clock,
                       temperature=None, top_p=None, top_k=None)
        computed += longest * len(batch)
        for i in batch:
            o = wl.output_lens[i]
            reqs.append({"arrival": t0 + wl.arrivals[i], "first_token": clock.times[0], "finish": clock.times[o - 1],
                         "output_tokens": o})
        if progress is not None:
            progress.update(len(batch))
    wall = max(r["finish"] for r in reqs) - t0
    useful = sum(r["output_tokens"] for r in reqs)
    return _row(reqs, wall, generated_tokens=computed, useful_share=useful / computed)


@torch.inference_mode()
def run_hf_generate_batch(model, wl: Workload, max_num_seqs: int = 32, max_num_batched_tokens: int = 512,
                          progress=None) -> dict:
    from transformers import GenerationConfig  # heavy: only this system (HF's continuous batching) needs it
    from transformers.generation.configuration_utils import ContinuousBatchingConfig
    gc = GenerationConfig(max_new_tokens=max(wl.output_lens), do_sample=False, eos_token_id=-1, pad_token_id=0)
    # the same limits as kvlab's engine: requests per step and tokens per step; and the cache sized from the
    # workload as kvlab's is (room for the max_num_seqs longest requests at once, one spare page each): left to
    # itself, HF sizes it from free memory, which on a CPU is 90 % of the machine's RAM (14 GiB on a 24 GiB one)
    page = (getattr(ContinuousBatchingConfig, "page_size", None)
            or getattr(ContinuousBatchingConfig, "block_size", None) or 256)  # block_size before transformers 5.17
    need = sorted((-(-(len(p) + o) // page) + 1 for p, o in zip(wl.prompts, wl.output_lens)), reverse=True)
    cb = ContinuousBatchingConfig(max_requests_per_batch=max_num_seqs, num_blocks=sum(need[:max_num_seqs]),
                                  max_batch_tokens=max(max_num_batched_tokens, max_num_seqs))
    order = sorted(range(len(wl.prompts)), key=lambda i: wl.arrivals[i])
    with model.continuous_batching_context_manager(generation_config=gc, continuous_batching_config=cb, block=True,
                                                   timeout=30) as manager:
        t0, results, arrivals = time.perf_counter(), {}, {}
        while len(results) < len(wl.prompts):
            while order and t0 + wl.arrivals[order[0]] <= time.perf_counter():
                i = order.pop(0)
                arrivals[f"r{i}"] = t0 + wl.arrivals[i]
                manager.add_request(wl.prompts[i], request_id=f"r{i}", max_new_tokens=wl.output_lens[i],
                                    record_timestamps=True, eos_token_id=-1)
            r = manager.get_result(timeout=0.05)
            if r is not None and r.is_finished():
                if r.error is not None:
                    raise RuntimeError(f"HF generate_batch failed on {r.request_id}: {r.error}")
                results[r.request_id] = r
                if progress is not None:
                    progress.update(1)
            elif r is None and not manager.is_running():
                raise RuntimeError("HF generate_batch's generation thread stopped")
    reqs = [{"arrival": arrivals[k], "first_token": r.timestamps[0], "finish": r.timestamps[-1],
             "output_tokens": len(r.generated_tokens)} for k, r in results.items()]
    return _row(reqs, max(r["finish"] for r in reqs) - t0)


def model_folder(model) -> str | None:
    """The folder ``model`` was loaded from, if it is one on disk (vLLM opens the model from there)."""
    path = getattr(model.config, "_name_or_path", "") or ""
    return path if path and (Path(path) / "config.json").is_file() else None


def _peer_job(model, wl: Workload, max_num_seqs: int, max_num_batched_tokens: int, enable_prefix_caching: bool,
              eager: bool) -> dict:
    folder = model_folder(model)
    if folder is None:
        raise ValueError("the vllm systems need a model loaded from a folder on disk (vLLM opens it from there), "
                         f"e.g. smollm2-135m; this one came from {getattr(model.config, '_name_or_path', None)!r}")
    return vllm_peer.serve_job(folder, wl.prompts, wl.output_lens, wl.arrivals, max_num_seqs=max_num_seqs,
                               max_num_batched_tokens=max(max_num_batched_tokens, max_num_seqs),
                               enable_prefix_caching=enable_prefix_caching, eager=eager)


def vllm_row(res: dict, eager: bool) -> tuple[dict, list[list[int]]]:
    """A peer result -> its row (the same columns as kvlab's) and every request's greedy tokens."""
    reqs = [{"arrival": r["arrival"], "first_token": r["first_token"], "finish": r["finish"],
             "output_tokens": len(r["token_ids"])} for r in res["requests"]]
    t0 = res["requests"][0]["t0"]
    row = _row(reqs, max(r["finish"] for r in reqs) - t0, peer=res["vllm"], block_size=vllm_peer.VLLM_BLOCK_SIZE,
               threads=torch.get_num_threads(), mode="eager" if eager else "compiled (torch.compile)")
    return row, [r["token_ids"] for r in res["requests"]]


def _warm_up(model, tokenizer, wl: Workload, systems) -> None:
    """One tiny run of each system first, so no system pays for first-call set-up in the timing."""
    small = Workload(wl.prompts[:2], [2, 2], [0.0, 0.0])
    for name in systems:
        if name in PEER_SYSTEMS:
            continue  # the peer warms itself up in its own process
        if name.startswith("kvlab"):
            run_kvlab(model, tokenizer, small, policy=name.removeprefix("kvlab_"), max_num_seqs=2)
        elif name == "hf_generate":
            run_hf_generate(model, tokenizer, small, 2)
        else:
            run_hf_generate_batch(model, small, 2)


def _median_run(rows: list[dict]) -> dict:
    """The run with the median throughput (its latencies with it), every run's in ``output_tok_s_runs``."""
    row = dict(sorted(rows, key=lambda r: r["output_tok_s"])[(len(rows) - 1) // 2])
    if len(rows) > 1:
        row["output_tok_s_runs"] = [r["output_tok_s"] for r in rows]
    return row


def bench_engine(model, tokenizer, wl: Workload, max_num_seqs: int = 32, systems=SYSTEMS, progress: bool = True,
                 repeat: int = 1, **engine_kw) -> dict:
    """The JSON of ``kvlab bench engine``: systems take turns run by run, each row is its median run, and
    ``throughput_vs_kvlab_paired`` pairs runs; a missing peer's systems are skipped (``res["skipped"]``)."""
    if isinstance(systems, str) or not systems or set(systems) - set(ALL_SYSTEMS):
        raise ValueError(f"systems must be a non-empty subset of {ALL_SYSTEMS}, got {systems!r}")
    skipped = {}
    if vllm_peer.peer_python() is None:
        skipped = {name: vllm_peer.HOW_TO_GET for name in systems if name in PEER_SYSTEMS}
    elif any(name in PEER_SYSTEMS for name in systems) and model_folder(model) is None:
        skipped = {name: "the vllm systems need a model loaded from a folder on disk (e.g. smollm2-135m)"
                   for name in systems if name in PEER_SYSTEMS}
    asked, systems = systems, tuple(name for name in systems if name not in skipped)
    if not systems:
        raise ValueError(f"systems {tuple(asked)!r}: nothing to run: {'; '.join(sorted(set(skipped.values())))}")
    check_block_size(engine_kw.get("block_size", 16))  # before the progress bar and the warm-up
    if engine_kw.get("attn_backend", "torch") not in BACKEND_NAMES:
        raise ValueError(f"attn_backend must be one of {BACKEND_NAMES}, got {engine_kw['attn_backend']!r}")
    check_int("repeat", repeat)
    bar = None
    if progress:
        from tqdm.auto import tqdm  # optional: only for the progress bar
        bar = tqdm(total=len(wl.prompts) * len(systems) * repeat, desc="bench engine", unit="req", file=sys.stderr)
    runs: dict[str, list[dict]] = {name: [] for name in systems}
    tokens: dict[str, list[list[int]]] = {}
    with ExitStack() as stack:
        # each peer engine starts once (not timed) and serves on command: the systems alternate run by run
        sessions = {name: stack.enter_context(vllm_peer.PeerSession(
            _peer_job(model, wl, max_num_seqs, engine_kw.get("max_num_batched_tokens", 512),
                      engine_kw.get("enable_prefix_caching", True), eager=name == "vllm_eager"),
            threads=torch.get_num_threads())) for name in systems if name in PEER_SYSTEMS}
        _warm_up(model, tokenizer, wl, systems)
        for _ in range(repeat):
            for name in systems:
                if bar is not None:
                    bar.set_postfix_str(name)
                toks = None
                if name in PEER_SYSTEMS:
                    row, toks = vllm_row(sessions[name].serve(), eager=name == "vllm_eager")
                    if bar is not None:
                        bar.update(len(wl.prompts))
                elif name.startswith("kvlab"):
                    row, _, toks = run_kvlab(model, tokenizer, wl, policy=name.removeprefix("kvlab_"),
                                             max_num_seqs=max_num_seqs, progress=bar, **engine_kw)
                elif name == "hf_generate":
                    row = run_hf_generate(model, tokenizer, wl, max_num_seqs, progress=bar)
                else:
                    row = run_hf_generate_batch(model, wl, max_num_seqs, engine_kw.get("max_num_batched_tokens", 512),
                                                progress=bar)
                runs[name].append(row)
                if toks is not None:
                    tokens.setdefault(name, toks)
    if bar is not None:
        bar.close()
    out = {name: _median_run(rows) for name, rows in runs.items()}
    if repeat > 1 and "kvlab_continuous" in runs:  # run by run, each system against the kvlab run beside it
        for name, rows in runs.items():
            paired = [r["output_tok_s"] / k["output_tok_s"] for r, k in zip(rows, runs["kvlab_continuous"])]
            out[name]["throughput_vs_kvlab_paired"] = paired
            out[name]["throughput_vs_kvlab_paired_median"] = percentile(paired, 50)
    if "kvlab_continuous" in tokens:
        for name in PEER_SYSTEMS:
            if name in tokens:
                diff = vllm_peer.agreement(tokens["kvlab_continuous"], tokens[name])
                out[name]["greedy_equal_to_kvlab"] = sum(d is None for d in diff)
                out[name]["greedy_first_difference"] = diff  # per request: None (equal) or the first differing position
    base = out.get("kvlab_continuous")
    for row in out.values():
        for ratio, key in (("throughput", "output_tok_s"), ("ttft_p50", "ttft_p50_s"), ("tpot_p50", "tpot_p50_s")):
            if base is not None:
                row[f"{ratio}_vs_kvlab"] = row[key] / base[key]
    res = {"systems": out, "skipped": skipped, "workload": wl.meta, "max_num_seqs": max_num_seqs, "repeat": repeat,
           "threads": torch.get_num_threads(), "device": str(next(model.parameters()).device), "cpu": cpu_name()}
    if base is not None:
        res["scheduler_overhead_share"] = base["scheduler_share"]
        res["scheduler_overhead_share_at_max_num_seqs"] = base["scheduler_share_at_max_num_seqs"]
    return res
