"""What every checker shares: run the cases, print one stable line (with a hint on [fail]), record a pass."""

from __future__ import annotations

import inspect
from typing import Any, Callable, Sequence

import torch

from kvlab.check.kept import passed


def _short(obj) -> str:
    """A one-line picture of an argument or result: tensors as shape, dtype and first values."""
    if isinstance(obj, torch.Tensor):
        head = obj.flatten()[:6].tolist()
        head = [round(v, 4) if isinstance(v, float) else v for v in head]
        return f"tensor{tuple(obj.shape)} {str(obj.dtype).replace('torch.', '')} {head}{'...' if obj.numel() > 6 else ''}"
    if isinstance(obj, tuple):
        return "(" + ", ".join(_short(o) for o in obj) + ")"
    text = repr(obj)
    return text if len(text) <= 120 else text[:117] + "..."


def _arg_names(fn, n: int) -> list[str] | None:
    """The names of ``fn``'s first ``n`` parameters, when it takes exactly ``n`` positionally."""
    fn = getattr(fn, "fn", fn)  # a @triton.jit function keeps the Python one in .fn
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        return None
    positional = [p for p in params if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD)]
    if len(positional) != n or any(p.kind == p.VAR_POSITIONAL for p in params):
        return None
    return [p.name for p in positional]


def describe_call(args: tuple, *fns) -> str:
    """A failing case as the call reads: ``block_table=[3, 8], num_tokens=6``, named after the first of
    ``fns`` whose signature fits (the participant's own names are the task's), else the bare tuple."""
    for fn in fns:
        names = _arg_names(fn, len(args)) if fn is not None else None
        if names:
            return ", ".join(f"{n}={_short(a)}" for n, a in zip(names, args))
    return _short(args)


def _first_difference(got, expected) -> str:
    scalar = lambda xs: isinstance(xs, (list, tuple)) and all(isinstance(x, (int, float)) for x in xs)  # noqa: E731
    if scalar(got) and scalar(expected) and len(got) > 8:  # a long list of numbers: where it first goes wrong
        i = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        if i < len(expected) and i < len(got):
            return f" (first difference at index {i}: yours {got[i]}, expected {expected[i]})"
        return f" (yours has {len(got)} items, expected {len(expected)})" if len(got) != len(expected) else ""
    pairs = list(zip(got, expected)) if isinstance(expected, tuple) and isinstance(got, tuple) else [(got, expected)]
    for i, (a, b) in enumerate(pairs):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape:
            af, bf = a.float(), b.float()
            diff = ((af - bf).abs() > 1e-6 * (1 + bf.abs())) | (af.isnan() != bf.isnan())  # NaN differs too
            if diff.any():
                idx = tuple(int(j) for j in diff.nonzero()[0])
                where = f"item {i}, " if len(pairs) > 1 else ""
                return f" (first difference at {where}index {idx}: yours {a[idx].item()}, expected {b[idx].item()})"
    return ""


def run_task(name: str, fn: Callable, cases: Sequence[tuple[tuple, Any]], same=None, exercise: str | None = None,
         learner=None, hint: Callable | None = None) -> bool:
    """``hint(args, got, expected)`` may name a known mistake behind a failure (a string, or None).
    ``[todo]`` never shows an answer: the cases are the exercise (``check.solution`` prints kvlab's)."""
    if not callable(fn):
        raise TypeError(f"{name}: pass your function itself, got {type(fn).__name__}")
    exercise = exercise or name
    same = same or (lambda a, b: a == b)
    for args, expected in cases:
        try:
            got = fn(*args)
        except NotImplementedError:
            print(f"[todo] {name}: not written yet - the checker will name the usual mistakes")
            return False
        except Exception as e:  # the learner's bug, shown rather than raised
            print(f"[fail] {name}: your function raised {type(e).__name__}: {e}. For {describe_call(args, fn, learner)}")
            return False
        if not same(got, expected):
            try:
                why = hint(args, got, expected) if hint else None
            except Exception:  # a hint must never hide the verdict
                why = None
            # the hint first (what to try next), then the case and the two results
            print(f"[fail] {name}: " + (f"{why}. " if why else "") + f"For {describe_call(args, fn, learner)}: yours {_short(got)}, "
                  f"expected {_short(expected)}{_first_difference(got, expected)}")
            return False
    print(f"[ok] {name}: {len(cases)} cases match")
    passed(exercise, learner if learner is not None else fn)
    return True

def tensor_same(a, b) -> bool:
    if isinstance(b, tuple):
        return isinstance(a, tuple) and len(a) == len(b) and all(tensor_same(x, y) for x, y in zip(a, b))
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return False
    if b.dtype.is_floating_point:
        return bool(torch.allclose(a.float(), b.float(), rtol=1e-6, atol=1e-12))
    return a.dtype == b.dtype and bool(torch.equal(a, b))
