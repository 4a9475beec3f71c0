"""What the engine measures (notebook 04): per step and per request, and their percentiles.

Step time is split into the parts that compete for it: scheduling (scheduler and block manager),
packing (the ragged batch and its index tensors), forward (the model) and sampling.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

PARTS = ("schedule_s", "packing_s", "forward_s", "sample_s")


@dataclass
class StepStats:
    step: int
    running: int  # sequences holding blocks after scheduling
    waiting: int  # queued after scheduling
    scheduled: int  # sequences in this step's forward
    prefill_tokens: int
    decode_tokens: int
    blocks_used: int
    blocks_free: int  # free or evictable (cached) blocks
    preempted: int
    finished: int
    schedule_s: float
    packing_s: float
    forward_s: float
    sample_s: float

    @property
    def total_s(self) -> float:
        return self.schedule_s + self.packing_s + self.forward_s + self.sample_s


def percentile(values, q: float) -> float:
    """The q-th percentile (0..100) with linear interpolation; nan for no values."""
    xs = sorted(v for v in values if v is not None)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100
    lo, hi = math.floor(k), math.ceil(k)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def step_split(steps: list[StepStats]) -> dict:
    """Share of all step time spent in each part; ``scheduler_share`` is scheduling's share."""
    total = sum(s.total_s for s in steps) or float("nan")
    out = {p.removesuffix("_s") + "_share": sum(getattr(s, p) for s in steps) / total for p in PARTS}
    out["scheduler_share"] = out.pop("schedule_share")
    return out


def summarize(requests: list[dict], steps: list[StepStats], wall_s: float) -> dict:
    """Throughput and latency percentiles over finished requests (their ``metrics`` dicts)."""
    out_tokens = sum(r["output_tokens"] for r in requests)
    res = {"requests": len(requests), "output_tokens": out_tokens, "wall_s": wall_s,
           "output_tok_s": out_tokens / wall_s if wall_s > 0 else float("nan"), "steps": len(steps),
           "preemptions": sum(r["preemptions"] for r in requests)}
    for key in ("ttft_s", "tpot_s", "e2e_s", "queue_s"):
        name = key.removesuffix("_s")
        res[f"{name}_p50_s"] = percentile([r[key] for r in requests], 50)
        res[f"{name}_p99_s"] = percentile([r[key] for r in requests], 99)
    res["step_p50_s"] = percentile([s.total_s for s in steps], 50)
    res["step_p99_s"] = percentile([s.total_s for s in steps], 99)
    res.update(step_split(steps))
    return res
