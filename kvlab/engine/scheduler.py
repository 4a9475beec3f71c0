"""Who runs in the next step, and with how many tokens (notebook 04), by vLLM's rules made explicit.

Each step: running decodes first (preempting the newest by recompute when the pool is dry), then
running prefills a chunk each, then admissions from the queue's front while seats, token budget and
blocks allow. ``policy="static"`` is the baseline: a new batch only when nothing runs. Every decision
goes to ``trace`` as a :class:`TraceEvent`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field

from kvlab.cache.paged import BlockManager
from kvlab.engine.sequence import Sequence, SequenceStatus
from kvlab.validate import check_int, is_int

POLICIES = ("continuous", "static")
ACTIONS = ("admitted", "deferred", "chunked", "preempted", "finished")


@dataclass(frozen=True)
class TraceEvent:
    step: int
    seq_id: int
    action: str  # one of ACTIONS
    reason: str = ""  # "no blocks", "seq limit", "token budget", "eos", "stop", "length", "batch running", ...
    detail: str = ""  # e.g. "cached 32 of 80 prompt tokens" or "64 of 300 tokens"


@dataclass
class SchedulerOutput:
    """What one step runs: sequences and how many new tokens each feeds (decodes: 1, listed first)."""

    step: int
    seqs: list[Sequence]
    num_new_tokens: list[int]
    num_decodes: int = 0  # the first num_decodes entries are decodes, the rest prefill chunks
    blocks_to_copy: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst), before any write

    @property
    def num_prefill_tokens(self) -> int:
        return sum(self.num_new_tokens) - self.num_decodes

    def __len__(self) -> int:
        return len(self.seqs)


def admission_rule(num_running: int, max_num_seqs: int, budget_left: int, blocks_needed: int, blocks_free: int,
                   watermark_blocks: int) -> str | None:
    """The admission rule: the reason the head of the waiting queue must wait, or None to admit it.

    ``blocks_needed`` already excludes the prompt's prefix-cache hits; ``blocks_free`` counts free and
    evictable blocks. The watermark keeps a few blocks free for the running requests' next tokens,
    but a request that would run alone may use the whole pool (or it could never run).
    """
    if budget_left <= 0:
        return "token budget"
    if num_running >= max_num_seqs:
        return "seq limit"
    reserve = watermark_blocks if num_running else 0
    if blocks_needed > blocks_free - reserve:
        return "no blocks"
    return None


def schedule_decodes(running: list[int], decoding: set[int], append, preempt) -> list[int]:
    """Decodes first, preempting from the tail (notebook 04, Task 2): the ids that decode this step.

    ``running``: the running sequences' ids, oldest admission first; ``decoding``: those that sampled a
    token last step and need a slot for it (the rest are still prefilling). ``append(id)`` reserves the
    slot for that token and returns True, or returns False when the pool has no room (nothing changes).
    ``preempt(id)`` frees a sequence's blocks, sends it back to the front of the queue and removes it
    from ``running``. When a decode finds no room, the most recently admitted running sequence is
    preempted, until there is room or the decode has preempted itself.
    """
    out = []
    for sid in list(running):
        if sid not in running or sid not in decoding:  # preempted already, or still prefilling
            continue
        while not append(sid):
            victim = running[-1]  # the most recently admitted
            preempt(victim)
            if victim == sid:
                break
        if sid in running:
            out.append(sid)
    return out


def chunk_prefills(uncomputed: list[int], budget: int) -> list[int]:
    """Chunked prefill (notebook 04, Task 3): the prompt tokens each prefill feeds this step.

    ``uncomputed``: the prompt tokens each prefilling sequence still needs, in order; ``budget``: the
    tokens this step has left. Each takes what it needs while the budget lasts; the one that meets the
    end of the budget gets a chunk, the rest of its prompt follows in later steps.
    """
    out = []
    for n in uncomputed:
        out.append(min(n, budget))
        budget -= out[-1]
    return out


class Scheduler:
    def __init__(self, block_manager: BlockManager, max_num_seqs: int = 64, max_num_batched_tokens: int = 512,
                 policy: str = "continuous", watermark: float = 0.01, admission_rule=admission_rule,
                 schedule_decodes=schedule_decodes, chunk_prefills=chunk_prefills):
        """The three rules of a step are functions, so notebook 04 can plug the participant's in."""
        for name, fn in (("admission_rule", admission_rule), ("schedule_decodes", schedule_decodes),
                         ("chunk_prefills", chunk_prefills)):
            if not callable(fn):
                raise TypeError(f"{name} must be a function, got {type(fn).__name__}")
        for name, v in (("max_num_seqs", max_num_seqs), ("max_num_batched_tokens", max_num_batched_tokens)):
            check_int(name, v)
        if max_num_batched_tokens < max_num_seqs:
            raise ValueError(f"max_num_batched_tokens ({max_num_batched_tokens}) must be >= max_num_seqs "
                             f"({max_num_seqs}): every running sequence needs one token of budget per decode step")
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if isinstance(watermark, bool) or not isinstance(watermark, (int, float)) or not 0 <= watermark < 1:
            raise ValueError(f"watermark must be a fraction of the pool in [0, 1), got {watermark!r}")
        self.bm = block_manager
        self.admission_rule = admission_rule  # swappable: notebook 04's tasks plug in the participant's
        self.schedule_decodes, self.chunk_prefills = schedule_decodes, chunk_prefills
        self.max_num_seqs, self.max_num_batched_tokens = max_num_seqs, max_num_batched_tokens
        self.policy = policy
        self.watermark_blocks = int(watermark * block_manager.num_blocks)
        self.waiting: deque[Sequence] = deque()
        self.running: list[Sequence] = []  # in admission order: the tail is preempted first
        self.trace: list[TraceEvent] = []
        self.step_count = 0
        self.num_preemptions = 0

    # ---- queues ----------------------------------------------------------------------------------

    def add(self, seq: Sequence) -> None:
        self.waiting.append(seq)

    def has_unfinished(self) -> bool:
        return bool(self.waiting or self.running)

    def _log(self, seq: Sequence, action: str, reason: str = "", detail: str = "") -> None:
        self.trace.append(TraceEvent(self.step_count, seq.seq_id, action, reason, detail))

    # ---- the rules -------------------------------------------------------------------------------

    def admission_blocker(self, seq: Sequence, budget: int, batch_open: bool = True) -> str | None:
        """Why the head of the queue cannot be admitted now, or None. A static batch ignores the token
        budget (its prompts are prefilled in chunks) and waits while one runs (``batch_open`` False)."""
        if self.policy == "static":
            if not batch_open:
                return "batch running"
            budget = self.max_num_batched_tokens
        needed, available = self.bm.allocation_cost(seq.token_ids)
        return self.admission_rule(len(self.running), self.max_num_seqs, budget, needed, available,
                                   self.watermark_blocks)

    def preempt(self, seq: Sequence, reason: str = "no blocks", keep_cached: bool = True) -> None:
        """Preemption by recompute: free the blocks, back to the FRONT of the queue, outputs kept."""
        self.running.remove(seq)
        self.bm.free(seq.seq_id, keep_cached=keep_cached)
        seq.status = SequenceStatus.PREEMPTED
        seq.num_computed_tokens = 0
        seq.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.appendleft(seq)
        self._log(seq, "preempted", reason, f"{seq.num_tokens} tokens to recompute")

    def schedule(self) -> SchedulerOutput:
        self.step_count += 1
        budget = self.max_num_batched_tokens
        seqs, counts = [], []
        # 1. decodes: one slot each for the token sampled last step; preempt from the tail when dry
        by_id = {seq.seq_id: seq for seq in self.running}
        decoding = {sid for sid, seq in by_id.items() if self.bm.num_tokens(sid) != seq.num_tokens}
        ids = [seq.seq_id for seq in self.running]

        def preempt(sid):
            if sid not in ids:
                raise ValueError(f"schedule_decodes preempted sequence {sid!r}, which is not running")
            self.preempt(by_id[sid])
            ids.remove(sid)

        appended = []

        def append(sid):
            if sid not in ids or sid not in decoding or sid in appended:
                raise ValueError(f"schedule_decodes appended to sequence {sid!r}: only a running, decoding sequence, "
                                 "once a step")
            if not self.bm.can_append(sid):
                return False
            self.bm.append_slot(sid, by_id[sid].token_ids[-1])
            appended.append(sid)
            return True

        chosen = self.schedule_decodes(ids, set(decoding), append, preempt)
        left = [sid for sid in ids if sid in decoding]
        if not isinstance(chosen, (list, tuple)) or list(chosen) != left or appended != left:
            raise ValueError(f"schedule_decodes returned {chosen!r} after appending {appended}: every decoding sequence "
                             f"still running, in order ({left}), must get its slot and decode")
        for sid in chosen:
            seqs.append(by_id[sid])
            counts.append(1)
            budget -= 1
        num_decodes = len(seqs)
        # 2. running prefills continue, a chunk each
        prefilling = [seq for seq in self.running if seq.seq_id not in decoding]
        for seq, n in zip(prefilling, self._chunks(prefilling, budget)):
            budget = self._schedule_prefill(seq, n, budget, seqs, counts)
        # 3. admissions from the front of the queue
        batch_open = not self.running
        while self.waiting:
            seq = self.waiting[0]
            blocker = self.admission_blocker(seq, budget, batch_open)
            if blocker is not None:
                self._log(seq, "deferred", blocker)
                break
            self.waiting.popleft()
            cached = self.bm.allocate(seq.seq_id, seq.token_ids, register=False)
            seq.status = SequenceStatus.RUNNING
            seq.num_computed_tokens = cached
            seq.metrics.cached_prompt_tokens = cached
            self.running.append(seq)
            self._log(seq, "admitted", detail=f"cached {cached} of {seq.num_tokens} prompt tokens")
            budget = self._schedule_prefill(seq, self._chunks([seq], budget)[0], budget, seqs, counts)
        return SchedulerOutput(self.step_count, seqs, counts, num_decodes, self.bm.take_blocks_to_copy())

    def _chunks(self, prefilling: list[Sequence], budget: int) -> list[int]:
        """The prefill chunks ``chunk_prefills`` gives, held to the step's budget and each prompt's need."""
        need = [seq.num_uncomputed for seq in prefilling]
        if not need:
            return []
        got = self.chunk_prefills(list(need), max(budget, 0))
        if (not isinstance(got, (list, tuple)) or len(got) != len(need) or not all(is_int(n) for n in got)
                or any(not 0 <= n <= m for n, m in zip(got, need)) or sum(got) > max(budget, 0)):
            raise ValueError(f"chunk_prefills({need}, {budget}) returned {got!r}: one chunk per prefill, each in "
                             f"[0, what it needs], together at most the budget")
        return list(got)

    def _schedule_prefill(self, seq: Sequence, n: int, budget: int, seqs: list, counts: list) -> int:
        if n <= 0:
            self._log(seq, "deferred", "token budget", f"{seq.num_uncomputed} prompt tokens left")
            return budget
        if n < seq.num_uncomputed:
            self._log(seq, "chunked", "token budget",
                      f"tokens {seq.num_computed_tokens}..{seq.num_computed_tokens + n} of {seq.num_tokens}")
        seqs.append(seq)
        counts.append(n)
        # full blocks this forward fills may be shared from now on: the forward writes every new
        # token's K/V before any attention reads, so a request admitted in this same step can hit them
        self.bm.mark_computed(seq.seq_id, seq.num_computed_tokens + n)
        return budget - n

    def abort(self, seq: Sequence) -> None:
        """Drop a request wherever it is; a running one's hashes are forgotten (may be half-written)."""
        if seq in self.running:
            self.running.remove(seq)
            if seq.seq_id in self.bm.seqs:
                self.bm.free(seq.seq_id, keep_cached=False)
        elif seq in self.waiting:
            self.waiting.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = "aborted"
        self._log(seq, "finished", "aborted", f"{len(seq.output_token_ids)} tokens")

    # ---- after the forward -----------------------------------------------------------------------

    def finish(self, seq: Sequence, reason: str) -> None:
        """Free a sequence's blocks in the step it finishes."""
        self.bm.free(seq.seq_id)
        self.running.remove(seq)
        seq.status = SequenceStatus.FINISHED
        seq.finish_reason = reason
        self._log(seq, "finished", reason, f"{len(seq.output_token_ids)} tokens")
