"""The whole system on one workload, in four configurations (notebook 06).

One KV byte budget and a shared-prompt workload, served by the engine as ``static FP16`` (a ``max_len``
slab per request, the paper's Orca (Max)), ``paged FP16``, ``paged INT8`` (~2x the blocks) and ``paged
INT8 + Triton`` (on a CPU's interpreter a correctness check, not a speed); all from the engine's counters.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass

import torch

from kvlab import kernels
from kvlab.bench import vllm_peer
from kvlab.bench.engine import make_workload, model_folder, vllm_row
from kvlab.cache import saturation_summary
from kvlab.engine import LLM, SamplingParams
from kvlab.engine.llm import make_cache
from kvlab.kernels.traffic import count_traffic
from kvlab.validate import cdiv, check_int

CONFIGS = ("static FP16", "paged FP16", "paged INT8", "paged INT8 + Triton")
#: notebook 06's workload (``make_workload(tokenizer, **WORKLOAD)``): 48 chat requests, ShareGPT-like lengths
#: x 0.1, small enough to serve three times in about a minute on 2 cores, long enough that every paged
#: pool still runs out of blocks (the claims table's prefix rows read it; its answer rows 06's run, else its prompts)
WORKLOAD = dict(n=48, scale=0.1, seed=0, max_len=1500)
_SPEC = {  # kv_cache_dtype, attention backend, reservation
    "static FP16": ("fp16", "torch", "static"),
    "paged FP16": ("fp16", "torch", "paged"),
    "paged INT8": ("int8", "torch", "paged"),
    "paged INT8 + Triton": ("int8", "triton", "paged"),
}


def _check_config(name: str) -> tuple[str, str, str]:
    if name not in _SPEC:
        raise ValueError(f"config must be one of {CONFIGS}, got {name!r}")
    return _SPEC[name]


def skip_reason(name: str) -> str | None:
    """Why configuration ``name`` cannot run here, or None: the Triton one needs triton (Linux only)."""
    _, backend, _ = _check_config(name)
    return kernels.WHY_NO_TRITON if backend == "triton" and not kernels.available() else None


def block_bytes(model, kv_cache_dtype: str, block_size: int = 16, calibration=None) -> tuple[int, int]:
    """(bytes per block, fixed bytes) of a pool: static scale tables (notebook 03) do not grow with blocks."""
    probe = make_cache(model, None, 1, block_size, kv_cache_dtype, None, calibration, "smollm2-135m")
    return probe.bytes_per_block, probe.fixed_bytes


@dataclass
class Plan:
    """How one configuration spends the budget."""

    config: str
    kv_cache_dtype: str
    attn_backend: str
    num_blocks: int
    max_num_seqs: int
    prefix_caching: bool
    bytes_per_block: int
    bytes_reserved: int  # what the pool really allocates (<= budget)
    seats: int | None  # static: requests the budget can hold; paged: None (it depends on the lengths)
    block_size: int = 16


def plan(model, name: str, budget_bytes: int, max_len: int = 512, block_size: int = 16, max_num_seqs: int = 64,
         calibration=None) -> Plan:
    """Blocks and seats for config ``name`` within ``budget_bytes``."""
    kv_cache_dtype, backend, reservation = _check_config(name)
    if max_len < block_size:
        raise ValueError(f"max_len must be >= block_size ({block_size}), got {max_len}")
    per_block, fixed = block_bytes(model, kv_cache_dtype, block_size, calibration)
    blocks = (budget_bytes - fixed) // per_block
    if reservation == "static":
        slab = cdiv(max_len, block_size)  # blocks per request, reserved at admission
        seats = blocks // slab
        if seats < 1:
            raise ValueError(f"budget_bytes={budget_bytes:,} holds no {max_len}-token slab "
                             f"({slab * per_block:,} bytes): raise the budget or lower max_len")
        return Plan(name, kv_cache_dtype, backend, seats * slab, seats, False, per_block, seats * slab * per_block + fixed,
                    seats, block_size)
    if blocks < 1:
        raise ValueError(f"budget_bytes={budget_bytes:,} holds no block of {per_block:,} bytes")
    return Plan(name, kv_cache_dtype, backend, int(blocks), max_num_seqs, True, per_block, int(blocks) * per_block + fixed,
                None, block_size)


def max_held(lengths, shared_tokens: int, num_blocks: int, block_size: int = 16) -> int:
    """Requests that a pool of ``num_blocks`` can hold to completion at once (each at its full length,
    prompt + answer, in ``lengths``), shortest first: an upper bound on concurrency, the number vLLM's
    start-up line ("maximum concurrency") gives when every request reaches the serving limit. Every
    prompt begins with the same ``shared_tokens`` (a system prompt): its *full* blocks are stored once."""
    for name, v in (("shared_tokens", shared_tokens), ("num_blocks", num_blocks), ("block_size", block_size)):
        if isinstance(v, bool) or not isinstance(v, int) or v < (1 if name == "block_size" else 0):
            raise ValueError(f"{name} must be a {'positive' if name == 'block_size' else 'non-negative'} integer, got {v!r}")
    if any(isinstance(n, bool) or not isinstance(n, int) or n < shared_tokens for n in lengths):
        raise ValueError(f"lengths must be integers of at least shared_tokens={shared_tokens}")
    shared = shared_tokens // block_size  # a partial last block of the system prompt is each request's own
    used, held = shared, 0
    for n in sorted(cdiv(n, block_size) - shared for n in lengths):
        if used + n > num_blocks:
            break
        used, held = used + n, held + 1
    return held


def make_engine(model, tokenizer, p: Plan, calibration=None, max_num_batched_tokens: int = 256):
    return LLM(model, tokenizer, num_blocks=p.num_blocks, block_size=p.block_size, max_num_seqs=p.max_num_seqs,
               max_num_batched_tokens=max_num_batched_tokens, attn_backend=p.attn_backend, kv_cache_dtype=p.kv_cache_dtype,
               calibration=calibration, enable_prefix_caching=p.prefix_caching)


class DecodeReads:
    """Records, per step, the context tokens every decoding request attends to (its KV read)."""

    def __init__(self, llm):
        self.per_step: dict[int, int] = {}  # step -> sum of decode contexts (tokens)
        self.rows: dict[int, int] = {}  # step -> decoding requests
        self._previous = llm.on_scheduled
        llm.on_scheduled = self

    def __call__(self, batch) -> None:
        if self._previous is not None:
            self._previous(batch)
        # decodes come first; a decode reads the whole context, its own new token included
        seqs = batch.seqs[:batch.num_decodes]
        if seqs:
            self.per_step[batch.step] = sum(s.num_tokens for s in seqs)
            self.rows[batch.step] = len(seqs)


def serve(llm, prompts, output_lens, p: Plan, max_len: int = 512) -> dict:
    """Serve every prompt (all arriving at once, exact output lengths) and measure the run."""
    if any(len(x) + o > max_len for x, o in zip(prompts, output_lens)):
        raise ValueError(f"a request is longer than max_len={max_len} tokens")
    reads = DecodeReads(llm)
    ids = llm.add_requests(prompts, [SamplingParams(max_tokens=o, ignore_eos=True) for o in output_lens])
    while llm.has_unfinished():
        llm.step()
    return measure(llm, ids, reads, p, max_len)


def measure(llm, ids, reads: DecodeReads, p: Plan, max_len: int = 512) -> dict:
    s = llm.summary(ids)
    steps = llm.step_stats
    pos = {sid: k for k, sid in enumerate(ids)}  # the scheduler's decisions by request, not engine ids
    # the steps in which the budget turned a request away: a deferral for lack of blocks or seats, or a
    # preemption. The requests running then are what the budget holds (not the token budget per step)
    bound = {e.step for e in llm.trace
             if (e.action == "deferred" and e.reason in ("no blocks", "seq limit")) or e.action == "preempted"}
    held = [st.running for st in steps if st.step in bound]
    deferred = Counter(e.reason for e in llm.trace if e.action == "deferred")
    per_token = p.bytes_per_block / llm.block_manager.block_size
    if p.seats is not None:  # a static cache's attention reads its whole slab, every row, every step
        kv_read = [reads.rows[k] * max_len * per_token for k in reads.rows]
    else:
        kv_read = [t * per_token for t in reads.per_step.values()]
    out = dict(config=p.config, num_blocks=p.num_blocks, bytes_reserved=p.bytes_reserved,
               requests=len(ids), peak_running=max(st.running for st in steps),
               held_at_limit=statistics.mean(held) if held else float(len(ids)),
               limit_steps=len(held), deferred=dict(deferred), preemptions=s["preemptions"],
               output_tok_s=s["output_tok_s"], ttft_p50_s=s["ttft_p50_s"], tpot_p50_s=s["tpot_p50_s"],
               steps=s["steps"], wall_s=s["wall_s"],
               running=[st.running for st in steps],  # requests holding KV memory after each step's scheduling
               limited=[st.step in bound for st in steps],  # whether the budget turned a request away that step
               kv_read_per_decode_step=statistics.mean(kv_read) if kv_read else 0.0,
               kv_read_per_token=sum(kv_read) / max(sum(reads.rows.values()), 1),  # per generated token
               tokens=[llm.seqs[i].output_token_ids for i in ids],
               decisions=[(e.step, pos[e.seq_id], e.action, e.reason) for e in llm.trace if e.seq_id in pos])
    if quantized(llm.cache):
        out.update(saturation_summary(llm.cache.saturation()))
    return out


def serve_in_vllm(model, wl, budget_bytes: int, max_num_seqs: int = 64, max_len: int = 256) -> dict:
    """The same workload (all at once, exact output lengths) in vLLM's CPU build (``make peer``), in the same KV
    bytes: its cache in the model's fp32 (vLLM 0.32's CPU worker died on ``float16`` and ``int8_per_token_head``
    caches under SmolLM2, AVX-512, 2026-12). Every request's tokens, output tokens/s, the tokens its cache holds;
    or ``{"skipped": why}`` without the peer. Arguments are checked first, peer or not."""
    if not (hasattr(wl, "prompts") and hasattr(wl, "output_lens")):
        raise TypeError(f"wl must be a workload with prompts and output_lens (make_workload(...)), got {type(wl).__name__}")
    if not wl.prompts or len(wl.prompts) != len(wl.output_lens):
        raise ValueError(f"wl must hold one output length per prompt and at least one prompt, got "
                         f"{len(wl.prompts)} prompts and {len(wl.output_lens)} output lengths")
    max_num_seqs, max_len = check_int("max_num_seqs", max_num_seqs), check_int("max_len", max_len, what="tokens")
    longest = max(len(p) + o for p, o in zip(wl.prompts, wl.output_lens))
    if longest > max_len:
        raise ValueError(f"max_len must hold the longest request (prompt + answer, {longest} tokens), got {max_len}")
    per_token = 2 * block_bytes(model, "fp16")[0] // 16  # fp32: twice FP16's bytes per token
    check_int("budget_bytes", budget_bytes, minimum=per_token * vllm_peer.VLLM_BLOCK_SIZE,
              what=f"bytes: at least one vLLM block of {vllm_peer.VLLM_BLOCK_SIZE} fp32 tokens")
    if vllm_peer.peer_python() is None:
        return {"skipped": vllm_peer.HOW_TO_GET}
    folder = model_folder(model)
    if folder is None:
        return {"skipped": "vLLM opens the model from a folder on disk; this one was not loaded from one"}
    job = vllm_peer.serve_job(folder, wl.prompts, wl.output_lens, [0.0] * len(wl.prompts), max_num_seqs=max_num_seqs,
                              max_num_batched_tokens=256, enable_prefix_caching=True, eager=True, max_model_len=max_len)
    job["kv_cache_memory_bytes"] = int(budget_bytes)
    with vllm_peer.PeerSession(job) as session:
        res = session.serve()
    row, tokens = vllm_row(res, eager=True)  # the same row `kvlab bench engine` makes of a peer run
    blocks = budget_bytes // (per_token * vllm_peer.VLLM_BLOCK_SIZE)
    return {"tokens": tokens, "output_tok_s": row["output_tok_s"], "wall_s": row["wall_s"], "vllm": res["vllm"],
            "cache_tokens": blocks * vllm_peer.VLLM_BLOCK_SIZE}


def quantized(cache) -> bool:
    """Whether a pool has scales (and so saturation counters worth showing)."""
    cfg = getattr(cache, "config", None)
    return cfg is not None and any(f.quantized for layer in range(cache.num_layers) for f in cfg.formats(layer))


def limit(row: dict) -> str:
    """What capped the requests held at once, from the scheduler's own reasons."""
    if not row["limit_steps"]:
        return f"nothing: all {row['requests']} requests fit at once"
    memory = {r: n for r, n in row["deferred"].items() if r in ("no blocks", "seq limit")}
    if memory:
        reason, n = max(memory.items(), key=lambda kv: kv[1])
        return f"{reason} ({n} deferrals)" + (f", {row['preemptions']} preemptions" if row["preemptions"] else "")
    return f"no blocks ({row['preemptions']} preemptions)"


def agreement(tokens: list[list[int]], reference: list[list[int]]) -> dict:
    """Agreement with a reference run, up to each answer's first difference (the contexts differ after)."""
    same, shares = 0, []
    for a, b in zip(tokens, reference):
        n = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        same += a == b
        shares.append(n / max(len(b), 1))
    return {"identical": same, "requests": len(reference), "prefix_share": statistics.mean(shares)}


def roomy_agreement(model, tokenizer, calibration, max_tokens: int = 24) -> dict:
    """INT8's greedy answers against FP16's on notebook 06's prompts, ``max_tokens`` each, all at once in roomy
    pools: the claims table's when 06 has not passed its run (a third of the time of 06's whole run in its budget)."""
    prompts, tokens = make_workload(tokenizer, **WORKLOAD).prompts, {}
    for kv in ("fp16", "int8"):
        llm = LLM(model, tokenizer, num_blocks=len(prompts) * cdiv(max(map(len, prompts)) + max_tokens, 16), block_size=16,
                  max_num_seqs=len(prompts), max_num_batched_tokens=4096, kv_cache_dtype=kv, calibration=calibration)
        tokens[kv] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=max_tokens, ignore_eos=True))]
    return {**agreement(tokens["int8"], tokens["fp16"]), "workload": f"notebook 06's prompts, {max_tokens} tokens each, roomy pools"}


@torch.inference_mode()
def count_step_bytes(llm) -> dict:
    """Bytes the Triton kernels really move in ONE engine step (interpreter only), to check the byte model."""
    reads = DecodeReads(llm)
    with count_traffic() as n:
        llm.step()
    step = max(reads.per_step) if reads.per_step else None
    llm.on_scheduled = reads._previous
    return {"read": n["read"], "write": n["write"], "context_tokens": reads.per_step.get(step, 0),
            "rows": reads.rows.get(step, 0)}
