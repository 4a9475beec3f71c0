"""Notebook 01's build tasks: each checker passes kvlab's reference, names the planted mistakes, and the
reference plugged into the real cache through the notebook's own call gives HF generate()'s tokens."""

import pytest
import torch

from kvlab import check
from kvlab.cache import ContiguousCache, StaticCache
from kvlab.cache.naive import grow, static_write
from kvlab.generate import Stepper, cached_generate, greedy_generate, hf_generate


def stub(*args):
    raise NotImplementedError


def test_grow_checker(capsys):
    assert check.grow(grow)
    assert not check.grow(stub)
    assert capsys.readouterr().out.splitlines()[-1].startswith("[todo]")
    mistakes = {
        "tokens are dim 2": lambda old, new: new if old is None else torch.cat([old, new], dim=-1),
        "not only the new ones": lambda old, new: new,
        "old tokens first": lambda old, new: new if old is None else torch.cat([new, old], dim=2),
        "finds no cache (None)": lambda old, new: torch.cat([old, new], dim=2),
    }
    for why, fn in mistakes.items():
        assert not check.grow(fn)
        out = capsys.readouterr().out
        assert out.startswith("[fail]") and why in out, out


def test_decode_loop_checker(capsys):
    assert check.decode_loop(cached_generate)

    def refeeds_everything(step, prompt, n):
        seq, out = list(prompt), []
        for _ in range(n):
            out.append(int(step(seq).argmax()))
            seq = seq + out[-1:]
        return out

    def feeds_the_last(step, prompt, n):
        logits, out = step(list(prompt)), []
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = step([out[-1]])
        return out

    def no_prefill(step, prompt, n):
        out = []
        for t in prompt:
            logits = step([t])
        for _ in range(n):
            out.append(int(logits.argmax()))
            logits = step([out[-1]])
        return out[:n]

    for why, fn in {"feeds ONE token": refeeds_everything, "never fed back": feeds_the_last,
                    "prefill first": no_prefill}.items():
        capsys.readouterr()
        assert not check.decode_loop(fn)
        out = capsys.readouterr().out
        assert out.startswith("[fail] decode_loop: " + "") and why in out, out
        assert out.index(why) < out.index("yours")  # the hint comes before the printout


def test_static_write_checker(capsys):
    assert check.static_write(static_write)

    def whole_reservation(buf, new, start):
        buf[:new.shape[0], :, start:start + new.shape[2]] = new
        return buf[:new.shape[0]]

    def only_new(buf, new, start):
        buf[:new.shape[0], :, start:start + new.shape[2]] = new
        return buf[:new.shape[0], :, start:start + new.shape[2]]

    def copies(buf, new, start):
        out = buf.clone()
        out[:new.shape[0], :, start:start + new.shape[2]] = new
        return out[:new.shape[0], :, :start + new.shape[2]]

    def returns_a_copy(buf, new, start):  # the right values, but a fresh tensor: "return a view" says otherwise
        buf[:new.shape[0], :, start:start + new.shape[2]] = new
        return buf[:new.shape[0], :, :start + new.shape[2]].clone()

    def every_row(buf, new, start):  # writes the new tokens into the rows past the batch too (broadcast)
        buf[:, :, start:start + new.shape[2]] = new
        return buf[:new.shape[0], :, :start + new.shape[2]]

    def every_reserved_row(buf, new, start):
        buf[:new.shape[0], :, start:start + new.shape[2]] = new
        return buf[:, :, :start + new.shape[2]]

    for why, fn in {"return only the filled slots": whole_reservation, "not only the new ones": only_new,
                    "into the reserved buffer itself": copies, "not a copy: .clone()": returns_a_copy,
                    "of the first B rows (the new tokens' batch)": every_row,
                    "the batch's own rows (the first B)": every_reserved_row}.items():
        capsys.readouterr()
        assert not check.static_write(fn)
        out = capsys.readouterr().out
        assert out.startswith("[fail]") and why in out, out
    assert not check.static_write(stub)
    out = capsys.readouterr().out
    assert out.startswith("[todo]") and "the answer is" not in out


def test_the_tasks_plugged_into_the_real_cache_give_hf_tokens(tiny):
    """The calls notebook 01 makes with the participant's functions, here with the references."""
    model, _ = tiny
    prompt = [[5, 17, 3, 9, 11]]
    ref = hf_generate(model, prompt, 10)
    store = ContiguousCache.from_model(model, append=grow)
    from kvlab.hf import KVLabCache

    assert hf_generate(model, prompt, 10, cache=KVLabCache(store)) == ref
    step = Stepper(model, ContiguousCache.from_model(model, append=grow))
    assert cached_generate(step, prompt[0], 10) == ref[0]
    assert (step.calls, step.forwards) == (10, 5 + 9)  # one prefill + 9 one-token steps
    prompts = [[5, 17, 3], [9, 11, 2, 8, 4, 6]]
    dyn = greedy_generate(model, prompts, 8)
    static = StaticCache.from_model(model, max_batch=3, max_seq_len=20, write=static_write)
    assert greedy_generate(model, prompts, 8, cache=static).token_ids == dyn.token_ids


def test_a_wrong_function_plugged_in_fails_loudly(tiny):
    model, _ = tiny
    with pytest.raises(TypeError, match="append must be a function"):
        ContiguousCache.from_model(model, append="cat")
    store = ContiguousCache.from_model(model, append=lambda old, new: new)  # forgets the old tokens
    with pytest.raises(ValueError, match=r"append returned \(1, \d+, 1, \d+\), expected a tensor of shape"):
        cached_generate(Stepper(model, store), [5, 6, 7], 3)
    static = StaticCache.from_model(model, max_batch=2, max_seq_len=12,
                                    write=lambda buf, new, start: buf[:new.shape[0]])  # the whole reservation
    with pytest.raises(ValueError, match="write returned"):
        greedy_generate(model, [[5, 6, 7]], 3, cache=static)
    with pytest.raises(TypeError, match="store must be a kvlab store"):
        Stepper(model, object())
