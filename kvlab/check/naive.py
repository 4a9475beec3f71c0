"""Notebook 01's build tasks, each then plugged into the real cache and an unmodified HF model."""

from __future__ import annotations

import random
from typing import Callable

import torch

from kvlab.cache.naive import grow as ref_grow
from kvlab.cache.naive import static_write as ref_static_write
from kvlab.check.core import run_task, tensor_same
from kvlab.generate import cached_generate


def _kv(b, h, t, d, seed):
    return torch.randn(b, h, t, d, generator=torch.Generator().manual_seed(seed))


def grow(fn: Callable) -> bool:
    """``fn(cached, new) -> cached then new along the token axis``; ``cached`` is None at the first append."""
    first = _kv(1, 2, 3, 4, 0)
    cases = [((None, first), first)]
    for b, h, t, q, d, seed in ((1, 2, 3, 1, 4, 1), (2, 3, 5, 2, 4, 2), (1, 2, 4, 4, 8, 3)):
        old, new = _kv(b, h, t, d, seed), _kv(b, h, q, d, seed + 10)
        cases.append(((old, new), ref_grow(old, new)))
    def hint(args, got, expected):
        old, new = args
        if not isinstance(got, torch.Tensor):
            return "return one tensor: the layer's whole cache after the append"
        if old is None:
            return "the first append finds no cache (None): the new tokens are the whole cache"
        if got.shape == new.shape:
            return "return the whole cache, old tokens and new, not only the new ones: attention reads all of it"
        if got.shape == expected.shape and torch.equal(got, torch.cat([new, old], dim=2)):
            return "old tokens first: position t of the cache must be token t of the sequence"
        for dim, name in ((0, "the batch"), (1, "the KV heads"), (3, "the head dimension")):
            if got.shape[dim] == old.shape[dim] + new.shape[dim] and got.shape[2] == old.shape[2]:
                return f"dim {dim} is {name}; tokens are dim 2 of (B, H_kv, T, D)"
        return None
    def raised(old, new):
        try:
            return fn(old, new)
        except TypeError as e:
            if old is None:
                raise TypeError(f"the first append finds no cache (None): the new tokens are the whole cache ({e})") from e
            raise
        except RuntimeError as e:
            if "must match" in str(e):
                raise RuntimeError(f"tokens are dim 2 of (B, H_kv, T, D): concatenate along it ({e})") from e
            raise
    return run_task("grow", raised, cases, same=tensor_same, hint=hint, learner=fn)


class _ToyModel:
    """A stand-in model whose logits depend on every token it was fed, so feeding a token twice or skipping
    the prompt changes the next token, as in the real model."""

    def __init__(self, vocab: int = 64):
        self.vocab, self.history, self.calls = vocab, [], []

    def __call__(self, token_ids):
        if isinstance(token_ids, torch.Tensor):
            token_ids = token_ids.flatten().tolist()
        if isinstance(token_ids, int):
            token_ids = [token_ids]
        token_ids = [int(t) for t in token_ids]
        self.calls.append(token_ids)
        self.history += token_ids
        rng = random.Random(hash(tuple(self.history)))
        return torch.tensor([rng.random() for _ in range(self.vocab)])


def decode_loop(fn: Callable) -> bool:
    """``fn(step, prompt_ids, new_tokens) -> new ids``, greedy; ``step(tokens)`` gives the last logits."""
    shapes = [([5, 9, 2], 1), ([3, 1, 4, 1, 5], 4), ([7], 6), (list(range(20)), 3)]
    cases = [((p, n), (cached_generate(toy := _ToyModel(), p, n), toy.calls)) for p, n in shapes]  # kvlab's loop
    def run(prompt, n):
        toy = _ToyModel()
        got = fn(toy, list(prompt), n)
        got = got.flatten().tolist() if isinstance(got, torch.Tensor) else got
        return (list(got) if isinstance(got, (list, tuple)) else got), toy.calls
    def hint(args, got, expected):
        (prompt, n), (tokens, calls), (want, want_calls) = args, got, expected
        if not isinstance(tokens, list):
            return "return a list of the new token ids"
        if not calls or calls[0] != list(prompt):
            return "prefill first: the first step takes the whole prompt, once"
        if len(tokens) != n:
            return f"return exactly new_tokens ids ({n} here)"
        if any(len(c) > 1 for c in calls[1:]):
            return "with a cache each step feeds ONE token, the one just chosen: the cache already holds the rest"
        if len(calls) == len(want_calls) + 1:
            return "the last token is chosen, never fed back: there is no step after it"
        if len(calls) < len(want_calls):
            return "each new token except the last must be fed back, or the model never sees it"
        if calls[1:] != want_calls[1:]:
            return "feed back the token you just chose (the argmax of the last step's logits)"
        return "choose greedily: the id with the largest logit"
    return run_task("decode_loop", run, cases, hint=hint, learner=fn)


def static_write(fn: Callable) -> bool:
    """``fn(buffer, new, start) -> view of the filled slots``, writing ``new`` into ``buffer`` in place; the
    view must share the buffer's memory (a copy passes the values but allocates every step)."""
    shapes = [((2, 2, 8, 4), 1, 0, 3), ((2, 2, 8, 4), 2, 3, 1), ((3, 1, 6, 2), 3, 5, 1), ((2, 2, 8, 4), 1, 0, 8)]
    cases = []
    for i, (shape, b, start, q) in enumerate(shapes):
        buf = _kv(*shape, 20 + i)  # the reserved buffer: old contents before start, garbage after
        new = _kv(b, shape[1], q, shape[3], 30 + i)
        want = buf.clone()
        view = ref_static_write(want, new, start)
        cases.append(((buf, new, start), (view.clone(), want)))
    def run(buf, new, start):
        buf = buf.clone()  # each run writes into its own copy
        try:
            got = fn(buf, new, start)
        except RuntimeError as e:
            if "must match" in str(e) or "expand" in str(e):
                raise RuntimeError(f"write into the first B rows only, buffer[:B, :, start:start + q_len], B being new's "
                                   f"batch ({e})") from e
            raise
        return got, buf
    def hint(args, got, expected):
        buf, new, start = args
        view, written = got
        want_view, want_buf = expected
        if not isinstance(view, torch.Tensor):
            return "return the view of the filled slots (a tensor)"
        if not torch.equal(written, want_buf):
            if torch.equal(written, buf):
                return ("write into the reserved buffer itself (buffer[...] = new): a static cache never allocates, "
                        "the returned view must show the buffer's own memory")
            return "write at slots start .. start + q_len of the first B rows (the new tokens' batch), nowhere else"
        if tensor_same(view, want_view) and not _shares(view, written):
            return ("return a view of the buffer (a slice, buffer[:B, :, :start + q_len]), not a copy: .clone() "
                    "allocates at every step, which a static cache exists to avoid")
        if view.shape == new.shape:
            return "return every filled slot, from slot 0, not only the new ones: attention reads the whole sequence"
        if view.shape[2] == buf.shape[2]:
            return "return only the filled slots: past start + q_len the buffer holds nothing yet, and attention would read it"
        if view.shape[0] == buf.shape[0] != new.shape[0]:
            return "return the batch's own rows (the first B), not every reserved row"
        return None
    def same(got, expected):  # the right values, and in the buffer's own memory: a view, not a copy
        return tensor_same(got, expected) and _shares(*got)
    return run_task("static_write", run, cases, same=same, hint=hint, learner=fn)


def _shares(view, buffer) -> bool:
    """``view`` lies in ``buffer``'s memory (a slice of it), not in a copy."""
    return isinstance(view, torch.Tensor) and view.untyped_storage().data_ptr() == buffer.untyped_storage().data_ptr()
