"""Running the claims table (notebook 06, ``kvlab claims``): measure, judge, count and print.

:func:`run` measures every claim of the catalog (or some of them) with one shared
:class:`~kvlab.claims.lab.Lab`; :func:`counts` says how many hold, are corrected or are not
settled; :func:`format_table` is the plain-text table the notebook and the CLI print, and
:func:`format_index` the same at one line per claim.
"""

from __future__ import annotations

import textwrap

from kvlab.claims.catalog import CLAIMS
from kvlab.claims.lab import Lab
from kvlab.claims.rules import HOLDS, UNSETTLED, recording, summarize


def run(lab: Lab | None = None, ids=None, progress=None) -> list[dict]:
    """Measure every claim (or those in ``ids``) and judge it. One dict per claim, in table order."""
    lab = lab or Lab()
    known = {c.id for c in CLAIMS}
    if ids is not None:
        unknown = sorted(set(ids) - known)
        if unknown:
            raise ValueError(f"unknown claim id(s) {unknown}: choose from {sorted(known)}")
    rows = []
    for c in CLAIMS:
        if ids is not None and c.id not in ids:
            continue
        if progress is not None:
            progress(c.id)
        with recording() as calls:
            measured, verdict, why = c.measure(lab)
        rule, tolerance = summarize(calls)
        rows.append(dict(id=c.id, article=c.article, where=c.where, claim=c.text, measured=measured, verdict=verdict,
                         why=why, rule=rule, tolerance=tolerance, notebook=c.notebook, section=c.section,
                         quote=c.quote))
    return rows


def counts(rows: list[dict]) -> dict:
    """How many claims hold, how many the lab corrects (off by N×, or wrong) and how many it cannot
    settle."""
    holds = sum(r["verdict"] == HOLDS for r in rows)
    unsettled = sum(r["verdict"].startswith(UNSETTLED) for r in rows)
    return {"claims": len(rows), "holds": holds, "corrected": len(rows) - holds - unsettled, "unsettled": unsettled,
            "off": sum(r["verdict"].startswith("off") for r in rows), "wrong": sum(r["verdict"] == "wrong" for r in rows)}


def _mark(verdict: str) -> str:
    return "✓" if verdict == HOLDS else "?" if verdict.startswith(UNSETTLED) else "✗"


def format_index(rows: list[dict], width: int = 110) -> str:
    """One line per claim: its number, mark, article and section, the claim in English and the verdict
    (cut to ``width``): the whole table at a glance; :func:`format_table` has every row in full."""
    out = []
    for i, r in enumerate(rows, 1):
        verdict = r["verdict"].split(" (")[0]  # the verdict's word; its reasons are in format_table
        line = f"{i:>2}. {_mark(r['verdict'])} {r['article']} {r['where']:<11} {r['claim']}"
        tail = f"  [{verdict}]"
        if len(line) + len(tail) > width:
            line = line[:width - len(tail) - 1] + "…"
        out.append(line + tail)
    return "\n".join(out)


def format_table(rows: list[dict], width: int = 64, brief: bool = False, numbers: list[int] | None = None) -> str:
    """The table as plain text: one block per claim (the notebook and the CLI print this).
    ``brief``: the claim, what was measured and the verdict with its reason (a notebook's own rows,
    printed where they are checked: rule and section are then known). ``numbers``: the rows' own
    numbers (e.g. their places in the whole table, as :func:`format_index` numbers them), else 1, 2, ..."""
    if numbers is not None and len(numbers) != len(rows):
        raise ValueError(f"numbers must give one number per row ({len(rows)}), got {len(numbers)}")
    out = []
    for i, r in zip(numbers or range(1, len(rows) + 1), rows):
        mark = _mark(r["verdict"])
        quote = f" 「{r['quote']}」" if r.get("quote") else ""
        out.append(f"{i:>2}. {mark} [{r['article']} {r['where']}{quote}] {r['claim']}")
        parts = [("measured", r["measured"]), ("verdict", f"{r['verdict']} — {r['why']}")]
        if not brief:
            parts += [("rule", f"{r['rule']}: {r['tolerance']}"), ("see", f"notebook {r['notebook']}, “{r['section']}”")]
        for label, text in parts:
            out.append(textwrap.fill(text, width + 14, initial_indent=f"      {label:<9}",
                                     subsequent_indent=" " * 15))
    c = counts(rows)
    out.append(f"{c['claims']} claims: {c['holds']} hold, {c['corrected']} corrected ({c['off']} off by a factor, "
               f"{c['wrong']} wrong), {c['unsettled']} not settled")
    return "\n".join(out)
