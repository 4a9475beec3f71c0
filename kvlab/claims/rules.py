"""The verdict rules of the claims table (notebook 06): a verdict is computed, never typed in.

Each rule returns a :class:`Verdict`, a string equal to one of the four words that also carries
``detail``, the condition the row's ``why`` opens with, so a verdict word and its why cannot disagree.

One reading for every row (:data:`READING`, printed in notebook 06's fine print).
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

HOLDS, PARTLY, WRONG, NOT_CHECKABLE = "holds", "partly", "wrong", "not checkable here"
VERDICTS = (HOLDS, PARTLY, WRONG, NOT_CHECKABLE)

#: the one standard every row is read by
READING = (
    "an approximate figure (约 'about', ~, 基本 'basically') holds within ±15 % of the figure it qualifies, as "
    "any figure does; a format's bytes are judged on the leanest common layout of its scales (INT8: one per layer "
    "x KV head; INT4: an fp16 scale per 128 values, the grouping article 003 asks for), kvlab's own layout named "
    "beside it; a claim about a kind of model the lab cannot run (one trained with a sliding window) is not "
    "checkable here unless a run on the lab's model already shows it; any other claim about another model, GPU or "
    "workload is judged on what the lab measures, and its why says where")

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
    """The worst of figures that must all hold: ``wrong``, ``partly``, ``not checkable here``, ``holds``."""
    verdicts = list(verdicts) or [Verdict(HOLDS)]
    rank = {WRONG: 0, PARTLY: 1, NOT_CHECKABLE: 2, HOLDS: 3}
    return min(verdicts, key=lambda v: rank[str(v)])


@contextmanager
def recording():
    """Record the rules a measurement applies and their tolerances, so each row shows what it was held to."""
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
    """``holds`` within [lo, hi] (widened by ``tol``), else ``wrong``, off by N× from the nearer end."""
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
    """A noisy measured cost against a claimed [lo, hi]: ``wrong`` wholly above, ``partly`` wholly below
    (real but smaller), else ``holds``."""
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
    """A speed-up on hardware the lab cannot run: the bytes can refute it, only a measured run confirms it."""
    _note("shown", "allowed by the bytes, and reached by a measured run; allowed but not reached: not checkable here")
    if not possible:
        return Verdict(WRONG, "the bytes rule it out")
    if reached:
        return Verdict(HOLDS)
    return Verdict(NOT_CHECKABLE, f"the bytes allow it; only a run on {where} could show it")


def margin(value: float, limit: float, slack: float = 0.10) -> Verdict:
    """"value exceeds limit"; ``partly`` within ``slack`` below: the answer depends on what else must fit."""
    _note("margin", f"above the limit; within {slack:.0%} below it: partly")
    if value > limit:
        return Verdict(HOLDS)
    if value < limit * (1 - slack):
        return Verdict(WRONG, f"{_g(value / limit)} of the limit")
    return Verdict(PARTLY, f"borderline: within {slack:.0%} of the limit")


def parts(first: bool, second: bool, first_says: str, second_says: str) -> Verdict:
    """A sentence of two measured parts: ``partly`` when one holds, naming which."""
    _note("parts", f"both parts must hold: {first_says}; {second_says}")
    if first and second:
        return Verdict(HOLDS)
    if not first and not second:
        return Verdict(WRONG, f"neither {first_says} nor {second_says}")
    good, bad = (first_says, second_says) if first else (second_says, first_says)
    return Verdict(PARTLY, f"holds {good}, not {bad}")


def beyond_lab(shown_here: bool, failed_on: str, claimed_for: str) -> Verdict:
    """A claim about a kind of model the lab cannot run: a run on the lab's model can show it (``holds``); a
    run that fails there says nothing of the models claimed (``not checkable here``, naming where it failed)."""
    _note("beyond_lab", f"shown on the lab's model, or not checkable here (claimed for {claimed_for})")
    if shown_here:
        return Verdict(HOLDS)
    return Verdict(NOT_CHECKABLE, f"fails on {failed_on}, which is not what it is claimed for ({claimed_for})")


def judged_on(verdict: str, seen_on: str = "SmolLM2", claimed_for: str = "another model") -> Verdict:
    """The table's one rule: a verdict measured on ``seen_on`` for a claim about ``claimed_for``, said so."""
    _note("judged_on", f"measured on {seen_on}, claimed for {claimed_for}: judged on what the lab measures")
    said = f"on {seen_on} (claimed for {claimed_for})"
    return Verdict(str(verdict), f"{detail(verdict)}, {said}" if detail(verdict) else said)


def summarize(calls: list[dict]) -> tuple[str, str]:
    """One row's (rule, tolerance): each distinct rule once (x N), their tolerances joined."""
    if not calls:
        return "none", "no rule was applied: the verdict was not computed"
    times = Counter(c["rule"] for c in calls)  # in first-use order
    rule = ", ".join(f"{n} x{k}" if k > 1 else n for n, k in times.items())
    return rule, "; ".join(dict.fromkeys(c["tolerance"] for c in calls))


def corrected(verdict: str) -> bool:
    """``wrong`` or ``partly``: the notebook corrects the article (``not checkable here`` does not)."""
    return verdict in (WRONG, PARTLY)
