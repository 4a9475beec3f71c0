"""Every numeric claim of the three source articles, measured (notebook 06).

A claim is the article's sentence, where it says it, and a function that measures it **now**: from
kvlab's byte arithmetic, its simulators, or SmolLM2 on this machine (small, fast settings). The
verdict is computed from that measurement by one of seven rules (:mod:`kvlab.claims.rules`), never
typed in:

* :func:`ratio` — a number: ``holds`` within a tolerance, else ``off by N×``;
* :func:`in_range` — a range: ``holds`` inside it, else ``off by N×`` from the nearer end;
* :func:`truth` — a statement (an ordering, "fits", "is faster"): ``holds`` or ``wrong``;
* :func:`cost_range` — a claimed cost range measured with noise (an interval): ``holds`` when they
  overlap, ``off by N×`` when we measure more, ``not settled`` when we measure less on a smaller model;
* :func:`shown` — a claimed gain: ``wrong`` when the bytes cannot allow it, ``holds`` when our run
  reaches it, ``not settled`` when the bytes allow it and our run did not reach it;
* :func:`margin` — "it fits" / "it does not fit" against a limit, ``not settled`` within a margin.

``not settled`` is neither a confirmation nor a correction: the lab's measurement cannot decide it.

Each claim also names the notebook section that measures it at full size. Run the table with
``claims.format_table(claims.run())`` (or ``claims.run(lab, ids=[...])`` for some claims, with a
:class:`Lab` over a model already loaded); ``kvlab claims`` prints the same table the notebook shows,
``kvlab claims --json`` the rows and counts, ``--only ID,ID`` some of them.

The package, one idea per module: :mod:`~kvlab.claims.rules` (the verdict rules),
:mod:`~kvlab.claims.lab` (the SmolLM2 measurements, made once and shared),
:mod:`~kvlab.claims.catalog` (the :class:`Claim` table) with its measuring functions by topic in
:mod:`~kvlab.claims.memory`, :mod:`~kvlab.claims.serving` and :mod:`~kvlab.claims.quality`, and
:mod:`~kvlab.claims.table` (run, count, print).

The three articles, by the number the table gives them: **000** "lightweight inference engine:
KV-cache quantization and continuous batching", **003** "KV Cache: how it works and production
optimizations", **004** "KVCache-TurboQuant" (INT8 per-head KV cache with calibrated scales).
"""

from kvlab.claims.catalog import CLAIMS, Claim
from kvlab.claims.lab import Lab
from kvlab.claims.memory import A100_BW, A100_BYTES, GiB, KiB
from kvlab.claims.rules import HOLDS, UNSETTLED, corrected, cost_range, in_range, margin, ratio, shown, truth
from kvlab.claims.table import counts, format_index, format_table, run

__all__ = ["A100_BW", "A100_BYTES", "CLAIMS", "Claim", "GiB", "HOLDS", "KiB", "Lab", "UNSETTLED", "corrected",
           "cost_range", "counts", "format_index", "format_table", "in_range", "margin", "ratio", "run", "shown", "truth"]
