"""The exercise checkers pass kvlab's own answers, fail wrong ones, and show the target for stubs."""

import math

import pytest
import torch

from kvlab import check, kernels, sizing

if kernels.available():  # Linux; elsewhere the kernel checker's test is skipped (tests/conftest.py)
    import triton
    import triton.language as tl  # a @triton.jit function must see `tl` among its module's globals


def stub(*args):
    raise NotImplementedError


def test_kv_token_bytes(capsys):
    assert check.kv_token_bytes(lambda L, H, kvh, D, hidden, b: 2 * L * kvh * D * b)
    assert "[ok]" in capsys.readouterr().out
    # each slip on the first case (Llama-3-8B: 32 layers, 32 heads, 8 KV heads, d 128, fp32 = 262,144 bytes)
    slips = {"a key AND a value": lambda L, H, kvh, D, hidden, b: L * kvh * D * b,
             "counts query heads": lambda L, H, kvh, D, hidden, b: 2 * L * H * D * b,
             "or hidden_size": lambda L, H, kvh, D, hidden, b: 2 * L * hidden * b,
             "every layer keeps": lambda L, H, kvh, D, hidden, b: 2 * kvh * D * b,
             "multiply by the bytes": lambda L, H, kvh, D, hidden, b: 2 * L * kvh * D,
             "the factor 2 is K and V, counted once": lambda L, H, kvh, D, hidden, b: 4 * L * kvh * D * b,  # 2 twice
             "every KV head stores its own": lambda L, H, kvh, D, hidden, b: 2 * L * D * b,  # KV heads dropped
             "multiply by head_dim": lambda L, H, kvh, D, hidden, b: 2 * L * kvh * b}
    for why, fn in slips.items():
        assert not check.kv_token_bytes(fn)
        out = capsys.readouterr().out
        assert "[fail]" in out and "expected 262144" in out and why in out, (why, out)
    assert not check.kv_token_bytes(stub)
    out = capsys.readouterr().out
    assert "[todo]" in out and "262144" not in out  # no answer revealed


def test_checker_rejects_non_callables():
    with pytest.raises(TypeError, match="pass your function"):
        check.kv_token_bytes(sizing.PRESETS)


def test_learner_exceptions_are_reported_not_raised(capsys):
    assert not check.kv_token_bytes(lambda *a: 1 / 0)
    assert "ZeroDivisionError" in capsys.readouterr().out


def test_slot_mapping(capsys):
    from kvlab.cache import BlockManager

    assert check.slot_mapping(BlockManager.slot_mapping_of)
    assert not check.slot_mapping(lambda t, bs, s, e: [t[i // bs] + i % bs for i in range(s, e)])  # forgot * bs
    assert not check.slot_mapping(stub)
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["[ok]", "[fail]", "[todo]"]


def test_slot_mapping_catches_a_first_block_offset_on_scattered_tables(capsys):
    # right on a contiguous table, wrong once blocks are scattered: only the scattered cases catch it
    assert not check.slot_mapping(lambda t, bs, s, e: [t[0] * bs + i for i in range(s, e)])
    assert "block_table[t // block_size]" in capsys.readouterr().out


def test_max_held_names_each_mistake(capsys):
    from kvlab.capstone import max_held
    from kvlab.validate import cdiv

    assert check.max_held(max_held)
    assert not check.max_held(stub)
    assert "the answer is" not in capsys.readouterr().out

    def greedy(own, start, order=sorted, strict=False):
        def fn(lengths, shared, cap, bs):
            used, held = start(shared, bs), 0
            for n in order([own(x, shared, bs) for x in lengths]):
                if used + n > cap or (strict and used + n == cap):
                    break
                used, held = used + n, held + 1
            return held
        return fn

    right = lambda x, s, bs: cdiv(x, bs) - s // bs  # noqa: E731
    for fn, words in [(greedy(lambda x, s, bs: cdiv(x, bs), lambda s, bs: 0), "store them once, not once per request"),
                      (greedy(right, lambda s, bs: 0), "count them once"),
                      (greedy(right, lambda s, bs: s // bs, order=list), "shortest first"),
                      (greedy(right, lambda s, bs: s // bs, strict=True), "still fits"),
                      (greedy(lambda x, s, bs: cdiv(x, bs) - cdiv(s, bs), lambda s, bs: cdiv(s, bs)), "only full blocks"),
                      (greedy(lambda x, s, bs: (x - s) / bs, lambda s, bs: s / bs), "whole blocks")]:
        assert not check.max_held(fn)
        assert words in capsys.readouterr().out


def test_max_held_rejects_bad_input():
    from kvlab.capstone import max_held

    with pytest.raises(ValueError, match="block_size"):
        max_held([20], 0, 4, 0)
    with pytest.raises(ValueError, match="lengths"):
        max_held([10], 16, 4)  # shorter than the shared prompt every request begins with
    with pytest.raises(ValueError, match="num_blocks"):
        max_held([10], 0, -1)
    assert max_held([], 0, 4) == 0


def test_quantize_per_head_and_pack_int4(capsys):
    import torch

    from kvlab.quant import core

    assert check.quantize_per_head(lambda x: core.int8_roundtrip(x, "per-head"))

    def truncating(x):  # the classic bug: truncation instead of round-half-to-even
        s = core.scale_from_absmax(core.absmax(x, "per-head"))
        return torch.clamp(torch.trunc(x / s), -127, 127).to(torch.int8), s

    assert not check.quantize_per_head(truncating)
    assert not check.quantize_per_head(stub)
    assert check.pack_int4(core.pack_int4)
    assert not check.pack_int4(lambda q: q[..., 1::2] | (q[..., 0::2] << 4))  # nibbles swapped
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["[ok]", "[fail]", "[todo]", "[ok]", "[fail]"]
    assert all(len(line) < 600 for line in out)  # tensors are summarised, not dumped

    def half_away(x):  # rounds ties away from zero: the checker's tie case tells it apart, and says so
        s = core.scale_from_absmax(core.absmax(x, "per-head"))
        r = x / s
        return (r.sign() * (r.abs() + 0.5).floor()).clamp(-127, 127).to(torch.int8), s

    def per_tensor(x):  # one scale for every head
        s = torch.full((1, x.shape[1], 1), max(float(x.abs().max()), 1e-6) / 127)
        return torch.round(x / s).clamp(-127, 127).to(torch.int8), s

    assert not check.quantize_per_head(half_away)
    assert "half away from zero" in capsys.readouterr().out
    assert not check.quantize_per_head(per_tensor)
    assert "whole tensor" in capsys.readouterr().out


def test_mla_bytes_per_token_names_the_mistakes_that_matter(capsys):
    assert check.mla_bytes_per_token(lambda L, H, r, rope, b: L * (r + rope) * b)
    assert sizing.mla_token_bytes(61, 512, 64, 2) == sizing.kv_bytes_per_token("deepseek-v3", "fp16") == 70272
    wrong = {
        "K and V are not stored separately": lambda L, H, r, rope, b: 2 * L * (r + rope) * b,
        "not per head": lambda L, H, r, rope, b: L * H * (r + rope) * b,
        "shared by all heads": lambda L, H, r, rope, b: L * (r + H * rope) * b,
        "RoPE key is cached too": lambda L, H, r, rope, b: L * r * b,
    }
    capsys.readouterr()
    for why, fn in wrong.items():
        assert not check.mla_bytes_per_token(fn)
        out = capsys.readouterr().out
        assert out.startswith("[fail]") and why in out, out
    assert not check.mla_bytes_per_token(stub)
    assert capsys.readouterr().out.startswith("[todo]")


def test_blocks_after_fork_agrees_with_the_block_manager(capsys):
    def right(p, bs, n, steps):
        if steps == 0:
            return -(-p // bs)
        return p // bs + n * (-(-(p + steps) // bs) - p // bs)

    assert check.blocks_after_fork(right)
    no_sharing = lambda p, bs, n, steps: n * -(-(p + steps) // bs)  # noqa: E731
    no_copy = lambda p, bs, n, steps: -(-p // bs) + n * (-(-(p + steps) // bs) - -(-p // bs))  # noqa: E731
    capsys.readouterr()
    assert not check.blocks_after_fork(no_sharing)
    assert "share the prompt's full blocks" in capsys.readouterr().out
    assert not check.blocks_after_fork(no_copy)
    assert "copy-on-write" in capsys.readouterr().out
    extra_copy = lambda p, bs, n, steps: right(p, bs, n, steps) + (1 if steps and p % bs else 0)  # noqa: E731
    assert not check.blocks_after_fork(extra_copy)
    assert "n - 1 copies" in capsys.readouterr().out
    fresh_blocks = lambda p, bs, n, steps: -(-p // bs) + n * -(-steps // bs)  # noqa: E731  (copies nothing)
    assert not check.blocks_after_fork(fresh_blocks)
    out = capsys.readouterr().out
    assert "partial last block first" in out and "n - 1 copies" not in out
    copies_without_writes = lambda p, bs, n, steps: right(p, bs, n, max(steps, 1))  # noqa: E731
    assert not check.blocks_after_fork(copies_without_writes)
    assert "nobody writes" in capsys.readouterr().out
    assert not check.blocks_after_fork(stub)


def test_quantize_static_catches_a_missing_or_asymmetric_clamp(capsys):
    import torch

    from kvlab.quant import core

    assert check.quantize_static(core.quantize_int8)
    capsys.readouterr()
    mistakes = {
        "wrapped around": lambda x, s: torch.round(x / s).to(torch.int8),  # no clamp: int8 wraps
        "-128 appears": lambda x, s: torch.clamp(torch.round(x / s), -128, 127).to(torch.int8),
        "truncation: round half to even": lambda x, s: torch.clamp(torch.trunc(x / s), -127, 127).to(torch.int8),
        "torch.int8": lambda x, s: torch.clamp(torch.round(x / s), -127, 127),  # still float
        "a widened scale": lambda x, s: core.quantize_int8(x, torch.maximum(s, x.abs().amax(dim=(0, 2), keepdim=True)
                                                                          / 127)),  # not "wrapped around"
    }
    for why, fn in mistakes.items():
        assert not check.quantize_static(fn)
        out = capsys.readouterr().out
        assert out.startswith("[fail]") and why in out, out
    # the per-head exercise cannot catch a missing clamp (its own abs-max never exceeds 127):
    # this exercise exists because the static one can
    no_clamp = lambda x: (torch.round(x / core.scale_from_absmax(core.absmax(x, "per-head"))).to(torch.int8),  # noqa: E731
                          core.scale_from_absmax(core.absmax(x, "per-head")))
    assert check.quantize_per_head(no_clamp)


def test_pack_int4_stub_does_not_give_the_answer_away():
    import json
    from pathlib import Path

    nb = json.loads((Path(__file__).resolve().parent.parent / "notebooks" / "03_int8_quantization.ipynb").read_text())
    stub_src = next("".join(c["source"]) for c in nb["cells"] if "def pack_int4" in "".join(c["source"]))
    assert "<<" not in stub_src and "0::2" not in stub_src


def test_admission_rule(capsys):
    from kvlab.engine.scheduler import admission_rule as ref

    assert check.admission_rule(ref)
    assert capsys.readouterr().out.startswith("[ok] admission_rule")
    assert not check.admission_rule(stub)
    todo = capsys.readouterr().out
    assert todo.startswith("[todo] admission_rule") and "answer" not in todo  # the stub is not told an answer

    def zero_only(r, m, budget, n, f, w):  # "no tokens left" read as exactly 0: a negative budget slips through
        return "token budget" if budget == 0 else ref(r, m, budget, n, f, w) if budget > 0 else None
    assert not check.admission_rule(zero_only)
    assert "can be negative" in capsys.readouterr().out

    def no_alone_exception(r, m, b, n, f, w):  # keeps the watermark even with nothing running
        return "token budget" if b <= 0 else "seq limit" if r >= m else "no blocks" if n > f - w else None

    assert not check.admission_rule(no_alone_exception)
    out = capsys.readouterr().out
    assert "For num_running=0, max_num_seqs=4, budget_left=5, blocks_needed=10" in out
    assert out.startswith("[fail] admission_rule: with nothing running") and "the watermark does not apply" in out

    def blocks_before_seats(r, m, b, n, f, w):  # right reasons, wrong order
        if b <= 0:
            return "token budget"
        if n > f - (w if r else 0):
            return "no blocks"
        return "seq limit" if r >= m else None

    assert not check.admission_rule(blocks_before_seats)
    out = capsys.readouterr().out
    assert "expected 'seq limit'" in out and "several reasons hold here" in out, out

    def alone_admits_anything(r, m, b, n, f, w):  # "when alone, admit whatever it needs"
        if b <= 0:
            return "token budget"
        if r >= m:
            return "seq limit"
        return None if r == 0 else "no blocks" if n > f - w else None

    assert not check.admission_rule(alone_admits_anything)
    out = capsys.readouterr().out
    assert "blocks_needed=12, blocks_free=10" in out and "only the watermark is waived" in out


@pytest.mark.triton
def test_online_softmax_update(capsys):
    from kvlab.kernels.decode import online_softmax_update

    @triton.jit
    def no_rescale(m, l, acc, s, v, v_scale):  # forgets to shrink the old state when the max grows
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s - m_new[:, None])
        return m_new, l + tl.sum(p, axis=1), acc + tl.sum((p * v_scale[None, :])[:, :, None] * v[None, :, :], axis=1)

    @triton.jit
    def todo(m, l, acc, s, v, v_scale):
        raise NotImplementedError("write the update")

    @triton.jit
    def no_max(m, l, acc, s, v, v_scale):  # exp of the raw scores: overflows at scores near 100
        m_new = tl.maximum(m, tl.max(s, axis=1))
        p = tl.exp(s)
        pv = p * v_scale[None, :]
        return m_new, l + tl.sum(p, axis=1), acc + tl.sum(pv[:, :, None] * v[None, :, :], axis=1)

    @triton.jit
    def scale_in_l(m, l, acc, s, v, v_scale):  # sums the scaled P into l
        m_new = tl.maximum(m, tl.max(s, axis=1))
        alpha = tl.exp(m - m_new)
        pv = tl.exp(s - m_new[:, None]) * v_scale[None, :]
        return m_new, l * alpha + tl.sum(pv, axis=1), acc * alpha[:, None] + tl.sum(pv[:, :, None] * v[None, :, :], axis=1)

    @triton.jit
    def tile_max(m, l, acc, s, v, v_scale):  # the running max from this tile alone: right while the max only grows
        m_new = tl.max(s, axis=1)
        alpha = tl.exp(m - m_new)
        p = tl.exp(s - m_new[:, None])
        pv = p * v_scale[None, :]
        return m_new, l * alpha + tl.sum(p, axis=1), acc * alpha[:, None] + tl.sum(pv[:, :, None] * v[None, :, :], axis=1)

    def not_jitted(m, l, acc, s, v, v_scale):  # right maths, but a plain Python function
        return online_softmax_update.fn(m, l, acc, s, v, v_scale)

    assert check.online_softmax_update(online_softmax_update)
    assert not check.online_softmax_update(no_rescale)
    assert not check.online_softmax_update(todo)
    out = capsys.readouterr().out.splitlines()
    assert [line.split()[0] for line in out] == ["[ok]", "[fail]", "[todo]"]
    assert "shrink by alpha" in out[1] and "tensor(16, 32)" not in out[2]  # the mistake named; no answer revealed
    assert not check.online_softmax_update(no_max)
    assert "subtract the running max" in capsys.readouterr().out
    assert not check.online_softmax_update(scale_in_l)
    assert "l sums the unscaled" in capsys.readouterr().out
    assert not check.online_softmax_update(tile_max)
    assert "must keep the old one" in capsys.readouterr().out
    assert not check.online_softmax_update(not_jitted)
    assert "@triton.jit" in capsys.readouterr().out


# ---- progress across notebooks ---------------------------------------------------------------------


def test_progress_records_the_learners_function_only(capsys):
    from kvlab import sizing

    check.progress(reset=True)
    # kvlab's own reference, wrapped to the exercise's signature as notebook 00 runs it: not the learner's pass
    assert check.kv_token_bytes(lambda L, H, kvh, D, hidden, b: sizing.kv_token_bytes(L, kvh, D, b))
    assert check.progress()["kv_token_bytes"] is None

    def kv_token_bytes(num_layers, num_heads, num_kv_heads, head_dim, hidden_size, bytes_per_element):
        return 2 * num_layers * num_kv_heads * head_dim * bytes_per_element

    assert check.kv_token_bytes(kv_token_bytes)
    done = check.progress()
    assert done["kv_token_bytes"] is not None and sum(v is not None for v in done.values()) == 1
    assert f"exercises passed: 1 of {len(check.EXERCISES)}" in capsys.readouterr().out


def test_progress_ignores_failures_and_resets(capsys):
    check.progress(reset=True)
    assert not check.kv_token_bytes(lambda *a: 0)

    def slot_mapping(block_table, block_size, start, end):
        return [block_table[t // block_size] * block_size + t % block_size for t in range(start, end)]

    assert check.slot_mapping(slot_mapping)
    assert check.progress()["slot_mapping"] is not None and check.progress()["kv_token_bytes"] is None
    assert all(v is None for v in check.progress(reset=True).values())
    assert not check.progress_file().exists()


def test_progress_survives_a_corrupt_file_and_an_unwritable_folder(tmp_path, monkeypatch, capsys):
    check.progress_file().write_text("{half-writ")
    assert all(v is None for v in check.progress().values())  # starts over instead of failing

    def slot_mapping(block_table, block_size, start, end):
        return [block_table[t // block_size] * block_size + t % block_size for t in range(start, end)]

    blocker = tmp_path / "a-file"
    blocker.write_text("x")
    monkeypatch.setenv("KVLAB_PROGRESS", str(blocker / "progress.json"))
    assert check.slot_mapping(slot_mapping)  # still passes; says why it could not save
    assert "progress not saved" in capsys.readouterr().out


def test_progress_knows_every_notebooks_exercise():
    import json
    from pathlib import Path

    nb_dir = Path(__file__).resolve().parent.parent / "notebooks"
    calls = set()
    for path in nb_dir.glob("*.ipynb"):
        for cell in json.loads(path.read_text())["cells"]:
            if cell["cell_type"] == "code":
                import re

                calls |= set(re.findall(r"check\.(\w+)\(", "".join(cell["source"])))
    assert calls - {"progress", "use", "solution"} == set(check.EXERCISES)


def test_thinking_exercises_do_not_show_an_answer_while_unsolved(capsys):
    for checker in (check.mla_bytes_per_token, check.grow, check.decode_loop, check.static_write, check.blocks_after_fork, check.quantize_static):
        assert not checker(stub)
        out = capsys.readouterr().out
        assert out.startswith("[todo]") and "the answer is" not in out, out
    assert not check.kv_token_bytes(stub)  # the warm-up too: its answer is what the learner works out
    assert "the answer is" not in capsys.readouterr().out


def test_checkers_name_the_mistakes_the_notebooks_warn_about(capsys):
    """Notebooks 01-03: the mistake the text itself warns about gets its worded hint."""
    from kvlab.quant.core import int8_roundtrip

    cases = [
        (check.slot_mapping, lambda t, bs, s, e: [t[i // bs] + i % bs for i in range(s, e)], "x block_size"),
        (check.quantize_per_head, lambda x: (int8_roundtrip(x)[0].float(), int8_roundtrip(x)[1]), "must be torch.int8"),
        (check.quantize_static, lambda x, sc: int8_roundtrip(x)[0], "scale computed from x"),
        (check.pack_int4, lambda q: q[..., 1::2] | (q[..., 0::2] << 4), "nibbles are swapped"),
        (check.pack_int4, lambda q: (q[..., 0::2] | (q[..., 1::2] << 4)).to(torch.int8), "torch.uint8"),
    ]
    for checker, wrong, words in cases:
        assert not checker(wrong)
        assert words in capsys.readouterr().out, words

    def guard_at_zero_only(x):  # the text says < 1e-6, not == 0
        a = x.abs().amax(dim=(0, 2), keepdim=True)
        s = torch.where(a == 0, torch.ones_like(a), a / 127)
        return torch.round(x / s).clamp(-127, 127).to(torch.int8), s

    assert not check.quantize_per_head(guard_at_zero_only)
    assert "below 1e-6" in capsys.readouterr().out


def test_sinks_window_blocks(capsys):
    from kvlab.check.evict import kept_after
    from kvlab.validate import cdiv

    assert check.sinks_window_blocks(kept_after)
    assert capsys.readouterr().out.startswith("[ok] sinks_window_blocks")

    def stub(*a):
        raise NotImplementedError

    assert not check.sinks_window_blocks(stub)
    assert "[todo]" in capsys.readouterr().out

    def formula(n, bs, budget, sinks, sink_blocks=None, window=None, positions=False, span=cdiv):
        total, b = span(n, bs), budget // bs
        s = cdiv(sinks, bs) if sink_blocks is None else sink_blocks(sinks, bs)
        keep = list(range(total)) if total <= b else sorted(set(range(min(s, total))) | set(
            range(total - ((b - s) if window is None else window(b, s)), total)))
        return [p for lb in keep for p in range(lb * bs, min(n, lb * bs + bs))] if positions else keep

    assert check.sinks_window_blocks(formula)
    capsys.readouterr()
    for wrong, why in [(lambda *a: formula(*a, sink_blocks=lambda s, bs: s), "ceil(sinks / block_size) blocks"),
                       (lambda *a: formula(*a, window=lambda b, s: b - s + 1), "the block being written counts"),
                       (lambda *a: formula(*a, positions=True), "not token positions"),
                       (lambda *a: formula(*a, span=lambda n, bs: n // bs), "partly filled last block")]:
        assert not check.sinks_window_blocks(wrong)
        assert why in capsys.readouterr().out


def test_copy_or_recompute(capsys):
    from kvlab.engine.fleet import GPU_FLOPS, LINKS, tier_projection
    from kvlab.check.evict import copy_and_recompute
    from kvlab.sizing import kv_config

    # the reference is tier_projection's arithmetic: 4 blocks of 16 tokens = 64 tokens
    p = tier_projection(4, 64, "llama-3-8b", block_size=16)
    copy_s, recompute_s = copy_and_recompute(64, kv_config("llama-3-8b"), LINKS["PCIe 4.0 x16"], GPU_FLOPS[1])
    assert math.isclose(copy_s, p["links"]["PCIe 4.0 x16"]["seconds"]) and math.isclose(recompute_s, p["recompute_s"])
    assert check.copy_or_recompute(copy_and_recompute)
    assert capsys.readouterr().out.startswith("[ok] copy_or_recompute")

    def stub(*a):
        raise NotImplementedError

    assert not check.copy_or_recompute(stub)
    out = capsys.readouterr().out
    assert "[todo]" in out and "answer is" not in out  # a task to work out: the [todo] line reveals nothing

    def planted(tokens, cfg, link, flops, kv=2, nbytes=2, all_heads=False, flop_factor=2, layers=True, swap=False,
                per_token_only=False):
        heads = cfg.num_heads if all_heads else cfg.num_kv_heads
        per_token = kv * (cfg.num_layers if layers else 1) * heads * cfg.head_dim * nbytes
        out = (tokens * per_token / link, flop_factor * cfg.num_params * tokens / flops)
        out = out if per_token_only is False else (per_token / link, out[1])
        return out[::-1] if swap else out

    for wrong, why in [(lambda *a: planted(*a, kv=1), "K and V"), (lambda *a: planted(*a, nbytes=4), "2 bytes"),
                       (lambda *a: planted(*a, all_heads=True), "num_kv_heads"),
                       (lambda *a: planted(*a, layers=False), "layers"),
                       (lambda *a: planted(*a, flop_factor=6), "training"),
                       (lambda *a: planted(*a, flop_factor=1), "2 FLOPs"), (lambda *a: planted(*a, swap=True), "order"),
                       (lambda *a: planted(*a, per_token_only=True), "multiply the bytes per token by tokens")]:
        assert not check.copy_or_recompute(wrong)
        assert why in capsys.readouterr().out, why
