"""The seven verdict rules of the claims table (notebook 06): a verdict is computed, never typed in.

Each rule turns a claimed figure and our measurement into one of ``holds``, ``off by N×``,
``wrong`` or ``not settled (...)``:

* :func:`ratio` — a number: ``holds`` within a tolerance, else ``off by N×``;
* :func:`in_range` — a range: ``holds`` inside it, else ``off by N×`` from the nearer end;
* :func:`truth` — a statement (an ordering, "fits", "is faster"): ``holds`` or ``wrong``;
* :func:`cost_range` — a claimed cost range measured with noise (an interval): ``holds`` when they
  overlap, ``off by N×`` when we measure more, ``not settled`` when we measure less on a smaller model;
* :func:`shown` — a claimed gain: ``wrong`` when the bytes cannot allow it, ``holds`` when our run
  reaches it, ``not settled`` when the bytes allow it and our run did not reach it;
* :func:`margin` — "it fits" / "it does not fit" against a limit, ``not settled`` within a margin;
* :func:`readings` — a sentence that reads two ways (the words allow a weak and a strong claim):
  ``holds`` when both readings hold, ``wrong`` when neither does, ``not settled (ambiguous ...)``
  when only the weak one does. The table does not pick the reading that suits a verdict.

:func:`corrected` says whether a verdict corrects the article: ``not settled`` is neither a
confirmation nor a correction, the lab's measurement cannot decide it.

**One rule for claims about another model or another workload** (a 7B on an A100, a chat service's
traffic, a GPU's utilization). Where arithmetic settles such a claim (bytes, FLOPs, what fits, a
formula, the article's own numbers against each other) it is judged like any other and holds or
fails. Where only a measurement could settle it, and the lab can measure only SmolLM2, its own
workloads or a quantity next to the claimed one (seat occupancy for GPU utilization, next-token
agreement for task accuracy), the verdict is ``not settled`` and says what the lab saw: "(holds on
SmolLM2)", "(does not hold on SmolLM2)", "(off by 2.0× on SmolLM2)", "(in range on this workload)"
(:func:`elsewhere`). A
general rule stated for every model or workload ("keys matter more than values", "p99.9 beats
abs-max") is judged on SmolLM2 as one instance: a counterexample makes it wrong, an agreement lets
it hold. A format claim that leaves its scales unstated is judged with the leanest
scale layout in common use (one fp16 scale per 128 values).
"""

from __future__ import annotations

from collections import Counter
from contextlib import contextmanager

HOLDS = "holds"
UNSETTLED = "not settled"

_calls: list[dict] | None = None  # while recording(): every rule called, with the tolerance it applied


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


def ratio(claimed: float, measured: float, tol: float = 0.15) -> str:
    """``holds`` when claimed and measured agree within ``tol`` (relative), else ``off by N×``."""
    if claimed <= 0 or measured <= 0:
        raise ValueError(f"ratio needs positive numbers, got claimed={claimed!r}, measured={measured!r}")
    _note("ratio", f"within ±{tol:.0%} of the claimed figure" if tol else "equal to the claimed figure")
    r = max(claimed, measured) / min(claimed, measured)
    return HOLDS if r <= 1 + tol else f"off by {r:.1f}×" + (f" (±{tol:.0%} allowed)" if tol else "")


def in_range(lo: float, hi: float, measured: float, tol: float = 0.0) -> str:
    """``holds`` when ``lo <= measured <= hi`` (widened by ``tol``), else ``off by N×`` from the nearer
    end; a measurement <= 0 against a positive range is ``wrong``."""
    if not 0 < lo <= hi:
        raise ValueError(f"need 0 < lo <= hi, got lo={lo!r}, hi={hi!r}")
    _note("in_range", f"in [{_g(lo)}, {_g(hi)}]" + (f" ±{tol:.0%}" if tol else ""))
    if lo * (1 - tol) <= measured <= hi * (1 + tol):
        return HOLDS
    if measured <= 0:
        return "wrong"
    off = f"off by {(lo / measured if measured < lo else measured / hi):.1f}×"
    return off + (f" (±{tol:.0%} allowed)" if tol else "")


def truth(ok: bool) -> str:
    """A statement (an ordering, "fits", "is faster"): ``holds`` when it is true, else ``wrong``."""
    _note("truth", "true or false (no tolerance)")
    return HOLDS if ok else "wrong"


def cost_range(lo: float, hi: float, measured: float, interval: tuple[float, float]) -> str:
    """A claimed cost (e.g. +0.5-1.5 % perplexity) against our measurement and its noise interval:
    ``holds`` when the interval meets [lo, hi]; ``off by N×`` when all of it lies above hi (we measure
    a bigger cost); ``not settled`` when all of it lies below lo (a smaller cost, measured on a smaller
    model and text, cannot refute a floor claimed for another)."""
    if not 0 < lo <= hi:
        raise ValueError(f"need 0 < lo <= hi, got lo={lo!r}, hi={hi!r}")
    a, b = sorted(interval)
    _note("cost_range", f"the measured interval must meet [{_g(lo)}, {_g(hi)}]")
    if b >= lo and a <= hi:
        return HOLDS
    if a > hi:
        return f"off by {measured / hi:.1f}×"
    return f"{UNSETTLED} (below the claimed range, on another model)"


def shown(possible: bool, reached: bool) -> str:
    """A claimed gain: ``wrong`` if the bytes rule it out, ``holds`` if our measurement reaches it,
    ``not settled`` if it is possible but our run did not show it."""
    _note("shown", "allowed by the bytes, and reached by the lab's run")
    if not possible:
        return "wrong"
    return HOLDS if reached else f"{UNSETTLED} (possible, not reproduced)"


def margin(value: float, limit: float, slack: float = 0.10) -> str:
    """Claim "value exceeds limit": ``holds`` above it, ``wrong`` more than ``slack`` below it,
    ``not settled`` within the slack (borderline: the answer depends on what else must fit)."""
    _note("margin", f"above the limit; within {slack:.0%} below it: borderline")
    if value > limit:
        return HOLDS
    if value < limit * (1 - slack):
        return "wrong"
    return f"{UNSETTLED} (borderline: within {slack:.0%} of the limit)"


def readings(weak: bool, strong: bool, weak_says: str, strong_says: str) -> str:
    """A sentence with two readings, ``weak_says`` and ``strong_says`` (each true or not as measured):
    ``holds`` when both hold, ``wrong`` when neither does, else ``not settled (ambiguous: ...)``
    naming the reading that holds and the one that does not."""
    _note("readings", f"both readings must hold: {weak_says}; {strong_says}")
    if weak and strong:
        return HOLDS
    if not weak and not strong:
        return "wrong"
    good, bad = (weak_says, strong_says) if weak else (strong_says, weak_says)
    return f"{UNSETTLED} (ambiguous: it holds if it means {good}, not if it means {bad})"


def elsewhere(verdict: str, seen_on: str = "SmolLM2", claimed_for: str = "another model") -> str:
    """A verdict measured on ``seen_on`` for a claim made for ``claimed_for``, where arithmetic cannot
    carry it over: ``not settled``, saying what the lab saw (the rule above)."""
    _note("elsewhere", f"measured on {seen_on}, claimed for {claimed_for}: not settled either way")
    if verdict.startswith(UNSETTLED):
        return verdict
    # one verdict, said once: "holds", "does not hold", or by how much it is off ("off by 2.0×")
    seen = {HOLDS: "holds", "wrong": "does not hold"}.get(verdict, verdict)
    return f"{UNSETTLED} ({seen} on {seen_on})"


def summarize(calls: list[dict]) -> tuple[str, str]:
    """(rule, tolerance) of one row from the rules its measurement applied: each distinct rule once
    (x N when applied N times), their tolerances joined; ("none", ...) when no rule was applied."""
    if not calls:
        return "none", "no rule was applied: the verdict was not computed"
    times = Counter(c["rule"] for c in calls)  # in first-use order
    rule = ", ".join(f"{n} x{k}" if k > 1 else n for n, k in times.items())
    return rule, "; ".join(dict.fromkeys(c["tolerance"] for c in calls))


def corrected(verdict: str) -> bool:
    """Off or wrong: the notebook corrects the article. ``not settled`` is not a correction."""
    return verdict != HOLDS and not verdict.startswith(UNSETTLED)
