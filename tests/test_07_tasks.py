"""Notebook 07's build tasks: the checkers name the planted mistakes, and the references plugged into
the policies through the notebook's own call (SinksWindow / HeavyHitters(..., keep=...)) evict exactly as
kvlab's own rules do in the engine."""

import pytest

from kvlab import check
from kvlab.cache import evict as ev
from kvlab.engine import LLM, SamplingParams
from kvlab.validate import cdiv


def test_sinks_window_blocks_checker_names_the_budget_in_blocks(capsys):
    assert check.sinks_window_blocks(ev.sinks_window_blocks)

    def kept(n, bs, budget, sinks, budget_blocks=lambda budget, bs: budget // bs):
        total, b, s = cdiv(n, bs), budget_blocks(budget, bs), cdiv(sinks, bs)
        if total <= b:
            return list(range(total))
        return sorted(set(range(min(s, total))) | set(range(total - (b - s), total)))

    assert check.sinks_window_blocks(kept)
    mistakes = {
        "the budget is in tokens: it holds budget // block_size": lambda *a: kept(*a, budget_blocks=lambda b, bs: b),
        "rounds down": lambda *a: kept(*a, budget_blocks=cdiv),
    }
    for why, fn in mistakes.items():
        capsys.readouterr()
        assert not check.sinks_window_blocks(fn)
        out = capsys.readouterr().out
        assert out.startswith("[fail] sinks_window_blocks: ") and why in out, out


def test_h2o_keep_checker_names_the_mistakes(capsys):
    assert check.h2o_keep(ev.h2o_keep)
    top = lambda l, b, r, s: sorted(l, key=lambda x: (-s[x], x))  # noqa: E731
    mistakes = {
        "among the OLDER ones only": lambda l, b, r, s: sorted(set(l[-r:]) | set(top(l, b, r, s)[:b - r])),
        "the recent newest blocks stay": lambda l, b, r, s: top(l, b, r, s)[:b],
        "the MOST attention": lambda l, b, r, s: l[-r:] + sorted(l[:-r], key=lambda x: (s[x], x))[:b - r],
        "the earlier block wins": lambda l, b, r, s: l[-r:] + sorted(l[:-r], key=lambda x: (-s[x], -x))[:b - r],
        "keep budget blocks in all": lambda l, b, r, s: l[-r:] + sorted(l[:-r], key=lambda x: (-s[x], x))[:b],
    }
    for why, fn in mistakes.items():
        capsys.readouterr()
        assert not check.h2o_keep(fn)
        out = capsys.readouterr().out
        assert out.startswith("[fail] h2o_keep: ") and why in out, out


def test_copy_or_recompute_checker_names_the_mistakes(capsys):
    from kvlab.check.evict import copy_and_recompute

    assert check.copy_or_recompute(copy_and_recompute)

    def planted(tokens, cfg, link, flops, head_dim=True, recompute_tokens=True):
        per_token = 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim if head_dim else 1) * 2
        return tokens * per_token / link, 2 * cfg.num_params * (tokens if recompute_tokens else 1) / flops

    mistakes = {"each head stores head_dim numbers": lambda *a: planted(*a, head_dim=False),
                "the prefill recomputes every one of the tokens": lambda *a: planted(*a, recompute_tokens=False)}
    for why, fn in mistakes.items():
        capsys.readouterr()
        assert not check.copy_or_recompute(fn)
        out = capsys.readouterr().out
        assert out.startswith("[fail] copy_or_recompute: ") and why in out, out


def _serve(model, policy):
    llm = LLM(model, None, num_blocks=32, block_size=4, max_num_seqs=1, max_num_batched_tokens=256,
              attn_backend="reference", eviction=policy, enable_prefix_caching=False)
    kept = []
    llm.on_step = lambda s: kept.append(tuple(llm.block_manager.logical_blocks(0)) if 0 in llm.block_manager.seqs else ())
    out = llm.generate([[5, 17, 3, 9, 11, 2, 8, 4, 6, 1, 12, 13, 14, 15, 16, 18, 19, 20, 21, 22]],
                       SamplingParams(max_tokens=14, ignore_eos=True))
    return out[0].token_ids, kept


def test_the_references_plugged_into_the_policies_evict_as_kvlabs_own(tiny):
    model, _ = tiny
    own = _serve(model, ev.SinksWindow(16, sinks=4))
    assert own == _serve(model, ev.SinksWindow(16, sinks=4, keep=ev.sinks_window_blocks))
    assert max(len(k) for k in own[1][1:]) <= 5  # the policy did evict: 4 blocks of budget + the one being written
    assert _serve(model, ev.HeavyHitters(16)) == _serve(model, ev.HeavyHitters(16, keep=ev.h2o_keep))


def test_a_wrong_choice_plugged_in_is_refused_by_name(tiny):
    model, _ = tiny
    with pytest.raises(ValueError, match=r"keep returned \[0, 1, 2, 3, 4, 5\]"):
        _serve(model, ev.SinksWindow(16, sinks=4, keep=lambda n, bs, budget, sinks: list(range(6))))
    with pytest.raises(TypeError, match="keep must be a function"):
        ev.HeavyHitters(16, keep=3)
    assert repr(ev.HeavyHitters(16)) == "HeavyHitters(budget=16, recent=0.5)"
