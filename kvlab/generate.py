"""Greedy decode loops, one explicit step at a time, through any kvlab cache (notebooks 01, 02, 07).

Every loop must reproduce HF's own ``generate()`` token for token in fp32: the test that anchors
each new cache to the previous one.
"""

from __future__ import annotations

import inspect
import time
from dataclasses import dataclass, field

import torch
from transformers import DynamicCache

from kvlab.cache import CACHE_KINDS, StaticCache, static_tokens_stored
from kvlab.cache.evict import EvictionPolicy, kept_positions
from kvlab.cache.paged import BlockManager, check_token_ids
from kvlab.engine import LLM, SamplingParams
from kvlab.hf import CACHE_KWARG, KVLabCache, attention_implementation, make_store
from kvlab.validate import cdiv, check_int, is_int


def left_pad(prompts: list[list[int]], pad_token_id: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``input_ids`` and ``attention_mask`` (B, T_max), left-padded so every row's last prompt token is in
    the last column and one decode step appends to all rows at the same cache position."""
    width = max(len(p) for p in prompts)
    ids = torch.full((len(prompts), width), pad_token_id, dtype=torch.long)
    mask = torch.zeros((len(prompts), width), dtype=torch.long)
    for i, p in enumerate(prompts):
        if p:
            ids[i, width - len(p):] = torch.tensor(p, dtype=torch.long)
            mask[i, width - len(p):] = 1
    return ids, mask


def _positions(mask: torch.Tensor) -> torch.Tensor:
    # each row counts from 0 at its first real token; pads get 1 (as HF generate does), they are masked anyway
    return (mask.cumsum(-1) - 1).masked_fill(mask == 0, 1)


@dataclass
class Generation:
    """What :func:`greedy_generate` returns: the new tokens per row and what it cost."""

    token_ids: list[list[int]]  # generated ids per row (after EOS: nothing)
    cache: str
    prefill_s: float
    step_s: list[float] = field(default_factory=list)  # wall time of each decode step
    cache_stats: dict = field(default_factory=dict)

    @property
    def decode_tokens_per_s(self) -> float:
        steps = sum(self.step_s)
        return sum(len(t) for t in self.token_ids) / steps if steps else float("nan")


class _StepClock:
    """Wall time of the first forward (prefill) and of every decode step after it."""

    def __init__(self):
        self.t0 = time.perf_counter()
        self.prefill_s: float = 0.0
        self.step_s: list[float] = []
        self.started = False

    def tick(self) -> None:
        t1 = time.perf_counter()
        if self.started:
            self.step_s.append(t1 - self.t0)
        else:
            self.prefill_s, self.started = t1 - self.t0, True
        self.t0 = t1


def _validate(prompts, max_new_tokens: int, model=None) -> list[list[int]]:
    """Prompts as lists of token ids in the model's vocabulary (one prompt may come unwrapped)."""
    check_int("max_new_tokens", max_new_tokens)
    if not isinstance(prompts, (list, tuple)) or not prompts:
        raise ValueError("prompts must be a non-empty list of token-id lists")
    if isinstance(prompts[0], int):
        prompts = [prompts]
    vocab = getattr(getattr(model, "config", None), "vocab_size", None)
    out = []
    for i, p in enumerate(prompts):
        if not isinstance(p, (list, tuple)) and not (isinstance(p, torch.Tensor) and p.dim() == 1):
            raise ValueError(f"prompt {i} must be a list of token ids, got {type(p).__name__}")
        p = p.tolist() if isinstance(p, torch.Tensor) else list(p)
        if not p:
            raise ValueError(f"prompt {i} is empty: every prompt needs at least one token")
        out.append(check_token_ids(p, f"prompt {i} token ids", vocab))
    return out


@torch.inference_mode()
def greedy_generate(model, prompts, max_new_tokens: int, cache="dynamic", eos_token_id: int | None = None,
                    pad_token_id: int = 0, max_seq_len: int | None = None, block_size: int = 16,
                    num_blocks: int | None = None) -> Generation:
    """Greedy decoding, one explicit step at a time, through ``cache``: "none" (recompute the prefix every
    step), "dynamic" (:class:`ContiguousCache`), "static" (:class:`StaticCache` of ``max_seq_len`` slots,
    default longest prompt + ``max_new_tokens``), "paged" (:func:`paged_generate`) or a store object. In
    fp32 every cache must give HF's own ``generate()`` tokens."""
    if cache == "paged":
        return paged_generate(model, prompts, max_new_tokens, block_size=block_size, num_blocks=num_blocks,
                              eos_token_id=eos_token_id)
    prompts = _validate(prompts, max_new_tokens, model)
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_token_id)
    ids, mask = ids.to(device), mask.to(device)
    batch, width = ids.shape
    store = None
    if isinstance(cache, str):
        if cache not in CACHE_KINDS:
            raise ValueError(f"cache must be one of {', '.join(CACHE_KINDS)}, got {cache!r}")
        kind = cache
        if kind == "static":
            max_seq_len = width + max_new_tokens if max_seq_len is None else max_seq_len
            if width > max_seq_len:
                raise ValueError(
                    f"prompt of {width} tokens is longer than the static cache's max_seq_len={max_seq_len}"
                )
        if kind != "none":
            store = make_store(kind, model, batch=batch, max_seq_len=max_seq_len)
    else:
        store, kind = cache, getattr(cache, "kind", type(cache).__name__)
        if not all(hasattr(store, a) for a in ("update", "seq_len", "reset", "num_layers")):
            raise TypeError(f"cache must be one of {', '.join(CACHE_KINDS)} or a kvlab store (ContiguousCache, "
                            f"StaticCache), got {type(cache).__name__}")
        if store.seq_len(0):
            raise ValueError(f"cache already holds {store.seq_len(0)} tokens: greedy_generate feeds the prompts from "
                             "position 0; pass an empty store (cache.reset())")
    try:
        return _greedy_loop(model, prompts, max_new_tokens, store, kind, ids, mask, eos_token_id, pad_token_id)
    except BaseException:  # error or Ctrl-C mid-forward: some layers may hold one more token than others
        if store is not None and store is cache:
            store.reset()  # the caller's store goes back to how it came in: empty
        raise


def _greedy_loop(model, prompts, max_new_tokens, store, kind, ids, mask, eos_token_id, pad_token_id) -> Generation:
    device = ids.device
    batch, width = ids.shape
    hf_cache = KVLabCache(store) if store is not None else None
    finished = torch.zeros(batch, dtype=torch.bool, device=device)
    generated: list[list[int]] = [[] for _ in range(batch)]
    seq = ids  # only grows for the no-cache path
    cap = max_new_tokens
    if isinstance(store, StaticCache):
        cap = min(cap, store.max_seq_len - width + 1)  # the last token is sampled, never stored
    clock = _StepClock()
    # only the last position samples: its logits alone, as HF's generate() asks (logits_to_keep=1), not the LM
    # head over every position (a fifth of SmolLM2's weights, again per prompt token in a prefill or a recompute)
    last = {"logits_to_keep": 1} if "logits_to_keep" in inspect.signature(model.forward).parameters else {}
    for step in range(cap):
        if step == 0 or store is None:
            model_in = dict(input_ids=seq, attention_mask=mask, position_ids=_positions(mask))
        else:
            model_in = dict(input_ids=next_ids[:, None], attention_mask=mask,
                            position_ids=_positions(mask)[:, -1:])
        if store is None:
            out = model(**model_in, use_cache=False, **last)
        else:
            out = model(**model_in, use_cache=True, **{CACHE_KWARG: hf_cache}, **last)
        next_ids = out.logits[:, -1, :].argmax(dim=-1)  # (B,)
        if eos_token_id is not None:
            next_ids = torch.where(finished, torch.full_like(next_ids, pad_token_id), next_ids)
        clock.tick()
        for i, t in enumerate(next_ids.tolist()):
            if not finished[i]:
                generated[i].append(t)
        if eos_token_id is not None:
            finished |= next_ids == eos_token_id
            if bool(finished.all()):
                break
        mask = torch.cat([mask, torch.ones((batch, 1), dtype=mask.dtype, device=device)], dim=1)
        if store is None:
            seq = torch.cat([seq, next_ids[:, None]], dim=1)
    if isinstance(store, StaticCache):
        # real tokens per row: its prompt plus the generated tokens fed back before the loop ended
        store.set_real_tokens(static_tokens_stored(map(len, prompts), map(len, generated)))
    return Generation(token_ids=generated, cache=kind, prefill_s=clock.prefill_s, step_s=clock.step_s,
                      cache_stats=store.stats() if store is not None else {})


class Stepper:
    """One model step through a kvlab store, for one sequence (notebook 01, Task 2): ``step(token_ids)``
    -> (vocab,) logits of the last token fed; the decode loop is the caller's."""

    def __init__(self, model, store):
        if not all(hasattr(store, a) for a in ("update", "seq_len", "reset", "num_layers")):
            raise TypeError(f"store must be a kvlab store (ContiguousCache, StaticCache), got {type(store).__name__}")
        if store.seq_len(0):
            raise ValueError(f"store already holds {store.seq_len(0)} tokens: pass an empty one (store.reset())")
        self.model, self.store = model, store
        self.hf_cache = KVLabCache(store)
        self.calls = self.forwards = 0

    @torch.inference_mode()
    def __call__(self, token_ids) -> torch.Tensor:
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.flatten().tolist()
        if is_int(token_ids):
            token_ids = [token_ids]
        if not isinstance(token_ids, (list, tuple)) or not token_ids or not all(is_int(t) for t in token_ids):
            raise TypeError(f"step takes a non-empty list of token ids, got {token_ids!r}")
        start = self.store.seq_len(0)  # the next position: what the store holds so far
        device = next(self.model.parameters()).device
        ids = torch.tensor([list(token_ids)], device=device)  # (1, q_len)
        positions = torch.arange(start, start + len(token_ids), device=device)[None]
        out = self.model(input_ids=ids, position_ids=positions, use_cache=True, **{CACHE_KWARG: self.hf_cache})
        self.calls += 1
        self.forwards += len(token_ids)
        return out.logits[0, -1]  # (vocab,)


def cached_generate(step, prompt_ids, new_tokens: int) -> list[int]:
    """Greedy decoding with a cache (notebook 01, Task 2): the prompt goes through once (prefill), then
    each step feeds only the token just chosen. The last token is chosen, never fed back."""
    logits = step(list(prompt_ids))  # prefill: every prompt token once
    out = []
    for i in range(new_tokens):
        out.append(int(logits.argmax()))
        if i < new_tokens - 1:
            logits = step([out[-1]])  # decode: one token; the cache holds the rest
    return out


@torch.inference_mode()
def hf_generate(model, prompts, max_new_tokens: int, eos_token_id: int | None = None, pad_token_id: int = 0,
                cache=None) -> list[list[int]]:
    """The reference: HF's own greedy ``model.generate``, ids cut after EOS like :func:`greedy_generate`."""
    prompts = _validate(prompts, max_new_tokens, model)
    device = next(model.parameters()).device
    ids, mask = left_pad(prompts, pad_token_id)
    kwargs = {} if cache is None else {CACHE_KWARG: cache}
    out = model.generate(
        input_ids=ids.to(device), attention_mask=mask.to(device), max_new_tokens=max_new_tokens,
        min_new_tokens=0 if eos_token_id is not None else max_new_tokens,
        do_sample=False, num_beams=1, eos_token_id=eos_token_id, pad_token_id=pad_token_id,
        temperature=None, top_p=None, top_k=None, **kwargs,
    )
    rows = []
    for row in out[:, ids.shape[1]:].tolist():
        if eos_token_id is not None and eos_token_id in row:
            row = row[: row.index(eos_token_id) + 1]
        rows.append(row)
    return rows


def encode_prompts(tokenizer, prompts) -> list[list[int]]:
    """Text prompt(s) -> token-id lists; rejects empty prompts with a clear error."""
    if isinstance(prompts, str):
        prompts = [prompts]
    if not prompts:
        raise ValueError("prompt must not be empty")
    out = []
    for p in prompts:
        if not isinstance(p, str) or not p.strip():
            raise ValueError(f"prompt must be a non-empty string, got {p!r}")
        out.append(list(tokenizer.encode(p)))
    return out


def pool_for(prompts: list[list[int]], max_new_tokens: int, block_size: int) -> int:
    """Blocks for every prompt and its whole answer at once: what paged_generate's pool holds by default."""
    return sum(cdiv(len(p) + max_new_tokens, block_size) for p in prompts)


@torch.inference_mode()
def paged_generate(model, prompts, max_new_tokens: int, block_size: int = 16, num_blocks: int | None = None,
                   eos_token_id: int | None = None, manager=None, cache=None, enable_prefix_caching: bool = True,
                   attn_backend: str = "reference") -> Generation:
    """Greedy decoding through a paged cache, sequences packed side by side with no padding, on the
    serving engine (notebook 04). Pass ``manager`` and ``cache`` to keep prefix blocks across calls;
    ``cache_stats`` is taken at the step that held the most blocks."""
    prompts = _validate(prompts, max_new_tokens, model)
    if num_blocks is not None and (not is_int(num_blocks) or num_blocks < 1):
        raise ValueError(f"num_blocks must be a positive integer or None (enough for every prompt), got {num_blocks!r}")
    if manager is None:
        num_blocks = num_blocks or pool_for(prompts, max_new_tokens, block_size)
        manager = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching)
    llm = LLM(model, None, block_manager=manager, cache=cache, max_num_seqs=len(prompts),
              max_num_batched_tokens=max(sum(map(len, prompts)), len(prompts)), attn_backend=attn_backend,
              eos_token_id=eos_token_id, watermark=0.0)
    peak: dict = {}
    def record(batch):  # the pool as the forward sees it
        nonlocal peak
        s = manager.stats()
        if s["blocks_used"] >= peak.get("blocks_used", -1):
            peak = s
    llm.on_scheduled = record
    ids = llm.add_requests(prompts, [SamplingParams(max_tokens=max_new_tokens)] * len(prompts))
    try:
        while llm.has_unfinished():
            llm.step()
    except BaseException:  # an error or Ctrl-C mid-run: no sequence keeps blocks, the manager stays usable
        for sid in ids:
            llm.abort_request(sid)
        raise
    final = manager.stats()
    peak.update({k: final[k] for k in ("prefix_queries", "prefix_hits", "prefix_hit_rate", "evictions", "cow_copies")})
    peak.update(bytes_reserved=llm.cache.bytes_reserved,
                bytes_holding_tokens=peak["tokens_stored"] * llm.cache.bytes_per_block // llm.cache.block_size,
                cached_prompt_tokens=sum(llm.seqs[i].metrics.cached_prompt_tokens for i in ids))
    times = [st.total_s for st in llm.step_stats]
    return Generation(token_ids=[llm.seqs[i].output_token_ids for i in ids], cache="paged", prefill_s=times[0],
                      step_s=times[1:], cache_stats=peak)


# ---- eviction, the textbook way (notebook 07): a dense cache, the evicted tokens masked out ---------

@torch.inference_mode()
def textbook_eviction(model, prompt_ids, max_new_tokens: int, policy: EvictionPolicy, group: int = 1,
                      forced=None) -> dict:
    """Eviction as a mask on the unmodified HF model (notebook 07): an evicted position is masked out of
    every later softmax, which is what dropping it does; scores are the eager attention probabilities.
    ``kept`` is the positions kept after each step, as the engine's block tables would hold them."""
    prompt = list(prompt_ids)
    P = len(prompt)
    steps = max_new_tokens if forced is None else len(forced)
    device = next(model.parameters()).device
    cache = DynamicCache()
    kept = torch.ones(P, dtype=torch.bool)
    scores = torch.zeros(P, dtype=torch.float64)
    tokens, logits_out, history = [], [], []
    done = False
    from_pos = policy.observe_from(P)
    with attention_implementation(model, "eager"):
        ids = torch.tensor([prompt], device=device)
        start = 0
        for step in range(steps):
            n_new = ids.shape[1]
            n = start + n_new
            # row r (position start + r) sees the kept positions before start, and the new ones up to itself
            visible = torch.zeros(n_new, n, dtype=torch.bool)
            visible[:, :start] = kept[:start]
            visible[:, start:] = torch.ones(n_new, n_new, dtype=torch.bool).tril()
            mask = torch.zeros(1, 1, n_new, n).masked_fill(~visible, torch.finfo(torch.float32).min)
            out = model(input_ids=ids, position_ids=torch.arange(start, n, device=device)[None],
                        attention_mask=mask.to(device), use_cache=True, output_attentions=from_pos is not None,
                        **{CACHE_KWARG: cache})
            if from_pos is not None:  # (1, H_q, n_new, n) per layer -> each key's mass from the queries that count
                rows = torch.arange(start, n) >= from_pos
                for a in out.attentions:
                    scores[:n] += a[0][:, rows].double().sum(dim=(0, 1)).cpu()
            row = out.logits[0, -1].float().cpu()
            nxt = int(row.argmax()) if forced is None else int(forced[step])
            tokens.append(nxt)
            logits_out.append(row)
            if step == steps - 1:
                break
            if not (policy.once and done):  # the cut, over the n cached positions
                kept = policy.textbook_keep(kept, P, scores[:n], group)
                done = True
            history.append(torch.nonzero(kept).flatten())
            kept = torch.cat([kept, torch.ones(1, dtype=torch.bool)])
            scores = torch.cat([scores, torch.zeros(1, dtype=torch.float64)])
            ids = torch.tensor([[nxt]], device=device)
            start = n
    return {"tokens": tokens, "logits": logits_out, "kept": history}


def engine_vs_textbook(model, prompt_ids, policy: EvictionPolicy, max_new_tokens: int = 8, block_size: int = 16,
                       book: dict | None = None) -> dict:
    """Whether the engine and :func:`textbook_eviction` keep the same positions and give the same tokens
    (notebook 07 runs its participant's policies through it)."""
    book = book or textbook_eviction(model, prompt_ids, max_new_tokens, policy, group=block_size)
    blocks = cdiv(len(prompt_ids) + max_new_tokens, block_size) + 1
    eng = LLM(model, None, num_blocks=blocks, block_size=block_size, max_num_seqs=1,
              max_num_batched_tokens=max(len(prompt_ids), 1), eviction=policy, enable_prefix_caching=False)
    seen = []
    bm = eng.block_manager
    eng.on_step = lambda s: seen.extend(kept_positions(bm.logical_blocks(i), bm.kept_tokens(i), block_size) for i in bm.seqs)
    tokens = eng.generate([list(prompt_ids)], SamplingParams(max_tokens=max_new_tokens, ignore_eos=True))[0].token_ids
    kept = len(seen) == len(book["kept"]) and all(a.tolist() == b.tolist() for a, b in zip(seen, book["kept"]))
    return dict(tokens=tokens, same_tokens=tokens == book["tokens"], same_kept=kept, steps=len(seen),
                kept_last=seen[-1].numel() if seen else 0, book=book)
