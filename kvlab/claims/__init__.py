"""Every numeric claim of the three source articles, measured (notebook 06).

A claim is the article's sentence, where it says it, and a function that measures it **now**: from
kvlab's byte arithmetic, its simulators, or SmolLM2 on this machine (small, fast settings). The
verdict is computed from that measurement by a rule (:mod:`kvlab.claims.rules`), never typed in,
and is one of four words:

* ``holds``: the measurement agrees with the claim, within the rule's tolerance;
* ``partly``: one part or one reading of the sentence holds and another does not, or a cost is real
  but smaller than claimed, or a fit is borderline;
* ``wrong``: the measurement contradicts it (``why`` says by how much);
* ``not checkable here``: only hardware or a system the lab cannot run could settle it (a speed-up
  the bytes allow on a GPU), and nothing cheaper refutes it.

Each row's ``why`` opens with the condition: by how much, which part, on what it was measured.

**The one rule for claims about another model, GPU or workload** (a 7B on an A100, a chat
service's traffic, a GPU's utilization): arithmetic on the sizes and the datasheets settles what it
can (bytes, FLOPs, what fits, the article's own numbers against each other), and such a verdict
holds or fails like any other. What only a measurement could settle is measured on what the lab
runs (SmolLM2, this CPU, the lab's workloads, or the nearest quantity it can see: seat occupancy
for GPU utilization, next-token agreement for task accuracy) and judged on that, the ``why``
saying so ("on SmolLM2 (claimed for a 7B)"). A claimed gain is never ``holds`` from an upper bound
alone: the bytes can refute it, only a run can confirm it. Where neither the bytes refute it nor
a run of ours can reach it, it is ``not checkable here``.

Each claim also names the notebook section that measures it at full size. Run the table with
``claims.format_table(claims.run())`` (or ``claims.run(lab, ids=[...])`` for some claims, with a
:class:`Lab` over a model already loaded); ``kvlab claims`` prints the same table the notebook shows,
``kvlab claims --json`` the rows and counts, ``--only ID,ID`` some of them.

The package, one idea per module: :mod:`~kvlab.claims.rules` (the verdict rules),
:mod:`~kvlab.claims.lab` (the SmolLM2 measurements, made once and shared),
:mod:`~kvlab.claims.catalog` (the :class:`Claim` table) with its measuring functions by topic in
:mod:`~kvlab.claims.memory`, :mod:`~kvlab.claims.serving`, :mod:`~kvlab.claims.quality` and
:mod:`~kvlab.claims.arithmetic`, and :mod:`~kvlab.claims.table` (run, count, print).

The three articles, by the number the table gives them: **000** "lightweight inference engine:
KV-cache quantization and continuous batching", **003** "KV Cache: how it works and production
optimizations", **004** "KVCache-TurboQuant" (INT8 per-head KV cache with calibrated scales).
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
