"""When the cache does not fit (notebook 07): evict or quantize at the same bytes, and a retrieval
task that shows what eviction forgets.

* :func:`equal_byte_budgets` — for each quantized format, the FP16 token budget that holds the same
  bytes at the end of a text;
* :func:`quantize_or_evict` — every format and every eviction policy scored on one text against the
  full cache (:func:`kvlab.eval.eviction_quality`), and one computed verdict per budget;
* :func:`passkey_prompts`, :func:`passkey` — a number hidden early in a long prompt, asked for at its
  end, served by the engine with each policy.
"""

from __future__ import annotations

import random

from kvlab.cache import QuantizedPagedKVCache
from kvlab.cache.evict import POLICIES, EvictionPolicy, PromptSelect, make_policy
from kvlab.engine import LLM, SamplingParams
from kvlab.eval import eviction_quality
from kvlab.quant import named_config
from kvlab.validate import cdiv, check_int

#: the quantized formats set against eviction, and their labels
FORMATS = ("int8", "k8v4", "int4")


def block_share(model, fmt: str, block_size: int = 16) -> float:
    """Bytes of one ``fmt`` block over one FP16 block (per-token scales included)."""
    one = lambda f: QuantizedPagedKVCache.from_model(model, 1, block_size, named_config(f)).bytes_per_block  # noqa: E731
    return one(fmt) / one("fp16")


def equal_byte_budgets(model, num_tokens: int, formats=FORMATS, block_size: int = 16) -> dict[str, int]:
    """For each format: the FP16 budget (tokens, whole blocks) that holds what the format's full cache of
    ``num_tokens`` tokens holds, in bytes, at the end of the text (the peak, which decides what fits)."""
    full = cdiv(num_tokens, block_size)
    return {f: int(block_share(model, f, block_size) * full) * block_size for f in formats}


def _policy(name: str, budget: int, **kw) -> EvictionPolicy:
    return make_policy(name, budget, **kw.get(name, {}))


def quantize_or_evict(model, tokens: list[int], prompt_len: int, calibration=None, formats=FORMATS,
                      policies=tuple(POLICIES), extra_budgets=(64,), block_size: int = 16, options=None) -> dict:
    """Score every format (full cache) and every policy (FP16, at the formats' equal-byte budgets and at
    ``extra_budgets``) on one text. SnapKV keeps every answer token, so at a budget it is given
    ``budget - answer tokens`` for its prompt (where that is too small, it does not take part).

    Returns the :func:`~kvlab.eval.eviction_quality` result, ``budgets`` (format -> tokens) and
    ``verdicts``: one per format, computed from next-token KL against the full FP32 cache: ``quantize``
    when the format's KL is below every policy's at the same bytes, else ``evict`` with the policy that
    beats it."""
    options = options or {}
    budgets = equal_byte_budgets(model, len(tokens) - 1, formats, block_size)
    answer = len(tokens) - 1 - prompt_len  # tokens fed after the prompt: SnapKV keeps them all
    configs = {f: (None, f) for f in formats}
    where = {}  # config name -> the budget (end-of-text tokens) it is compared at
    for b in sorted(set(budgets.values()) | set(extra_budgets)):
        for p in policies:
            own = b - answer if POLICIES[p] is PromptSelect else b
            try:
                policy = _policy(p, own, **options) if own > 0 else None
                if policy is not None:
                    policy.budget_blocks(block_size)
            except ValueError:
                policy = None
            if policy is not None:
                configs[f"{p}@{b}"] = (policy, "fp16")
                where[f"{p}@{b}"] = b
    result = eviction_quality(model, tokens, prompt_len, configs, calibration=calibration, block_size=block_size)
    cs = result["configs"]
    verdicts = []
    for f in formats:
        b = budgets[f]
        rivals = {n: cs[n] for n, bb in where.items() if bb == b}
        better = {n: c for n, c in rivals.items() if c["kl"] < cs[f]["kl"]}
        best = min(rivals, key=lambda n: rivals[n]["kl"]) if rivals else None
        verdicts.append({
            "format": f, "budget": b, "bytes_share": cs[f]["bytes_share"], "kl_format": cs[f]["kl"],
            "best_policy": best, "kl_best_policy": rivals[best]["kl"] if best else None,
            "verdict": "evict" if better else "quantize",
            "factor": (rivals[best]["kl"] / cs[f]["kl"]) if best and cs[f]["kl"] > 0 else None})
    return {"result": result, "budgets": budgets, "where": where, "verdicts": verdicts}


# ---- a retrieval task ----------------------------------------------------------------------------------

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_prompts(tokenizer, n: int = 6, filler_repeats: int = 20, seed: int = 0) -> tuple[list[list[int]], list[int]]:
    """``n`` prompts, each hiding a five-digit pass key at a random depth (10-50 %) of ``filler_repeats``
    filler sentences, and asking for it at the end. Returns (token ids, keys)."""
    check_int("n", n)
    check_int("filler_repeats", filler_repeats)
    rng = random.Random(seed)
    prompts, keys = [], []
    for _ in range(n):
        key = rng.randrange(10000, 100000)
        before = int(filler_repeats * rng.choice([0.1, 0.3, 0.5]))
        text = ("There is an important piece of information hidden in a lot of irrelevant text. Find it and "
                f"memorize it.\n{FILLER * before}The pass key is {key}. Remember it. {key} is the pass key.\n"
                f"{FILLER * (filler_repeats - before)}What is the pass key? The pass key is")
        prompts.append(list(tokenizer.encode(text)))
        keys.append(key)
    return prompts, keys


def passkey(model, tokenizer, policies: dict, n: int = 6, filler_repeats: int = 20, seed: int = 0,
            block_size: int = 16) -> dict:
    """Serve the pass-key prompts once per policy (name -> EvictionPolicy or None: the full cache) and
    count the answers that contain the key. Returns name -> {"correct", "n", "answers"}."""
    prompts, keys = passkey_prompts(tokenizer, n, filler_repeats, seed)
    longest = max(map(len, prompts))
    out = {}
    for name, policy in policies.items():
        llm = LLM(model, tokenizer, num_blocks=n * cdiv(longest + 8, block_size) + 8, block_size=block_size,
                  max_num_seqs=n, max_num_batched_tokens=max(512, longest), eviction=policy,
                  enable_prefix_caching=False)
        answers = [tokenizer.decode(o.token_ids) for o in llm.generate(prompts, SamplingParams(max_tokens=8, ignore_eos=True))]
        out[name] = {"correct": sum(str(k) in a for a, k in zip(answers, keys)), "n": n, "answers": answers,
                     "prompt_tokens": longest}
    return out
