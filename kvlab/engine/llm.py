"""The engine's front door (notebook 04): ``LLM(model, tokenizer, ...).generate(prompts, params)``.

One :meth:`LLM.step` = schedule -> one packed forward through the paged pool -> sample -> finish
and free. :meth:`LLM.iter_steps` yields after every step, so a notebook can draw the engine as it runs.
"""

from __future__ import annotations

import itertools
import signal
import threading
import time
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from kvlab.cache import BlockManager, PagedKVCache, QuantizedPagedKVCache
from kvlab.cache.evict import (AttentionMass, EvictionPolicy, EvictionState, add_cached_rows, after_forward, keep_rows,
                               watch_from)
from kvlab.cache.paged import check_token_ids
from kvlab.calibrate import default_calibration
from kvlab.engine.metrics import StepStats, summarize
from kvlab.engine.model_runner import ModelRunner
from kvlab.engine.sampler import sample
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.scheduler import Scheduler
from kvlab.engine.sequence import Sequence
from kvlab.formats import engine_kv_cache_dtypes as kv_cache_dtypes  # what kv_cache_dtype= takes
from kvlab.probe import paged_attention_spec
from kvlab.quant import KVQuantConfig, named_config
from kvlab.validate import is_int


@contextmanager
def hold_interrupts():
    """Hold Ctrl-C (Jupyter's stop button) during bookkeeping and raise it right after, so the block
    manager and the queues are never left half-updated. A no-op outside the main thread."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    caught = []
    try:
        previous = signal.signal(signal.SIGINT, lambda signum, frame: caught.append(frame))
    except (ValueError, OSError):  # e.g. an embedded interpreter that owns the signals
        yield
        return
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        if caught:
            if callable(previous):
                previous(signal.SIGINT, caught[0])
            elif previous != signal.SIG_IGN:
                raise KeyboardInterrupt


@dataclass
class RequestOutput:
    """What a request has produced so far; a request is one sequence, ``request_id`` its ``seq_id``."""

    request_id: int
    prompt_token_ids: list[int]
    token_ids: list[int]  # generated so far
    text: str | None
    finished: bool
    finish_reason: str | None
    metrics: dict
    logits: list | None = None  # one (V,) tensor per output token, when SamplingParams(return_logits=True)


def make_cache(model, tokenizer, num_blocks, block_size, kv_cache_dtype, quant_config, calibration, model_name):
    if quant_config is None and kv_cache_dtype == "auto":
        return PagedKVCache.from_model(model, num_blocks, block_size)
    if quant_config is not None and not isinstance(quant_config, KVQuantConfig):
        raise TypeError(f"quant_config must be a KVQuantConfig (e.g. kvlab.quant.named_config('int8')) or None, got "
                        f"{type(quant_config).__name__} {quant_config!r}; for a named format use kv_cache_dtype=...")
    if quant_config is None:
        if not isinstance(kv_cache_dtype, str) or kv_cache_dtype not in kv_cache_dtypes():
            raise ValueError(f"kv_cache_dtype must be one of {kv_cache_dtypes()}, got {kv_cache_dtype!r}")
        quant_config = named_config(kv_cache_dtype)
    if calibration is None and quant_config.needs_calibration(model.config.num_hidden_layers):
        if tokenizer is None or not hasattr(tokenizer, "get_vocab"):
            raise ValueError(f"kv_cache_dtype {kv_cache_dtype!r} with static scales needs calibration=... (a kvlab "
                             "Calibration) or a real tokenizer to calibrate the default text")
        calibration = default_calibration(model, tokenizer, model_name, progress=False)
    return QuantizedPagedKVCache.from_model(model, num_blocks, block_size, quant_config, calibration)


class LLM:
    """A continuous-batching engine over a paged (optionally quantized) KV pool, knobs in vLLM's names.

    ``attn_backend`` picks what runs the write and the decodes (:mod:`kvlab.attention` has the table);
    ``kv_cache_dtype`` other than "auto" is a quantized pool; pass ``block_manager`` and ``cache`` to
    share a pool across engines. ``eviction`` keeps each sequence within a token budget (notebook 07);
    ``host_blocks`` keeps blocks the LRU gives away for later prefix hits (float pools only). A model
    whose attention the paged path cannot run is refused before any pool exists.
    """

    def __init__(self, model, tokenizer=None, *, num_blocks: int = 256, block_size: int = 16,
                 max_num_seqs: int = 32, max_num_batched_tokens: int = 512, policy: str = "continuous",
                 attn_backend: str = "torch", kv_cache_dtype: str = "auto", quant_config=None, calibration=None,
                 model_name: str = "smollm2-135m", enable_prefix_caching: bool = True, watermark: float = 0.01,
                 eos_token_id: int | None = None, block_manager: BlockManager | None = None, cache=None,
                 prepack_weights: bool = True, eviction: EvictionPolicy | None = None, host_blocks: int = 0,
                 admission_rule=None, schedule_decodes=None, chunk_prefills=None):
        self.model, self.tokenizer = model, tokenizer
        layers = paged_attention_spec(model)  # a model the paged attention cannot run is refused before any pool
        self._positional = any(a.sliding_window is not None or a.softcap is not None or a.sinks for a in layers)
        if eviction is not None:
            if not isinstance(eviction, EvictionPolicy):
                raise TypeError(f"eviction must be a kvlab.cache.evict policy (SlidingWindow, SinksWindow, HeavyHitters, "
                                f"PromptSelect) or None, got {type(eviction).__name__} {eviction!r}")
            self._check_eviction(eviction, block_manager.block_size if block_manager is not None else block_size)
        if eos_token_id is not None and not is_int(eos_token_id):
            raise TypeError(f"eos_token_id must be an int token id or None, got {type(eos_token_id).__name__} "
                            f"{eos_token_id!r}")
        if host_blocks and (kv_cache_dtype != "auto" or quant_config is not None):  # before any pool is built
            raise ValueError(f"host_blocks={host_blocks!r}: the host tier runs on float pools (kv_cache_dtype 'auto'), "
                             f"not with kv_cache_dtype={kv_cache_dtype!r}")
        if block_manager is None:
            block_manager = BlockManager(num_blocks, block_size, enable_prefix_caching=enable_prefix_caching,
                                         host_blocks=host_blocks)
        if cache is None:
            cache = make_cache(model, tokenizer, block_manager.num_blocks, block_manager.block_size, kv_cache_dtype,
                                quant_config, calibration, model_name)
        if (cache.num_blocks, cache.block_size) != (block_manager.num_blocks, block_manager.block_size):
            raise ValueError("cache and block_manager disagree on num_blocks / block_size")
        if block_manager.host_blocks:
            if not hasattr(cache, "attach_host"):
                raise ValueError(f"host_blocks={block_manager.host_blocks}: the host tier runs on float pools "
                                 f"(kv_cache_dtype 'auto'), not on {type(cache).__name__}")
            cache.attach_host(block_manager.host_blocks)
        self.block_manager, self.cache = block_manager, cache
        self.eviction = eviction
        self._evict_states: dict[int, EvictionState] = {}
        # once a scoring policy is served with prefix caching: each computed prompt block's query rows
        # (their attention, summed over heads and layers), by block hash, for the requests that hit it
        self._record_rows = eviction is not None and eviction.needs_scores
        self._prompt_rows: dict[bytes, torch.Tensor] = {}
        self._partial_rows: dict[int, tuple] = {}  # seq id -> (block, its rows so far): a chunk ended inside it
        windows = [a.sliding_window for a in layers]  # every layer slides: the stats count blocks out of every window
        block_manager.sliding_window = max(windows) if None not in windows else None
        rules = {n: f for n, f in (("admission_rule", admission_rule), ("schedule_decodes", schedule_decodes),
                                   ("chunk_prefills", chunk_prefills)) if f is not None}  # notebook 04's tasks
        self.scheduler = Scheduler(block_manager, max_num_seqs, max_num_batched_tokens, policy, watermark, **rules)
        self.runner = ModelRunner(model, cache, attn_backend, prepack=prepack_weights)
        if eos_token_id is None:
            eos_token_id = getattr(tokenizer, "eos_token_id", None)
        self.eos_token_id = eos_token_id
        self.max_model_len = getattr(model.config, "max_position_embeddings", None) or 2**31
        self.vocab_size = model.config.vocab_size
        first = max(list(block_manager.seqs) + list(block_manager.finished), default=-1) + 1
        self._ids = itertools.count(first)
        self.seqs: dict[int, Sequence] = {}
        self.step_stats: list[StepStats] = []
        self.on_scheduled = None  # optional callback(SchedulerOutput), run between scheduling and the forward
        self.on_step = None  # optional callback(StepStats), run when a step is done (widgets redraw)

    # ---- requests --------------------------------------------------------------------------------

    def _check_eviction(self, policy: EvictionPolicy, block_size: int) -> None:
        policy.budget_blocks(block_size)
        if self._positional:
            raise ValueError("eviction cannot be combined with a model whose attention slides, soft-caps or has "
                             "sinks: its masks count positions, and an evicted cache has gaps")

    def _policy(self, params: SamplingParams) -> EvictionPolicy | None:
        return params.eviction if params.eviction is not None else self.eviction

    def _encode(self, prompt) -> list[int]:
        if isinstance(prompt, str):
            if not prompt.strip():
                raise ValueError("prompt must not be empty or blank")
            if self.tokenizer is None:
                raise ValueError("a text prompt needs a tokenizer: pass LLM(model, tokenizer) or token ids")
            return list(self.tokenizer.encode(prompt))
        if isinstance(prompt, torch.Tensor):
            prompt = prompt.flatten().tolist()
        if not isinstance(prompt, (list, tuple)):
            raise ValueError(f"prompt must be a string or a list of token ids, got {type(prompt).__name__}")
        if not prompt:
            raise ValueError("prompt must not be empty: it needs at least one token")
        return check_token_ids(prompt, "prompt token ids", self.vocab_size)

    def _check(self, prompt, sampling_params) -> tuple[list[int], SamplingParams]:
        params = SamplingParams() if sampling_params is None else sampling_params
        if not isinstance(params, SamplingParams):
            raise ValueError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        ids = self._encode(prompt)
        if params.forced_token_ids:
            check_token_ids(params.forced_token_ids, "forced_token_ids", self.vocab_size)
        if len(ids) >= self.max_model_len:
            raise ValueError(f"prompt of {len(ids)} tokens does not fit the model's context of {self.max_model_len}")
        bm = self.block_manager
        worst = bm.blocks_needed(min(len(ids) + params.max_tokens, self.max_model_len))
        policy = self._policy(params)
        if params.eviction is not None:
            self._check_eviction(params.eviction, bm.block_size)
        if policy is not None:
            worst = min(worst, policy.max_blocks(len(ids), params.max_tokens, bm.block_size))
        if worst > bm.num_blocks:  # alone in the pool it could never finish: refuse it now
            raise ValueError(f"prompt of {len(ids)} tokens + max_tokens={params.max_tokens} needs {worst} blocks of "
                             f"{bm.block_size} tokens; the whole pool has {bm.num_blocks}")
        return ids, params

    def add_request(self, prompt, sampling_params: SamplingParams | None = None, arrival: float | None = None) -> int:
        """Queue one request; bad input raises ValueError and changes nothing, so the others keep running."""
        return self._enqueue(*self._check(prompt, sampling_params), arrival)

    def _enqueue(self, ids: list[int], params: SamplingParams, arrival: float | None = None) -> int:
        if params.eviction is not None and params.eviction.needs_scores:
            self._record_rows = True
        seq = Sequence(next(self._ids), ids, params, time.perf_counter() if arrival is None else arrival,
                       self.scheduler.step_count)
        self.seqs[seq.seq_id] = seq
        self.scheduler.add(seq)
        return seq.seq_id

    def has_unfinished(self) -> bool:
        return self.scheduler.has_unfinished()

    # ---- one step --------------------------------------------------------------------------------

    def _stop_reason(self, seq: Sequence, token: int) -> str | None:
        p = seq.params
        if not p.ignore_eos and self.eos_token_id is not None and token == self.eos_token_id:
            return "eos"
        if token in p.stop_token_ids:
            return "stop"
        if len(seq.output_token_ids) >= p.max_tokens or seq.num_tokens >= self.max_model_len:
            return "length"
        return None

    def step(self) -> list[RequestOutput]:
        """One step; an output for every request that produced a token.

        All or nothing: if the forward fails or is interrupted, the running requests are preempted (their
        hashes forgotten, the blocks may be half-written), the write counters are put back, and the
        exception propagates; the next ``step()`` recomputes them.
        """
        sched, bm = self.scheduler, self.block_manager
        # write counters to put back if the step is cut short (~0.3 ms for 30 layers, before the clock starts)
        saved = self.cache.counters_snapshot()
        t0 = time.perf_counter()
        preempted_before = sched.num_preemptions
        try:
            with hold_interrupts():  # a Ctrl-C held here is raised after schedule() and rolled back below
                batch = sched.schedule()
            t1 = time.perf_counter()
            if not batch.seqs:
                if sched.running or sched.waiting:
                    raise RuntimeError("the scheduler found nothing to run although requests are pending")
                return []
            for seq in batch.seqs:
                if seq.metrics.first_scheduled is None:
                    seq.metrics.first_scheduled = t1
            if self.on_scheduled is not None:
                self.on_scheduled(batch)
            observer = self._observer(batch)
            logits, rows = self.runner.execute_model(batch, bm, observer=observer)
            t2 = time.perf_counter()
            with hold_interrupts():
                sampled = sample(logits, [batch.seqs[i] for i in rows]) if rows else []
        except BaseException as e:  # leave no half-written state: the running requests start over
            with hold_interrupts():
                self._abort_step(saved, "interrupted" if isinstance(e, KeyboardInterrupt) else "step failed")
            raise
        t3 = time.perf_counter()
        with hold_interrupts():
            outputs, finished = self._commit(batch, rows, sampled, t3, logits, observer)
            t4 = time.perf_counter()
            self.step_stats.append(StepStats(
                step=batch.step, running=len(sched.running) + finished, waiting=len(sched.waiting),
                scheduled=len(batch), prefill_tokens=batch.num_prefill_tokens, decode_tokens=batch.num_decodes,
                blocks_used=bm.num_blocks - bm.num_free_blocks, blocks_free=bm.num_free_blocks,
                preempted=sched.num_preemptions - preempted_before, finished=finished,
                schedule_s=(t1 - t0) + (t4 - t3), packing_s=self.runner.timings["packing"],
                forward_s=self.runner.timings["forward"], sample_s=t3 - t2))
        if self.on_step is not None:
            self.on_step(self.step_stats[-1])
        return outputs

    def _commit(self, batch, rows, sampled, now, logits, observer) -> tuple[list[RequestOutput], int]:
        """After a good forward: K/V count as computed, policies evict, tokens are appended, finished free."""
        for seq, n in zip(batch.seqs, batch.num_new_tokens):  # their K/V are in the pool now
            seq.num_computed_tokens += n
        try:
            self._prompt_rows = keep_rows(self._prompt_rows, self._partial_rows, batch, observer, self.block_manager)
            self._evict(batch, observer)
        finally:  # a plugged-in policy that raises still leaves every sampled token committed
            outputs, finished = self._append(batch, rows, sampled, now, logits)
        return outputs, finished

    def _append(self, batch, rows, sampled, now, logits) -> tuple[list[RequestOutput], int]:
        outputs, finished = [], 0
        for k, (i, token) in enumerate(zip(rows, sampled)):
            seq = batch.seqs[i]
            if seq.params.return_logits:
                seq.logits.append(logits[k].float().clone())
            seq.append_token(token)
            seq.metrics.token_times.append(now)
            if seq.metrics.first_token is None:
                seq.metrics.first_token = now
            reason = self._stop_reason(seq, token)
            if reason is not None:
                m, bm = seq.metrics, self.block_manager
                m.held_blocks, m.held_tokens = len(bm.block_table(seq.seq_id)), bm.kept_tokens(seq.seq_id)
                self._evict_states.pop(seq.seq_id, None)
                self.scheduler.finish(seq, reason)
                seq.metrics.finished = now
                finished += 1
            outputs.append(self._output(seq))
        return outputs, finished

    # ---- eviction (kvlab.cache.evict) ------------------------------------------------------------

    def _state(self, seq: Sequence) -> EvictionState:
        blocks = self.block_manager.seqs[seq.seq_id]
        state = self._evict_states.get(seq.seq_id)
        if state is None or state.owner is not blocks:  # new, or readmitted after a preemption: start over
            state = self._evict_states[seq.seq_id] = EvictionState(blocks)
        return state

    def eviction_scores(self, seq_id: int) -> torch.Tensor | None:
        """A running sequence's attention scores per logical position (a scoring policy), or None."""
        state, blocks = self._evict_states.get(seq_id), self.block_manager.seqs.get(seq_id)
        return None if state is None or state.owner is not blocks or not len(state.scores) else state.scores

    def _observer(self, batch) -> AttentionMass | None:
        """For policies that score blocks: which sequences' attention to watch in this forward."""
        watch, record = {}, []
        bm = self.block_manager
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            blocks = bm.seqs.get(seq.seq_id)
            start = seq.num_computed_tokens
            if (self._record_rows and bm.enable_prefix_caching and blocks is not None and blocks.logical is None
                    and start < len(seq.prompt_token_ids)):
                record.append(i)  # prompt rows computed here: kept by block for the requests that hit it
            policy = self._policy(seq.params)
            if policy is None or not policy.needs_scores:
                continue
            end = seq.num_computed_tokens + n
            from_pos = watch_from(policy, self._state(seq), len(seq.prompt_token_ids), end)
            if from_pos is not None:
                watch[i] = (end, from_pos)
        return AttentionMass(watch, record) if watch or record else None

    def _evict(self, batch, observer: AttentionMass | None) -> None:
        """Each running sequence through its policy; blocks go only once its prompt is computed."""
        bm = self.block_manager
        for i, seq in enumerate(batch.seqs):
            policy = self._policy(seq.params)
            if policy is None or seq.seq_id not in bm.seqs:
                continue
            mass, state = observer.mass.get(i) if observer is not None else None, self._state(seq)
            if not state.hits_scored:  # after keep_rows: hits on blocks computed in this very step too
                add_cached_rows(state, self._prompt_rows, policy, bm.seqs[seq.seq_id], len(seq.prompt_token_ids),
                                bm.block_size)
                state.hits_scored = True
            after_forward(policy, bm, seq.seq_id, state, len(seq.prompt_token_ids), seq.num_computed_tokens, mass)

    def _abort_step(self, saved_counters, reason: str) -> None:
        self.block_manager.drop_pending_transfers()  # copies the failed step may not have made
        for seq in reversed(list(self.scheduler.running)):
            self.scheduler.preempt(seq, reason, keep_cached=False)
        self.cache.restore_counters(saved_counters)

    def abort_request(self, request_id: int) -> None:
        """Drop an unfinished request and free its blocks (finish_reason "aborted"); finished ones stay."""
        seq = self.seqs.get(request_id)
        if seq is None:
            raise ValueError(f"request_id {request_id!r} is not a request of this engine")
        if seq.is_finished:
            return
        with hold_interrupts():
            self.scheduler.abort(seq)
            self._evict_states.pop(request_id, None)

    def _output(self, seq: Sequence) -> RequestOutput:
        text = None
        if self.tokenizer is not None and seq.is_finished:
            text = self.tokenizer.decode(seq.output_token_ids, skip_special_tokens=True)
        return RequestOutput(seq.seq_id, seq.prompt_token_ids, list(seq.output_token_ids), text, seq.is_finished,
                             seq.finish_reason, seq.metrics.as_dict(len(seq.output_token_ids)),
                             list(seq.logits) if seq.params.return_logits else None)

    def iter_steps(self):
        """Run until every queued request finished, yielding ``(StepStats, outputs)`` after each step."""
        while self.has_unfinished():
            outputs = self.step()
            yield self.step_stats[-1], outputs

    # ---- whole runs ------------------------------------------------------------------------------

    def generate(self, prompts, sampling_params=None, progress: bool = False) -> list[RequestOutput]:
        """Serve ``prompts`` concurrently, outputs in prompt order; all are validated before any is queued."""
        if isinstance(prompts, str) or (isinstance(prompts, (list, tuple)) and prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)) or not prompts:
            raise ValueError("prompts must be a non-empty list of strings or token-id lists")
        params = sampling_params if isinstance(sampling_params, (list, tuple)) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"got {len(params)} sampling_params for {len(prompts)} prompts")
        ids = self.add_requests(prompts, params)
        bar = None
        if progress:
            from tqdm.auto import tqdm  # tqdm loads only when a progress bar is asked for

            bar = tqdm(total=len(ids), desc="requests", unit="req")
        try:
            while self.has_unfinished():
                done = sum(o.finished for o in self.step())
                if bar is not None:
                    bar.update(done)
        except BaseException:  # interrupted: these requests are dropped, the engine stays ready for more
            for i in ids:
                self.abort_request(i)
            raise
        finally:
            if bar is not None:
                bar.close()
        return [self._output(self.seqs[i]) for i in ids]

    def add_requests(self, prompts, params) -> list[int]:
        """Queue several requests (one SamplingParams each); all are validated before any is queued."""
        checked = [self._check(p, sp) for p, sp in zip(prompts, params)]  # all or nothing
        return [self._enqueue(ids, sp) for ids, sp in checked]

    def summary(self, request_ids=None) -> dict:
        """Throughput, latency percentiles and the step-time split of the finished requests."""
        seqs = [self.seqs[i] for i in (request_ids if request_ids is not None else self.seqs)]
        done = [s for s in seqs if s.is_finished and s.finish_reason != "aborted"]
        if not done:
            return summarize([], self.step_stats, 0.0)
        wall = max(s.metrics.finished for s in done) - min(s.metrics.arrival for s in done)
        return summarize([s.metrics.as_dict(len(s.output_token_ids)) for s in done], self.step_stats, wall)

    @property
    def trace(self):
        return self.scheduler.trace
