"""The verdict rules of the claims table (notebook 06): a verdict is computed, never typed in.

Each rule returns a :class:`Verdict`, a string equal to ``holds``, ``partly``, ``wrong`` or ``not
checkable here`` that also carries ``detail``, the condition the row's ``why`` opens with. :func:`ratio`
(a number within a tolerance), :func:`in_range`, :func:`truth` (a statement), :func:`cost_range` (a
noisy cost: ``partly`` when all of it lies below the claim: real but smaller), :func:`shown` (a
speed-up on hardware the lab cannot run: ``wrong`` when the bytes rule it out, ``holds`` only from a
measured run, else ``not checkable here``), :func:`margin` ("it fits" against a limit), :func:`parts`
(a sentence of two measured parts) and :func:`judged_on` (a verdict measured on what the lab runs for
a claim about another model, GPU or workload: the one rule of :mod:`kvlab.claims`).
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

HOLDS, PARTLY, WRONG, NOT_CHECKABLE = "holds", "partly", "wrong", "not checkable here"
VERDICTS = (HOLDS, PARTLY, WRONG, NOT_CHECKABLE)

_calls: list[dict] | None = None  # while recording(): every rule called, with the tolerance it applied


class Verdict(str):
    """One of :data:`VERDICTS`, carrying ``detail``: the condition or the size of the miss, for ``why``."""

    def __new__(cls, word: str, detail: str = ""):
        if word not in VERDICTS:
            raise ValueError(f"verdict must be one of {VERDICTS}, got {word!r}")
        v = super().__new__(cls, word)
        v.detail = detail
        return v


def detail(verdict: str) -> str:
    """The detail a verdict carries ('' for a plain string)."""
    return getattr(verdict, "detail", "")


def worst(verdicts) -> Verdict:
    """The verdict of a claim whose figures must all hold (a table of figures): the worst of them, ``wrong``
    before ``partly`` before ``not checkable here`` before ``holds`` (the first of equals, with its detail)."""
    verdicts = list(verdicts) or [Verdict(HOLDS)]
    rank = {WRONG: 0, PARTLY: 1, NOT_CHECKABLE: 2, HOLDS: 3}
    return min(verdicts, key=lambda v: rank[str(v)])


@contextmanager
def recording():
    """Record which rules a measuring function applies, and with what tolerance or range: the table
    puts them in every row (fields ``rule`` and ``tolerance``), so a reader sees what a verdict was
    held to, pass or fail. Yields the list of ``{"rule", "tolerance"}`` calls."""
    global _calls
    outer, _calls = _calls, []
    try:
        yield _calls
    finally:
        _calls = outer


def _note(rule: str, tolerance: str) -> None:
    if _calls is not None:
        _calls.append({"rule": rule, "tolerance": tolerance})


def _g(x: float) -> str:
    return f"{x:.3g}"


def _off(r: float) -> str:
    return f"off by {r:.2f}×" if r < 1.95 else f"off by {r:.1f}×"


def ratio(claimed: float, measured: float, tol: float = 0.15) -> Verdict:
    """``holds`` when claimed and measured agree within ``tol`` (relative), else ``wrong`` (off by N×)."""
    if claimed <= 0 or measured <= 0:
        raise ValueError(f"ratio needs positive numbers, got claimed={claimed!r}, measured={measured!r}")
    _note("ratio", f"within ±{tol:.0%} of the claimed figure" if tol else "equal to the claimed figure")
    r = max(claimed, measured) / min(claimed, measured)
    if r <= 1 + tol:
        return Verdict(HOLDS)
    return Verdict(WRONG, _off(r) + (f" (±{tol:.0%} allowed)" if tol else ""))


def in_range(lo: float, hi: float, measured: float, tol: float = 0.0) -> Verdict:
    """``holds`` when ``lo <= measured <= hi`` (widened by ``tol``), else ``wrong``, off by N× from the
    nearer end (or of the wrong sign)."""
    if not 0 < lo <= hi:
        raise ValueError(f"need 0 < lo <= hi, got lo={lo!r}, hi={hi!r}")
    _note("in_range", f"in [{_g(lo)}, {_g(hi)}]" + (f" ±{tol:.0%}" if tol else ""))
    if lo * (1 - tol) <= measured <= hi * (1 + tol):
        return Verdict(HOLDS)
    if measured <= 0:
        return Verdict(WRONG, f"measured {_g(measured)}, not even positive")
    side = "below" if measured < lo else "above"
    off = _off(lo / measured if measured < lo else measured / hi)
    return Verdict(WRONG, f"{off} {side} the range" + (f" (±{tol:.0%} allowed)" if tol else ""))


def truth(ok: bool) -> Verdict:
    """A statement (an ordering, "fits", "is faster"): ``holds`` when it is true, else ``wrong``."""
    _note("truth", "true or false (no tolerance)")
    return Verdict(HOLDS if ok else WRONG)


def cost_range(lo: float, hi: float, measured: float, interval: tuple[float, float]) -> Verdict:
    """A claimed cost (e.g. +0.5-1.5 % perplexity) against our measurement and its noise interval:
    ``holds`` when the interval meets [lo, hi]; ``wrong`` when all of it lies above hi (a bigger cost);
    ``partly`` when all of it lies below lo (there is a cost, and it is smaller than claimed)."""
    if not 0 < lo <= hi:
        raise ValueError(f"need 0 < lo <= hi, got lo={lo!r}, hi={hi!r}")
    a, b = sorted(interval)
    _note("cost_range", f"the measured interval must meet [{_g(lo)}, {_g(hi)}]; below it: partly")
    if b >= lo and a <= hi:
        return Verdict(HOLDS)
    if a > hi:
        return Verdict(WRONG, f"{_off(measured / hi)} above the range")
    return Verdict(PARTLY, f"the whole interval [{_g(a)}, {_g(b)}] lies below the range: a smaller cost than claimed")


def shown(possible: bool, reached: bool, where: str = "the claimed GPU") -> Verdict:
    """A claimed speed-up on hardware the lab cannot run: ``wrong`` if the bytes rule it out, ``holds``
    if a measured run reaches it, else ``not checkable here`` (an upper bound alone never holds)."""
    _note("shown", "allowed by the bytes, and reached by a measured run; allowed but not reached: not checkable here")
    if not possible:
        return Verdict(WRONG, "the bytes rule it out")
    if reached:
        return Verdict(HOLDS)
    return Verdict(NOT_CHECKABLE, f"the bytes allow it; only a run on {where} could show it")


def margin(value: float, limit: float, slack: float = 0.10) -> Verdict:
    """Claim "value exceeds limit": ``holds`` above it, ``wrong`` more than ``slack`` below it,
    ``partly`` within the slack (borderline: the answer depends on what else must fit)."""
    _note("margin", f"above the limit; within {slack:.0%} below it: partly")
    if value > limit:
        return Verdict(HOLDS)
    if value < limit * (1 - slack):
        return Verdict(WRONG, f"{_g(value / limit)} of the limit")
    return Verdict(PARTLY, f"borderline: within {slack:.0%} of the limit")


def parts(first: bool, second: bool, first_says: str, second_says: str) -> Verdict:
    """A sentence of two measured parts: ``holds`` when both hold, ``wrong`` when neither does, else
    ``partly``, naming the part that holds and the one that does not."""
    _note("parts", f"both parts must hold: {first_says}; {second_says}")
    if first and second:
        return Verdict(HOLDS)
    if not first and not second:
        return Verdict(WRONG, f"neither {first_says} nor {second_says}")
    good, bad = (first_says, second_says) if first else (second_says, first_says)
    return Verdict(PARTLY, f"holds {good}, not {bad}")


def judged_on(verdict: str, seen_on: str = "SmolLM2", claimed_for: str = "another model") -> Verdict:
    """A verdict measured on ``seen_on`` for a claim made about ``claimed_for``, where arithmetic cannot
    carry it over: the same word, with the condition in its detail (the table's one rule)."""
    _note("judged_on", f"measured on {seen_on}, claimed for {claimed_for}: judged on what the lab measures")
    said = f"on {seen_on} (claimed for {claimed_for})"
    return Verdict(str(verdict), f"{detail(verdict)}, {said}" if detail(verdict) else said)


def summarize(calls: list[dict]) -> tuple[str, str]:
    """(rule, tolerance) of one row from the rules its measurement applied: each distinct rule once
    (x N when applied N times), their tolerances joined; ("none", ...) when no rule was applied."""
    if not calls:
        return "none", "no rule was applied: the verdict was not computed"
    times = Counter(c["rule"] for c in calls)  # in first-use order
    rule = ", ".join(f"{n} x{k}" if k > 1 else n for n, k in times.items())
    return rule, "; ".join(dict.fromkeys(c["tolerance"] for c in calls))


def corrected(verdict: str) -> bool:
    """``wrong`` or ``partly``: the notebook corrects the article (``not checkable here`` does not)."""
    return verdict in (WRONG, PARTLY)
