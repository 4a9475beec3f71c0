"""Eviction policies: which blocks a sequence keeps when its cache must stay within a budget (notebook 07).

A policy names whole logical blocks to drop once the prompt is computed; **kept tokens keep their
original positions** (keys are stored after RoPE; new tokens count on from the true length, as H2O and
SnapKV do). Scores are **summed over heads and layers**, since one paged block holds them all (the papers
choose per head). ``textbook_keep`` is the same rule over a dense mask; tests/test_07_evict.py holds the
engine to it.

| policy | keeps | scored by |
|---|---|---|
| :class:`SlidingWindow` | the last ``budget`` tokens' blocks | nothing |
| :class:`SinksWindow` (StreamingLLM) | the first ``sinks`` tokens' blocks + the most recent | nothing |
| :class:`HeavyHitters` (H2O) | the recent half + the blocks most attended so far | attention received, summed |
| :class:`PromptSelect` (SnapKV) | the prompt's last ``window`` + its blocks those queries attend most | once, at prompt end |
"""

from __future__ import annotations

import math

import torch

from kvlab.cache.mass import AttentionMass
from kvlab.validate import check_int, is_int

__all__ = ["EvictionPolicy", "SlidingWindow", "SinksWindow", "HeavyHitters", "PromptSelect", "POLICIES",
           "make_policy", "AttentionMass", "EvictionState", "kept_positions", "watch_from", "after_forward"]


class EvictionPolicy:
    """A budget in tokens and a rule for which blocks to keep, over block indices and over a dense mask."""

    name = "policy"
    #: the rule reads attention scores (the engine then observes each step's attention)
    needs_scores = False
    #: the rule acts once, at the end of the prompt (SnapKV), not at every step
    once = False

    def __init__(self, budget: int):
        self.budget = check_int("budget", budget)

    def budget_blocks(self, block_size: int) -> int:
        """The blocks a sequence may keep: ``budget // block_size``, at least :meth:`min_blocks`."""
        b = self.budget // block_size
        if b < self.min_blocks(block_size):
            raise ValueError(f"budget={self.budget} tokens is {b} blocks of {block_size}; {self.name} needs at least "
                             f"{self.min_blocks(block_size)} ({self.min_blocks(block_size) * block_size} tokens)")
        return b

    def min_blocks(self, block_size: int) -> int:
        return 1

    def observe_from(self, prompt_len: int) -> int | None:
        """The first query position whose attention counts towards the scores; None: no scores needed."""
        return None

    def max_blocks(self, prompt_len: int, max_tokens: int, block_size: int) -> int:
        """The most blocks a request holds at once: its whole prompt (prefilled before the cut), or the
        budget plus the block being written."""
        return max(math.ceil(prompt_len / block_size), self.budget_blocks(block_size) + 1)

    # ---- the block rule (the engine) --------------------------------------------------------------

    def choose(self, logical: list[int], num_tokens: int, prompt_len: int, block_size: int,
               scores: torch.Tensor | None = None) -> list[int]:
        """The logical blocks to drop now, of the kept ones in ``logical``; the last (being written) stays."""
        budget = self.budget_blocks(block_size)
        if len(logical) <= budget:
            return []
        keep = set(self.choose_keep(logical, budget, num_tokens, prompt_len, block_size, scores))
        keep.add(logical[-1])
        return [lb for lb in logical if lb not in keep]

    def choose_keep(self, logical, budget, num_tokens, prompt_len, block_size, scores) -> list[int]:
        raise NotImplementedError

    # ---- the textbook rule (a dense mask) ---------------------------------------------------------

    def textbook_keep(self, kept: torch.Tensor, prompt_len: int, scores: torch.Tensor | None,
                      group: int = 1) -> torch.Tensor:
        """``kept`` (n,) bool, positions still cached -> (n,) kept after this step (groups of ``group``)."""
        raise NotImplementedError

    def __repr__(self) -> str:
        args = ", ".join(f"{k}={v!r}" for k, v in vars(self).items() if not (k == "keep" and v is None))
        return f"{type(self).__name__}({args})"


def _groups(n: int, group: int) -> torch.Tensor:
    """(n,) the group index of each position."""
    return torch.arange(n) // group


def _group_sum(x: torch.Tensor, group: int) -> torch.Tensor:
    """(n,) per position -> (ceil(n / group),) per group."""
    n = x.shape[0]
    return torch.zeros(math.ceil(n / group), dtype=x.dtype).index_add_(0, _groups(n, group), x)


def _block_scores(scores: torch.Tensor, logical, block_size: int) -> dict[int, float]:
    return {lb: float(scores[lb * block_size:(lb + 1) * block_size].sum()) for lb in logical}


def _top(candidates, k: int, score: dict[int, float]) -> list[int]:
    """The ``k`` candidates with the highest score; ties go to the earlier block."""
    return sorted(candidates, key=lambda lb: (-score[lb], lb))[:max(0, k)]


def _textbook_top(cands: torch.Tensor, k: int, gscore: torch.Tensor) -> torch.Tensor:
    """The ``k`` groups among ``cands`` (ascending) with the highest score; ties to the earlier group."""
    order = torch.sort(-gscore[cands], stable=True).indices
    return cands[order[:max(0, k)]]


def sinks_window_blocks(num_tokens: int, block_size: int, budget: int, sinks: int) -> list[int]:
    """The logical blocks sinks + window holds once a sequence has ``num_tokens`` tokens, the policy acting
    after every token (notebook 07, Task 1): every block holding one of the first ``sinks`` tokens, then
    the newest blocks, ``budget // block_size`` blocks in all; nothing goes while they all fit."""
    n = -(-num_tokens // block_size)  # blocks the sequence has grown
    b, s = budget // block_size, -(-sinks // block_size)
    if n <= b:
        return list(range(n))
    return list(range(s)) + list(range(n - (b - s), n))


def h2o_keep(logical: list[int], budget: int, recent: int, scores: dict) -> list[int]:
    """H2O's choice (notebook 07, Task 2): of a sequence's kept blocks (``logical``, oldest first), keep the
    ``recent`` newest whatever their scores, and fill the rest of the ``budget`` blocks with the older
    blocks that received the most attention (``scores[block]``); ties go to the earlier block."""
    newest, older = logical[-recent:], logical[:-recent]
    heavy = sorted(older, key=lambda b: (-scores[b], b))[:max(0, budget - recent)]
    return sorted(newest + heavy)


def _plugged(keep):
    if keep is not None and not callable(keep):
        raise TypeError(f"keep must be a function (or None for kvlab's own), got {type(keep).__name__}")
    return keep


def _checked_keep(name: str, kept, logical, budget: int) -> list[int]:
    """A plugged-in choice must name this sequence's kept blocks, at most the budget."""
    if not isinstance(kept, (list, tuple)) or not all(is_int(b) for b in kept) or not set(kept) <= set(logical) \
            or len(set(kept)) > budget:
        raise ValueError(f"{name} returned {kept!r}: a list of at most {budget} of the sequence's blocks {list(logical)}")
    return list(kept)


class SlidingWindow(EvictionPolicy):
    """Keep the last ``budget`` tokens (in whole blocks): the most recent blocks only."""

    name = "window"

    def choose_keep(self, logical, budget, num_tokens, prompt_len, block_size, scores):
        return logical[-budget:]

    def textbook_keep(self, kept, prompt_len, scores, group=1):
        n = kept.shape[0]
        return kept & (_groups(n, group) > (n - 1) // group - self.budget // group)


class SinksWindow(EvictionPolicy):
    """StreamingLLM: the first ``sinks`` tokens (which soak up attention whatever they say) plus the most
    recent, ``budget`` tokens in all; the sinks take whole blocks."""

    name = "sinks+window"

    def __init__(self, budget: int, sinks: int = 4, keep=None):
        """``keep`` replaces :func:`sinks_window_blocks` (same signature; notebook 07 plugs the participant's in)."""
        super().__init__(budget)
        self.sinks = check_int("sinks", sinks)
        self.keep = _plugged(keep)

    def min_blocks(self, block_size):
        return math.ceil(self.sinks / block_size) + 1

    def choose_keep(self, logical, budget, num_tokens, prompt_len, block_size, scores):
        if self.keep is not None:
            return _checked_keep("keep", self.keep(num_tokens, block_size, self.budget, self.sinks), logical, budget)
        s = math.ceil(self.sinks / block_size)
        return [lb for lb in logical if lb < s] + logical[-(budget - s):]

    def textbook_keep(self, kept, prompt_len, scores, group=1):
        n, s = kept.shape[0], math.ceil(self.sinks / group)
        g = _groups(n, group)
        return kept & ((g < s) | (g > (n - 1) // group - (self.budget // group - s)))


class HeavyHitters(EvictionPolicy):
    """H2O: the most recent blocks (``recent`` share of the budget) plus the others that received the
    most attention so far."""

    name = "h2o"
    needs_scores = True

    def __init__(self, budget: int, recent: float = 0.5, keep=None):
        """``keep`` replaces :func:`h2o_keep` (notebook 07 plugs the participant's in)."""
        super().__init__(budget)
        self.keep = _plugged(keep)
        if isinstance(recent, bool) or not isinstance(recent, (int, float)) or not 0 < recent < 1:
            raise ValueError(f"recent must be the share of the budget kept for recent blocks, in (0, 1); "
                             f"got {recent!r}")
        self.recent = float(recent)

    def _recent(self, budget: int) -> int:
        return min(budget - 1, max(1, round(budget * self.recent)))

    def min_blocks(self, block_size):
        return 2

    def observe_from(self, prompt_len):
        return 0

    def choose_keep(self, logical, budget, num_tokens, prompt_len, block_size, scores):
        r = self._recent(budget)
        if self.keep is not None:
            kept = self.keep(list(logical), budget, r, _block_scores(scores, logical, block_size))
            return _checked_keep("keep", kept, logical, budget)
        recent, older = logical[-r:], logical[:-r]
        return recent + _top(older, budget - r, _block_scores(scores, older, block_size))

    def textbook_keep(self, kept, prompt_len, scores, group=1):
        budget = self.budget // group
        kept_groups = torch.nonzero(_group_sum(kept.to(torch.int64), group)).flatten()  # ascending
        if len(kept_groups) <= budget:
            return kept.clone()
        r = self._recent(budget)
        chosen = torch.cat([kept_groups[-r:], _textbook_top(kept_groups[:-r], budget - r, _group_sum(scores, group))])
        keep_group = torch.zeros(math.ceil(kept.shape[0] / group), dtype=torch.bool)
        keep_group[chosen] = True
        return kept & keep_group[_groups(kept.shape[0], group)]


class PromptSelect(EvictionPolicy):
    """SnapKV: once, at the prompt's end, its last ``window`` queries vote (pooled over ``kernel``
    neighbours); the prompt keeps its window plus the top-voted blocks. The answer is never dropped."""

    name = "snapkv"
    needs_scores = True
    once = True

    def __init__(self, budget: int, window: int = 16, kernel: int = 5):
        super().__init__(budget)
        self.window = check_int("window", window)
        if not is_int(kernel) or kernel < 1 or kernel % 2 == 0:
            raise ValueError(f"kernel must be an odd int >= 1 (a centred pooling window), got {kernel!r}")
        self.kernel = kernel

    def _window_groups(self, prompt_len: int, group: int) -> int:
        """Groups (blocks) holding the prompt's last ``window`` tokens (the last one may be partial)."""
        last = (prompt_len - 1) // group
        return last - max(0, prompt_len - self.window) // group + 1

    def min_blocks(self, block_size):
        return math.ceil(self.window / block_size) + 2  # the window's blocks (it may straddle one more) + one

    def observe_from(self, prompt_len):
        return max(0, prompt_len - self.window)

    def max_blocks(self, prompt_len, max_tokens, block_size):
        return max(math.ceil(prompt_len / block_size),
                   self.budget_blocks(block_size) + math.ceil(max_tokens / block_size) + 1)

    def pooled(self, scores: torch.Tensor, prompt_len: int) -> torch.Tensor:
        """Votes averaged over ``kernel`` neighbours, zero-padded at the ends; past the prompt, 0."""
        s = scores[:prompt_len].float()[None, None]
        p = torch.nn.functional.avg_pool1d(s, self.kernel, stride=1, padding=self.kernel // 2)[0, 0]
        out = torch.zeros_like(scores, dtype=torch.float32)
        out[:prompt_len] = p
        return out

    def choose(self, logical, num_tokens, prompt_len, block_size, scores=None):
        budget = self.budget_blocks(block_size)
        prompt_blocks = [lb for lb in logical if lb * block_size < prompt_len]
        if len(prompt_blocks) <= budget:
            return []
        w = self._window_groups(prompt_len, block_size)
        recent, older = prompt_blocks[-w:], prompt_blocks[:-w]
        keep = set(recent + _top(older, budget - w, _block_scores(self.pooled(scores, prompt_len), older, block_size)))
        return [lb for lb in prompt_blocks if lb not in keep]

    def textbook_keep(self, kept, prompt_len, scores, group=1):
        budget = self.budget // group
        n_prompt_groups = math.ceil(prompt_len / group)
        if n_prompt_groups <= budget:
            return kept.clone()
        w = self._window_groups(prompt_len, group)
        gscore = _group_sum(self.pooled(scores, prompt_len), group)
        older = torch.arange(n_prompt_groups - w)
        chosen = torch.cat([torch.arange(n_prompt_groups - w, n_prompt_groups), _textbook_top(older, budget - w, gscore)])
        keep_group = torch.ones(math.ceil(kept.shape[0] / group), dtype=torch.bool)
        keep_group[:n_prompt_groups] = False
        keep_group[chosen] = True
        return kept & keep_group[_groups(kept.shape[0], group)]


#: the policies by name (``LLM(eviction=...)``, ``kvlab.cache.evict.make_policy``)
POLICIES = {p.name: p for p in (SlidingWindow, SinksWindow, HeavyHitters, PromptSelect)}


def make_policy(policy, budget: int | None = None, **kwargs) -> EvictionPolicy:
    """A policy from its name in :data:`POLICIES` and a budget in tokens, or ``policy`` if it is one."""
    if isinstance(policy, EvictionPolicy):
        return policy
    if not isinstance(policy, str) or policy not in POLICIES:
        raise ValueError(f"eviction policy must be one of {tuple(POLICIES)} or an EvictionPolicy, got {policy!r}")
    if budget is None:
        raise ValueError(f"eviction policy {policy!r} needs a budget in tokens")
    return POLICIES[policy](budget, **kwargs)


# ---- the engine side: attention observed, scores kept per sequence -----------------------------------

def kept_positions(logical: list[int], kept_len: int, block_size: int) -> torch.Tensor:
    """(kept_len,) the logical position of each token attention reads, in the order it reads them."""
    pos = (torch.as_tensor(logical, dtype=torch.long)[:, None] * block_size
           + torch.arange(block_size)[None, :]).flatten()
    return pos[:kept_len]


class EvictionState:
    """One sequence's scores per logical position; a preempted sequence (blocks freed, prompt
    recomputed) starts over."""

    def __init__(self, owner):
        self.owner = owner
        self.scores = torch.zeros(0, dtype=torch.float64)
        self.done = False
        self.hits_scored = False  # the recorded rows of its prefix hits added (add_cached_rows)

    def add(self, mass: torch.Tensor, positions: torch.Tensor) -> None:
        n = int(positions.max()) + 1 if len(positions) else 0
        if n > self.scores.shape[0]:
            self.scores = torch.cat([self.scores, torch.zeros(n - self.scores.shape[0], dtype=torch.float64)])
        self.scores.index_add_(0, positions, mass.double())


def watch_from(policy: EvictionPolicy, state: EvictionState, prompt_len: int, end: int) -> int | None:
    """The first query position whose attention this forward must observe, or None."""
    if not policy.needs_scores or (policy.once and state.done):
        return None
    from_pos = policy.observe_from(prompt_len)
    return from_pos if from_pos is not None and end > from_pos else None


def after_forward(policy: EvictionPolicy, bm, seq_id: int, state: EvictionState, prompt_len: int,
                  num_computed: int, mass: torch.Tensor | None = None) -> int:
    """Add the observed attention to a sequence's scores, then, once its prompt is computed, let the
    policy drop blocks; returns how many."""
    if mass is not None:
        # the mass covers the keys this forward read: the first len(mass) kept positions (a chunked
        # prompt's blocks are all allocated up front, its later chunks not computed yet)
        state.add(mass, kept_positions(bm.logical_blocks(seq_id), len(mass), bm.block_size))
    if num_computed < prompt_len or (policy.once and state.done):
        return 0
    drop = policy.choose(bm.logical_blocks(seq_id), bm.num_tokens(seq_id), prompt_len, bm.block_size,
                         state.scores if policy.needs_scores else None)
    bm.evict(seq_id, drop)
    state.done = True
    return len(drop)


def add_cached_rows(state: EvictionState, store: dict, policy, blocks, prompt_len: int, block_size: int) -> None:
    """A scoring request whose prompt hit the prefix cache: the attention of the rows it does not compute,
    as :func:`keep_rows` kept them (after the forward that computed them, even in the same step)."""
    if policy is None or not policy.needs_scores or not blocks.cached_tokens:
        return
    from_pos = policy.observe_from(prompt_len)
    for b in range(blocks.cached_tokens // block_size) if from_pos is not None else ():
        rows = store.get(blocks.hashes[b]) if from_pos < (b + 1) * block_size else None
        if rows is not None:
            state.add(rows[max(0, from_pos - b * block_size):].sum(dim=0), torch.arange((b + 1) * block_size))


def keep_rows(store: dict, partial: dict, batch, observer: AttentionMass | None, bm) -> dict:
    """``store`` + the query rows of each prompt block a recorded sequence completed in this forward, by
    block hash; a block's first rows, computed in an earlier chunk, wait in ``partial[seq_id]``."""
    if observer is None or not observer.rows:
        return store
    bs = bm.block_size
    if len(store) > 2 * bm.num_blocks:  # keep what a prefix hit can still find: on the device or the host
        store = {h: r for h, r in store.items() if h in bm.hash_to_block or (bm.host_blocks and h in bm.host.entries)}
    for i, rows in observer.rows.items():
        seq, blocks = batch.seqs[i], bm.seqs.get(batch.seqs[i].seq_id)
        end = seq.num_computed_tokens  # counted already: this forward computed [start, end)
        start, prompt_len = end - batch.num_new_tokens[i], len(seq.prompt_token_ids)
        b0, done = start // bs, partial.pop(seq.seq_id, None)
        if start % bs:  # this forward began inside block b0: its first rows came earlier, or it is not kept
            if done is None or done[0] != b0 or len(done[1]) != start % bs:
                b0 += 1
            else:
                keys = max(rows.shape[1], (b0 + 1) * bs)
                rows = torch.cat([torch.nn.functional.pad(done[1], (0, keys - done[1].shape[1])),
                                  torch.nn.functional.pad(rows, (0, keys - rows.shape[1]))])
                start = b0 * bs
        for b in range(b0, min(end, prompt_len) // bs):
            if blocks is not None and b < len(blocks.hashes) and blocks.hashes[b] not in store:
                store[blocks.hashes[b]] = rows[b * bs - start:(b + 1) * bs - start, :(b + 1) * bs].clone()
        if end < prompt_len and end % bs and (end // bs) * bs >= start:  # its rows so far, for the next chunk
            partial[seq.seq_id] = (end // bs, rows[(end // bs) * bs - start:end - start].clone())
    return store
