"""Running the claims table (notebook 06, ``kvlab claims``): measure every claim with one shared
:class:`~kvlab.claims.lab.Lab`, count the verdicts, and print the table in full, by line or by verdict.
"""

from __future__ import annotations

import html
import sys
import textwrap

from kvlab.claims.catalog import CLAIMS
from kvlab.claims.lab import Lab
from kvlab.claims.rules import HOLDS, NOT_CHECKABLE, PARTLY, VERDICTS, WRONG, detail, recording, summarize


def run(lab: Lab | None = None, ids=None, progress=None) -> list[dict]:
    """Measure every claim (or those in ``ids``) and judge it. One dict per claim, in table order.
    ``progress``: ``True`` for a progress bar (tqdm: a widget in a notebook, stderr elsewhere), or a function
    called with each claim's id before it is measured."""
    if not (progress is None or isinstance(progress, bool) or callable(progress)):
        raise TypeError(f"progress must be True, False, None or a function of a claim id, got {progress!r}")
    progress = progress or None
    known = {c.id for c in CLAIMS}
    if ids is not None and (unknown := sorted(set(ids) - known)):
        raise ValueError(f"unknown claim id(s) {unknown}: choose from {sorted(known)}")
    lab = lab or Lab()
    todo = [x for x in CLAIMS if ids is None or x.id in ids]
    if progress is True:  # a bar naming the claim being measured (a few take seconds, most nothing)
        from tqdm.auto import tqdm  # loads only when a bar is asked for
        todo = bar = tqdm(todo, desc="claims", unit="claim", file=sys.stderr)
        progress = bar.set_postfix_str
    rows = []
    for c in todo:
        if progress is not None:
            progress(c.id)
        with recording() as calls:
            measured, verdict, why = c.measure(lab)
        assert verdict in VERDICTS, f"claim {c.id!r} measured a verdict {verdict!r}: a rule returns one of {VERDICTS}"
        rule, tolerance = summarize(calls)
        condition = detail(verdict)  # by how much, which part, on what: the why's first clause
        rows.append(dict(id=c.id, article=c.article, where=c.where, claim=c.text, measured=measured,
                         verdict=str(verdict), why=f"{condition}; {why}" if condition else why, rule=rule,
                         tolerance=tolerance, notebook=c.notebook, section=c.section, quote=c.quote))
    return rows


def counts(rows: list[dict]) -> dict:
    """How many rows: in all (``claims``), and under each of the four verdict words."""
    return {"claims": len(rows), **{v: sum(r["verdict"] == v for r in rows) for v in VERDICTS}}


def count_line(rows: list[dict]) -> str:
    """The counts in one line: "70 claims: 30 hold, 9 partly, 25 wrong, 6 not checkable here"."""
    c = counts(rows)
    return (f"{c['claims']} claims: {c[HOLDS]} hold, {c[PARTLY]} partly, {c[WRONG]} wrong, "
            f"{c[NOT_CHECKABLE]} not checkable here")


MARKS = {HOLDS: "✓", PARTLY: "~", WRONG: "✗", NOT_CHECKABLE: "?"}


def format_index(rows: list[dict], width: int = 110) -> str:
    """The whole table at a glance: one line per claim, cut to ``width``."""
    out = []
    for i, r in enumerate(rows, 1):
        line = f"{i:>2}. {MARKS[r['verdict']]} {r['article']} {r['where']:<11} {r['claim']}"
        tail = f"  [{r['verdict']}]"
        if len(line) + len(tail) > width:
            line = line[:width - len(tail) - 1] + "…"
        out.append(line + tail)
    return "\n".join(out)


def format_table(rows: list[dict], width: int = 64, brief: bool = False, numbers: list[int] | None = None) -> str:
    """The table as plain text, one block per claim. ``brief`` drops rule and section (a notebook's own
    rows, printed where they are checked); ``numbers``: the rows' places in the whole table."""
    if numbers is not None and len(numbers) != len(rows):
        raise ValueError(f"numbers must give one number per row ({len(rows)}), got {len(numbers)}")
    out = []
    for i, r in zip(numbers or range(1, len(rows) + 1), rows):
        quote = f" 「{r['quote']}」" if r.get("quote") else ""
        out.append(f"{i:>2}. {MARKS[r['verdict']]} [{r['article']} {r['where']}{quote}] {r['claim']}")
        parts = [("measured", r["measured"]), ("verdict", f"{r['verdict']} — {r['why']}")]
        if not brief:
            parts += [("rule", f"{r['rule']}: {r['tolerance']}"), ("see", f"notebook {r['notebook']}, “{r['section']}”")]
        for label, text in parts:
            out.append(textwrap.fill(text, width + 14, initial_indent=f"      {label:<9}",
                                     subsequent_indent=" " * 15))
    out.append(count_line(rows))
    return "\n".join(out)


def format_grouped(rows: list[dict], width: int = 110) -> str:
    """One line per claim under its verdict word and count; lines keep their numbers in the table."""
    out = []
    for v in VERDICTS:
        group = [(i, r) for i, r in enumerate(rows, 1) if r["verdict"] == v]
        if not group:
            continue
        out.append(f"{MARKS[v]} {v}: {len(group)}")
        lines = format_index([r for _, r in group], width=width - 2).splitlines()
        for (i, _), line in zip(group, lines):
            out.append(f"  {i:>2}." + line.split(".", 1)[1])
    out.append(count_line(rows))
    return "\n".join(out)


def format_verdicts(rows: list[dict], why: bool = True) -> str:
    """One line per claim, as a notebook shows the claims it checks (its quote is in the notebook's text):
    mark, article and section, the claim, the verdict word and why (``why=False``: no why, it is shown folded)."""
    return "\n".join(f"{MARKS[r['verdict']]} {r['article']} {r['where']} \"{r['claim']}\": {r['verdict'].upper()}"
                     + (f" — {r['why']}" if why else "") for r in rows)


def why_html(rows: list[dict]) -> str:
    """What each row measured and why its verdict, folded (an HTML ``<details>``: one click opens them)."""
    e = html.escape
    items = "".join(f"<li><b>{e(r['article'])} {e(r['where'])}, {e(r['verdict'])}</b>. Measured: {e(r['measured'])}. "
                    f"Why: {e(r['why'])}</li>" for r in rows)
    return (f"<details><summary style='cursor:pointer;color:#566573'>what was measured, and why each verdict "
            f"({len(rows)})</summary><ul style='margin:4px 0'>{items}</ul></details>")


def show(ids, lab: Lab | None = None) -> list[dict]:
    """Judge the claims ``ids`` by the same rules as ``kvlab claims`` and print one verdict line each; in a
    notebook what was measured and why follow folded (:func:`why_html`), elsewhere the why is printed. Returns
    the rows."""
    if isinstance(ids, str):
        ids = [ids]
    rows = run(lab, ids=list(ids))
    try:
        from IPython import get_ipython  # a kernel shows the reasons folded; a terminal prints them
        from IPython.display import HTML, display
    except ImportError:
        get_ipython = None
    if get_ipython is not None and get_ipython() is not None:
        print(format_verdicts(rows, why=False))
        display(HTML(why_html(rows)))
    else:
        print(format_verdicts(rows))
    return rows
