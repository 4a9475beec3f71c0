"""Every numeric claim of the three source articles, measured now (notebook 06).

A rule (:mod:`kvlab.claims.rules`), never a typed-in word, turns each measurement into ``holds``,
``partly``, ``wrong`` or ``not checkable here``. **The one rule** for a claim about another model, GPU or
workload: arithmetic settles what it can; the rest is measured on what the lab runs and judged on that,
the ``why`` saying so. A claimed gain never ``holds`` from an upper bound alone: only a run confirms it.
The articles: **000** "lightweight inference engine: KV-cache quantization and continuous batching",
**003** "KV Cache: how it works and production optimizations", **004** "KVCache-TurboQuant".
"""

from kvlab.claims.catalog import CLAIMS, Claim
from kvlab.claims.lab import Lab
from kvlab.claims.memory import A100_BW, A100_BYTES, GiB, KiB
from kvlab.claims.rules import (HOLDS, NOT_CHECKABLE, PARTLY, VERDICTS, WRONG, corrected, cost_range, in_range,
                                beyond_lab, judged_on, margin, parts, ratio, shown, truth)
from kvlab.claims.table import (count_line, counts, format_grouped, format_index, format_table, format_verdicts, run,
                                show, why_html)

__all__ = ["A100_BW", "A100_BYTES", "CLAIMS", "Claim", "GiB", "HOLDS", "KiB", "Lab", "NOT_CHECKABLE", "PARTLY",
           "VERDICTS", "WRONG", "corrected", "cost_range", "count_line", "counts", "format_grouped", "format_index",
           "format_table", "format_verdicts", "in_range", "judged_on", "margin", "parts", "ratio", "run", "show", "shown",
           "truth", "why_html"]
