"""When the cache does not fit (notebook 07): caches that evict or quantize, served by the engine and
scored against the full cache; the verdict at equal bytes; the pass-key task."""

from __future__ import annotations

import math
import time

import torch

from kvlab.cache import BlockManager, PagedKVCache, QuantizedPagedKVCache
from kvlab.cache.evict import POLICIES, EvictionPolicy, PromptSelect, make_policy
from kvlab.data import passkey_depth, passkey_prompts
from kvlab.engine import LLM, SamplingParams
from kvlab.eval.quality import PoolRunner, check_tokens
from kvlab.probe import paged_attention_spec
from kvlab.quant import named_config
from kvlab.quant.config import FP32
from kvlab.validate import cdiv, check_int, is_int


def _as_eviction_config(name, spec) -> tuple:
    policy, fmt = spec if isinstance(spec, tuple) else (spec, "fp16")
    if policy is not None and not isinstance(policy, EvictionPolicy):
        raise TypeError(f"config {name!r}: the policy must be a kvlab.cache.evict policy or None, got "
                        f"{type(policy).__name__}")
    named_config(fmt)  # an unknown format name fails here
    return policy, fmt


#: _serve_text's prompt tokens in one forward at most (one prompt, if longer): notebook 07's 16 x 320 at once
#: held 0.9 GiB of activations (3 at a time: 0.2 GiB); now one prompt leads, the rest hit its blocks
PREFILL_TOKENS = 1024


def _leader(policies) -> int:
    """The request that prefills a shared prompt: a scoring policy's (its attention rows are kept), else the first."""
    return next((k for k, p in enumerate(policies) if getattr(p, "needs_scores", False)), 0)


def _prefill_once(llm, prompts: list, params: list[list], lead: int) -> list[list[int]]:
    """Prompt ``k`` queued once per ``params[k][c]``: its ``lead`` request first, run until the prompt is
    computed, then the others, which find its full blocks in the prefix cache and compute only the last,
    partial one. Returns the request ids ``ids[k][c]``; the caller steps the engine to the end."""
    ids = [[None] * len(row) for row in params]
    for k, prompt in enumerate(prompts):
        ids[k][lead] = llm.add_request(prompt, params[k][lead])
    while llm.has_unfinished() and any(llm.seqs[ids[k][lead]].num_computed_tokens < len(p) for k, p in enumerate(prompts)):
        llm.step()
    for k, prompt in enumerate(prompts):
        for c, pc in enumerate(params[k]):
            if c != lead:
                ids[k][c] = llm.add_request(prompt, pc)
    return ids


def _serve_text(model, tokens: list[int], prompt_len: int, policies: list, fmt: str, calibration, block_size: int,
                attn_backend: str, score) -> list[dict]:
    """One batch, a request per policy: the prompt, then the rest forced one token a step with the policy
    acting after each; per request its scores and what it held. ``score``: a :class:`_Scores` that takes
    each scored position's logits as the step makes them (a batch of 16 would hold 16 x the text's logits)."""
    rows, forced = len(policies), tokens[prompt_len:]
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and len(tokens) > limit:
        raise ValueError(f"tokens ({len(tokens)}) exceed the model's context of {limit}")
    nb = rows * (cdiv(len(tokens), block_size) + 1) + 1
    bm = BlockManager(nb, block_size)  # prefix caching: the prompt is prefilled once (_prefill_once)
    cache = (PagedKVCache.from_model(model, nb, block_size, dtype=torch.float32) if fmt == "fp32" else
             QuantizedPagedKVCache.from_model(model, nb, block_size, named_config(fmt), calibration))
    # prompts prefilled a few at a time (PREFILL_TOKENS a step); each request computes the same either way
    at_once = max(1, min(rows, PREFILL_TOKENS // (prompt_len + 1)))
    llm = LLM(model, block_manager=bm, cache=cache, attn_backend=attn_backend, max_num_seqs=rows,
              max_num_batched_tokens=at_once * (prompt_len + 1), watermark=0.0)
    params = [SamplingParams(max_tokens=len(forced), ignore_eos=True, eviction=p, forced_token_ids=forced,
                             return_logits=True) for p in policies]
    ids = _prefill_once(llm, [tokens[:prompt_len]], [params], _leader(policies))[0]
    scorers, seen = [score.row() for _ in ids], [0] * rows
    while llm.has_unfinished():  # each step's logits scored and dropped
        llm.step()
        for r, i in enumerate(ids):
            seq = llm.seqs[i]
            for lg in seq.logits:  # output k's logits: k = 1 .. len(forced) - 1 are scored
                if 1 <= seen[r] < len(forced):
                    scorers[r].add(lg)
                seen[r] += 1
            seq.logits.clear()
    held = [llm.seqs[i].metrics for i in ids]
    return [{"scores": sc, "held": {"blocks": m.held_blocks, "tokens": m.held_tokens, "bytes": m.held_blocks
                                    * cache.bytes_per_block}} for sc, m in zip(scorers, held)]


class _Scores:
    """Per-position scores of logits against the reference's log-probabilities ``ref`` (P, V) and the
    ``targets`` (P,): KL(ref || p), the target's negative log-likelihood, whether the argmax agrees.
    Logits arrive a position at a time (:meth:`row`) or all at once (:meth:`of`): only 3 numbers a
    position are kept, never the (P, V) logits of every cache."""

    def __init__(self, ref: torch.Tensor, targets: torch.Tensor):
        self.ref, self.targets = ref, targets
        self.p_ref, self.top_ref = ref.exp(), ref.argmax(-1)

    def of(self, logits) -> dict:
        row = self.row()
        for lg in logits:
            row.add(lg)
        return row.result()

    def row(self) -> "_ScoreRow":
        return _ScoreRow(self)


class _ScoreRow:
    def __init__(self, scores: _Scores):
        self.s, self.kl, self.nll, self.top = scores, [], [], []

    def add(self, logits: torch.Tensor) -> None:
        t = len(self.kl)
        if t >= len(self.s.targets):
            raise ValueError(f"more than the {len(self.s.targets)} scored positions")
        lp = torch.log_softmax(logits.float(), -1)
        self.kl.append(float((self.s.p_ref[t] * (self.s.ref[t] - lp)).sum()))
        self.nll.append(-float(lp[self.s.targets[t]]))
        self.top.append(bool(lp.argmax() == self.s.top_ref[t]))

    def result(self) -> dict:
        if len(self.kl) != len(self.s.targets):
            raise ValueError(f"scored {len(self.kl)} positions, expected {len(self.s.targets)}")
        return {"kl": torch.tensor(self.kl), "nll": torch.tensor(self.nll, dtype=torch.float64),
                "top1": torch.tensor(self.top)}


def _check_prompt_len(prompt_len, tokens: list[int]) -> None:
    if not is_int(prompt_len) or not 0 < prompt_len < len(tokens) - 1:
        raise ValueError(f"prompt_len must be an int in [1, {len(tokens) - 2}] (some tokens must follow it), "
                         f"got {prompt_len!r}")


@torch.inference_mode()
def forced_logits(model, tokens: list[int], prompt_len: int, fmt: str = "fp32", calibration=None,
                  block_size: int = 16) -> tuple[list[torch.Tensor], dict]:
    """What :func:`_serve_text` gives a cache that keeps every token: the logits at every scored position
    (fed tokens ``prompt_len`` .. ``len(tokens) - 2``) and what the cache held, in two forwards, not a step
    per token. Nothing evicted, each forced token attends to what it would step by step (``as_decodes``:
    earlier tokens as stored, itself at full precision): equal up to float rounding (a test compares)."""
    tokens = check_tokens(tokens, model.config.vocab_size)
    _check_prompt_len(prompt_len, tokens)
    config = FP32 if fmt == "fp32" else named_config(fmt)
    runner = PoolRunner(model, config, calibration, [tokens[:-1]], block_size)
    runner.forward_many({0: tokens[:prompt_len]})
    logits = runner.forward_many({0: tokens[prompt_len:-1]}, as_decodes=True)[0]
    blocks = cdiv(len(tokens) - 1, block_size)
    return list(logits), {"blocks": blocks, "tokens": len(tokens) - 1, "bytes": blocks * runner.cache.bytes_per_block}


@torch.inference_mode()
def eviction_quality(model, tokens: list[int], prompt_len: int, configs: dict, calibration=None,
                     block_size: int = 16, attn_backend: str = "torch", reference: dict | None = None) -> dict:
    """Quality of caches that evict or quantize against the full FP32 cache, on one text.

    ``configs``: name -> ``(policy, format)`` (a bare policy means FP16). The prompt is prefilled, then
    the text is forced as generation feeds it, and every decode position is scored (KL, top-1, perplexity
    as :func:`evaluate`). Evicting configs of one format share a pool and a batch, a step per token (the
    policy acts after each); caches that keep every token, the reference included, score the text in two
    forwards (:func:`forced_logits`, equal up to float rounding).
    ``reference``: an earlier result on the same text and prompt, whose full-cache logits are reused
    instead of served again."""
    tokens = check_tokens(tokens, model.config.vocab_size)
    _check_prompt_len(prompt_len, tokens)
    if not isinstance(configs, dict) or not configs:
        raise ValueError("configs must be a non-empty dict name -> (policy, format)")
    specs = {n: _as_eviction_config(n, s) for n, s in configs.items()}
    if reference is not None and (not isinstance(reference, dict) or "full_logits" not in reference
                                  or (reference.get("token_ids"), reference.get("prompt_len")) != (tokens, prompt_len)):
        raise ValueError("reference must be an eviction_quality(...) result on the same tokens and prompt_len")
    paged_attention_spec(model)
    n_tok = len(tokens)
    groups: dict[str, list[str]] = {}
    for n, (_, fmt) in specs.items():
        groups.setdefault(fmt, []).append(n)
    held: dict[str, dict] = {}
    seconds: dict[str, float] = {}
    t0 = time.perf_counter()
    full_logits = (reference["full_logits"] if reference is not None else
                   forced_logits(model, tokens, prompt_len, "fp32", None, block_size)[0])
    seconds["full"] = time.perf_counter() - t0
    # position t - 1's logits (fed token t - 1) predict token t, for t = prompt_len + 1 .. n_tok - 1
    targets = torch.tensor(tokens[prompt_len + 1:n_tok])
    ref = torch.log_softmax(torch.stack(full_logits), -1)
    ref_nll = -ref.gather(1, targets[:, None])[:, 0].double()
    score = _Scores(ref, targets)
    scores: dict[str, dict] = {}
    for fmt, names in groups.items():
        t0 = time.perf_counter()
        evicting = [n for n in names if specs[n][0] is not None]
        keeping = [n for n in names if specs[n][0] is None]
        if keeping:  # every token kept: the whole text in two forwards, shared by the group's full caches
            lg, hd = forced_logits(model, tokens, prompt_len, fmt, calibration, block_size)
            scored = score.of(lg)
            del lg
            for n in keeping:
                scores[n], held[n] = scored, hd
        if evicting:  # the policy acts after every token: a step per token
            fed = _serve_text(model, tokens, prompt_len, [specs[n][0] for n in evicting], fmt, calibration,
                              block_size, attn_backend, score=score)
            for n, row in zip(evicting, fed):
                scores[n] = row["scores"].result()
                held[n] = row["held"]
        seconds[fmt] = time.perf_counter() - t0
    fp16_full = cdiv(n_tok - 1, block_size) * QuantizedPagedKVCache.from_model(
        model, 1, block_size, named_config("fp16")).bytes_per_block
    out = {"tokens": n_tok, "prompt_len": prompt_len, "scored": len(targets), "ppl_full": math.exp(ref_nll.mean()),
           "fp16_full_bytes": fp16_full, "seconds": seconds, "token_ids": tokens, "full_logits": full_logits,
           "configs": {}}
    for n in configs:
        sc = scores[n]
        nll = sc["nll"]
        d = nll - ref_nll
        se = float(d.std() / math.sqrt(max(len(d) - 1, 1)))
        mean = float(d.mean())
        policy, fmt = specs[n]
        out["configs"][n] = {
            "policy": None if policy is None else policy.name, "budget": None if policy is None else policy.budget,
            "format": fmt, "kl": float(sc["kl"].mean()), "kl_per_position": sc["kl"],
            "top1": float(sc["top1"].double().mean()),
            "ppl": math.exp(float(nll.mean())), "delta_ppl_pct": 100 * (math.exp(mean) - 1),
            "delta_ppl_ci95": tuple(100 * (math.exp(mean + z * 1.96 * se) - 1) for z in (-1, 1)),
            **held[n], "bytes_share": held[n]["bytes"] / fp16_full}
    return out


@torch.inference_mode()
def answers_after_cut(model, tokens: list[int], cut: int, policies: dict, max_tokens: int = 8,
                      block_size: int = 16, attn_backend: str = "torch") -> dict[str, list[int]]:
    """Greedy answers when the cache is cut at ``cut``, before the question is known (a document cached
    once, asked about later); ``LLM(eviction=...)`` cuts after the whole prompt instead."""
    tokens = check_tokens(tokens, model.config.vocab_size)
    if not is_int(cut) or not 0 < cut <= len(tokens):
        raise ValueError(f"cut must be an int in [1, {len(tokens)}] (the tokens prefilled before the cut), got {cut!r}")
    check_int("max_tokens", max_tokens)
    if not isinstance(policies, dict) or not policies:
        raise ValueError("policies must be a non-empty dict name -> policy (or None: the full cache)")
    specs = {n: _as_eviction_config(n, p)[0] for n, p in policies.items()}
    limit = getattr(model.config, "max_position_embeddings", None)
    if limit is not None and len(tokens) + max_tokens > limit:
        raise ValueError(f"tokens ({len(tokens)}) + generated ({max_tokens}) exceed the model's context of {limit}")
    return {n: a[0] for n, a in _after_cuts(model, None, [tokens], [cut], specs, max_tokens, block_size, attn_backend).items()}


def _after_cuts(model, tokenizer, prompts: list, cuts: list[int], policies: dict, max_tokens: int, block_size: int,
                attn_backend: str = "torch") -> dict[str, list[list[int]]]:
    """Per policy, each prompt's greedy answer, the cache cut at ``cut`` (the rest forced after it), one engine."""
    names, asks = list(policies), [p[at:] for p, at in zip(prompts, cuts)]
    longest, longest_ask = max(map(len, prompts)), max(map(len, asks))
    llm = LLM(model, tokenizer, block_size=block_size, max_num_seqs=len(prompts) * len(names), attn_backend=attn_backend,
              max_num_batched_tokens=max(512, longest), num_blocks=len(prompts) * cdiv(longest + max_tokens, block_size)
              + len(prompts) * len(names) * (cdiv(longest_ask + max_tokens, block_size) + 2) + 8)
    params = [[SamplingParams(max_tokens=len(ask) + max_tokens, ignore_eos=True, eviction=policies[name],
                              forced_token_ids=ask) for name in names] for ask in asks]
    ids = _prefill_once(llm, [p[:at] for p, at in zip(prompts, cuts)], params, _leader(policies.values()))
    while llm.has_unfinished():
        llm.step()
    return {name: [llm.seqs[row[c]].output_token_ids[len(ask):] for row, ask in zip(ids, asks)] for c, name in enumerate(names)}


# ---- at equal bytes, the pass key, the blocks kept ------------------------------------------------------

FORMATS = ("int8", "k8v4", "int4")
TIE_KL = 2.0  # quantize_or_evict: KLs closer than this factor, with overlapping perplexity intervals, are a tie


def block_share(model, fmt: str, block_size: int = 16, calibration=None) -> float:
    """Bytes of one ``fmt`` block over one FP16 block; static scale tables are a fixed cost outside blocks."""
    def one(f):
        return QuantizedPagedKVCache.from_model(model, 1, block_size, named_config(f), calibration).bytes_per_block
    return one(fmt) / one("fp16")


def equal_byte_budgets(model, num_tokens: int, formats=FORMATS, block_size: int = 16, calibration=None) -> dict[str, int]:
    """Per format, the FP16 budget (tokens, whole blocks) of the same bytes as its full cache at the peak."""
    full = cdiv(num_tokens, block_size)
    return {f: int(block_share(model, f, block_size, calibration) * full) * block_size for f in formats}


def equal_bytes_verdict(fmt: dict, policy: dict) -> tuple[str, float | None]:
    """A format against a policy at equal bytes: ``tie`` when their KLs are within :data:`TIE_KL` and the
    perplexity intervals overlap (the measurements cannot separate them), else the lower KL wins."""
    factor = policy["kl"] / fmt["kl"] if fmt["kl"] > 0 else None
    (lo, hi), (plo, phi) = fmt["delta_ppl_ci95"], policy["delta_ppl_ci95"]
    if factor is not None and 1 / TIE_KL < factor < TIE_KL and lo <= phi and plo <= hi:
        return "tie", factor
    return ("evict" if policy["kl"] < fmt["kl"] else "quantize"), factor


def quantize_or_evict(model, tokens: list[int], prompt_len: int, calibration=None, formats=FORMATS,
                      policies=tuple(POLICIES), extra_budgets=(64,), block_size: int = 16, options=None,
                      also: dict | None = None) -> dict:
    """Every format against the best policy at the same bytes, one verdict each. SnapKV keeps every answer
    token, so it gets ``budget - answer tokens`` for its prompt (too small: it does not take part).
    ``also``: more configs (as :func:`eviction_quality` takes them) served in the same batch, a step per
    token shared with the policies', scored apart (``["also"]``), outside the verdicts."""
    options = options or {}
    budgets = equal_byte_budgets(model, len(tokens) - 1, formats, block_size, calibration)
    answer = len(tokens) - 1 - prompt_len  # tokens fed after the prompt: SnapKV keeps them all
    configs = {f: (None, f) for f in formats}
    where = {}  # config name -> the budget (end-of-text tokens) it is compared at
    for b in sorted(set(budgets.values()) | set(extra_budgets)):
        for p in policies:
            own = b - answer if POLICIES[p] is PromptSelect else b
            try:
                policy = make_policy(p, own, **options.get(p, {})) if own > 0 else None
                if policy is not None:
                    policy.budget_blocks(block_size)
            except ValueError:
                policy = None
            if policy is not None:
                configs[f"{p}@{b}"] = (policy, "fp16")
                where[f"{p}@{b}"] = b
    if also is not None and not isinstance(also, dict):
        raise ValueError(f"also must be a dict name -> (policy, format) or None, got {type(also).__name__}")
    if set(also or {}) & set(configs):
        raise ValueError(f"also must not reuse the names of the compared configs: {sorted(set(also) & set(configs))}")
    result = eviction_quality(model, tokens, prompt_len, {**configs, **(also or {})}, calibration=calibration,
                              block_size=block_size)
    cs = result["configs"]
    extra = {n: cs.pop(n) for n in also or {}}
    verdicts = []
    for f in formats:
        b = budgets[f]
        rivals = {n: cs[n] for n, bb in where.items() if bb == b}
        best = min(rivals, key=lambda n: rivals[n]["kl"]) if rivals else None
        verdict, factor = equal_bytes_verdict(cs[f], rivals[best]) if best else ("quantize", None)
        verdicts.append({
            "format": f, "budget": b, "bytes_share": cs[f]["bytes_share"], "kl_format": cs[f]["kl"],
            "best_policy": best, "kl_best_policy": rivals[best]["kl"] if best else None,
            "verdict": verdict, "factor": factor})
    return {"result": result, "budgets": budgets, "where": where, "verdicts": verdicts, "also": extra}


CUTS = ("after the prompt", "before the question")  # where passkey() cuts the cache


def passkey(model, tokenizer, policies: dict, n: int = 6, filler_repeats: int = 20, seed: int = 0,
            block_size: int = 16, cut: str = "after the prompt", haystack: str = "filler") -> dict:
    """Answers that contain the pass key, per policy; cut "before the question", the policies choose
    without knowing what will be asked."""
    if cut not in CUTS:
        raise ValueError(f"cut must be one of {CUTS}, got {cut!r}")
    prompts, keys, starts = passkey_prompts(tokenizer, n, filler_repeats, seed, haystack, question_starts=True)
    longest = max(map(len, prompts))
    # each prompt (before the question: its document) prefilled once, then cut by every policy
    cuts = [len(p) if cut == "after the prompt" else at for p, at in zip(prompts, starts)]
    answers = _after_cuts(model, tokenizer, prompts, cuts, policies, 8, block_size)
    out = {}
    for name, ids in answers.items():
        text = [tokenizer.decode(a) for a in ids]
        found = [str(k) in a for a, k in zip(text, keys)]
        out[name] = {"correct": sum(found), "n": n, "answers": text, "found": found,
                     "depths": [passkey_depth(i) for i in range(n)],
                     "prompt_tokens": longest, "cut": cut, "haystack": haystack}
    return out


def kept_blocks(model, prompt: list[int], policies, budgets, max_tokens: int = 8, block_size: int = 16) -> dict:
    """The logical blocks each (budget, policy) kept at the last step, their scores, the pool's counters.
    The runs go one after another through one engine whose pool fits one run: the first (a scoring
    policy's, so the engine keeps the prompt's attention rows) computes the prompt, the others find its
    blocks in the prefix cache, each alone in the pool as in a pool of its own."""
    runs = [(budget, name) for budget in budgets for name in policies]
    lead = next((k for k, (b, n) in enumerate(runs) if make_policy(n, b).needs_scores), 0)
    llm = LLM(model, None, num_blocks=cdiv(len(prompt) + max_tokens, block_size) + 4, block_size=block_size,
              max_num_seqs=1, max_num_batched_tokens=max(512, len(prompt)))
    bm = llm.block_manager
    out = {budget: {} for budget in budgets}
    for budget, name in [runs[lead]] + runs[:lead] + runs[lead + 1:]:
        policy, snap, dropped_before = make_policy(name, budget), {}, bm.counters["policy_evictions"]

        def record(stats, policy=policy, snap=snap, dropped_before=dropped_before):
            for sid in bm.seqs:
                s, n = llm.eviction_scores(sid), bm.num_tokens(sid)
                scores = None
                if s is not None and policy.needs_scores:
                    scores = [float(s[i * block_size:(i + 1) * block_size].sum()) for i in range(cdiv(n, block_size))]
                snap.update(kept=bm.logical_blocks(sid), num_blocks=cdiv(n, block_size), scores=scores,
                            dropped=bm.counters["policy_evictions"] - dropped_before, free=bm.num_free_blocks,
                            tokens=n, pool=bm.num_blocks)

        llm.on_step = record
        llm.generate([prompt], SamplingParams(max_tokens=max_tokens, ignore_eos=True, eviction=policy))
        out[budget][name] = snap
    return {budget: {name: out[budget][name] for name in policies} for budget in budgets}
