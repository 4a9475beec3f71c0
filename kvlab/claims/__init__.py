"""Every numeric claim of the three source articles, measured now (notebook 06).

A claim is the article's sentence, where it says it, and a function that measures it from kvlab's
byte arithmetic, its simulators or SmolLM2 on this machine. A rule (:mod:`kvlab.claims.rules`), never
a typed-in word, turns the measurement into ``holds``, ``partly`` (one part or reading holds, or a
cost is real but smaller), ``wrong`` (``why`` says by how much) or ``not checkable here`` (only
hardware the lab cannot run could settle it, and nothing cheaper refutes it).

**The one rule for claims about another model, GPU or workload**: arithmetic on sizes and datasheets
settles what it can, like any other verdict. What only a measurement could settle is measured on
what the lab runs (SmolLM2, this CPU, or the nearest quantity it can see) and judged on that, the
``why`` saying so ("on SmolLM2 (claimed for a 7B)"). A claimed gain is never ``holds`` from an upper
bound alone: the bytes can refute it, only a run can confirm it.

``claims.format_table(claims.run())`` prints the table (``kvlab claims`` too). The articles: **000**
"lightweight inference engine: KV-cache quantization and continuous batching", **003** "KV Cache:
how it works and production optimizations", **004** "KVCache-TurboQuant".
"""

from kvlab.claims.catalog import CLAIMS, Claim
from kvlab.claims.lab import Lab
from kvlab.claims.memory import A100_BW, A100_BYTES, GiB, KiB
from kvlab.claims.rules import (HOLDS, NOT_CHECKABLE, PARTLY, VERDICTS, WRONG, corrected, cost_range, in_range,
                                judged_on, margin, parts, ratio, shown, truth)
from kvlab.claims.table import count_line, counts, format_grouped, format_index, format_table, run

__all__ = ["A100_BW", "A100_BYTES", "CLAIMS", "Claim", "GiB", "HOLDS", "KiB", "Lab", "NOT_CHECKABLE", "PARTLY",
           "VERDICTS", "WRONG", "corrected", "cost_range", "count_line", "counts", "format_grouped", "format_index",
           "format_table", "in_range", "judged_on", "margin", "parts", "ratio", "run", "shown", "truth"]
