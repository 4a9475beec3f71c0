"""The claims table as a widget (notebooks 00, 03, 05, 06, 07): each row's verdict, the article's words,
what was measured and why, in one scrollable table instead of pages of printed text. The rows are
``kvlab.claims.run``'s, unchanged: the same rules judge them as in ``kvlab claims``."""

from __future__ import annotations

import html

from kvlab.claims.rules import HOLDS, NOT_CHECKABLE, PARTLY, WRONG
from kvlab.claims.table import MARKS, count_line

COLORS = {HOLDS: "#1e8449", PARTLY: "#b9770e", WRONG: "#c0392b", NOT_CHECKABLE: "#7f8c8d"}
_CELL = "padding:4px 8px;vertical-align:top;border-bottom:1px solid #e5e7e9"


def claims_html(rows: list[dict], numbers: list[int] | None = None) -> str:
    """An HTML table of ``rows`` (``claims.run``'s dicts): #, verdict, claim, measured, why, then the count
    line; ``numbers``: the rows' places in the whole table (default 1, 2, ...)."""
    if numbers is not None and len(numbers) != len(rows):
        raise ValueError(f"numbers must give one number per row ({len(rows)}), got {len(numbers)}")
    e = html.escape
    head = "".join(f"<th style='{_CELL};text-align:left'>{h}</th>" for h in ("#", "verdict", "claim", "measured", "why"))
    body = []
    for i, r in zip(numbers or range(1, len(rows) + 1), rows):
        v = r["verdict"]
        quote = f"<div style='color:#7f8c8d;font-size:90%'>「{e(r['quote'])}」</div>" if r.get("quote") else ""
        body.append(
            f"<tr><td style='{_CELL}'>{i}</td>"
            f"<td style='{_CELL};color:{COLORS[v]};white-space:nowrap'><b>{MARKS[v]} {e(v)}</b></td>"
            f"<td style='{_CELL};min-width:16em'><span style='color:#7f8c8d'>{e(r['article'])} {e(r['where'])}</span> "
            f"{e(r['claim'])}{quote}</td>"
            f"<td style='{_CELL};min-width:12em'>{e(r['measured'])}</td>"
            f"<td style='{_CELL};min-width:16em'>{e(r['why'])}</td></tr>")
    return (f"<table style='border-collapse:collapse;font-size:13px;line-height:1.35'><thead><tr>{head}</tr></thead>"
            f"<tbody>{''.join(body)}</tbody></table><p style='margin:6px 0'><b>{e(count_line(rows))}</b></p>")


def claims_widget(rows: list[dict], numbers: list[int] | None = None, max_height: int = 440):
    """:func:`claims_html` in a scrollable box (a widget: ``display(claims_widget(rows))``)."""
    import ipywidgets as W  # loads only when a widget is built

    box = W.HTML(claims_html(rows, numbers))
    box.layout = W.Layout(max_height=f"{max_height}px", overflow="auto", border="1px solid #d5d8dc")
    return box
