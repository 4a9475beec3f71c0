"""Notebook 04's exercise: the scheduler's admission rule."""

from __future__ import annotations

from typing import Callable


from kvlab.engine.dry_run import dry_run
from kvlab.engine.scheduler import admission_rule as ref_admission_rule
from kvlab.check.progress import _record


def admission_rule(fn: Callable[[int, int, int, int, int, int], "str | None"]) -> bool:
    """``fn(num_running, max_num_seqs, budget_left, blocks_needed, blocks_free, watermark_blocks)`` ->
    the reason the head of the queue waits ("token budget", "seq limit", "no blocks"), or None to admit.

    Checked on single decisions first (shown with argument names), then plugged into a real
    scheduler: the trace of a whole dry run (kvlab.engine.dry_run) must equal the one kvlab's own
    rule produces.
    """
    if not callable(fn):
        raise TypeError(f"admission_rule: pass your function itself, got {type(fn).__name__}")
    names = ("num_running", "max_num_seqs", "budget_left", "blocks_needed", "blocks_free", "watermark_blocks")
    cases = [(0, 4, 16, 3, 10, 1), (4, 4, 16, 1, 10, 1), (2, 4, 0, 1, 10, 1), (2, 4, 5, 9, 10, 1),
             (2, 4, 5, 10, 10, 1), (1, 4, 5, 10, 10, 1), (0, 4, 5, 10, 10, 1), (3, 4, -1, 1, 1, 0), (1, 1, 8, 0, 0, 0), (1, 8, 8, 2, 2, 0),
             (4, 4, 0, 20, 10, 1), (4, 4, 5, 20, 10, 1), (3, 4, 0, 20, 10, 1),  # these three: several reasons hold
             (0, 4, 16, 12, 10, 1)]  # alone, and more than the free blocks: only the watermark is waived
    for args in cases:
        call = ", ".join(f"{n}={v}" for n, v in zip(names, args))
        try:
            got = fn(*args)
        except NotImplementedError:
            print(f"[todo] admission_rule: not written yet - {len(cases)} decisions (the first: {call}) and a "
                  "scheduler trace wait for it")
            return False
        except Exception as e:  # noqa: BLE001 - the learner's bug, shown rather than raised
            print(f"[fail] admission_rule({call}) raised {type(e).__name__}: {e}")
            return False
        want = ref_admission_rule(*args)
        if got != want:
            r, _, _, n, f, w = args
            hint = ""
            if r == 0 and want == "no blocks" and got is None:
                hint = (" - alone, only the watermark is waived: a request needing more blocks than are free still "
                        "waits (admitting it would break the pool)")
            elif r == 0 and want is None and got == "no blocks" and n <= f:
                hint = " - with nothing running there is nobody to preempt, so the watermark does not apply"
            elif args[2] < 0 and want == "token budget":
                hint = " - budget_left can be negative (a step's budget overdrawn): no tokens left means <= 0"
            elif got not in ("token budget", "seq limit", "no blocks", None):
                hint = " - return one of 'token budget', 'seq limit', 'no blocks', or None to admit"
            print(f"[fail] admission_rule({call}): yours {got!r}, expected {want!r}{hint}")
            return False
    workload = [(9, 3), (30, 6, 1), (5, 12), (14, 2, 3), (3, 9, 3), (22, 4, 6), (6, 6, 6), (11, 5, 9)]
    kw = dict(num_blocks=11, block_size=4, max_num_seqs=3, max_num_batched_tokens=12, watermark=0.1)  # every kind of event
    expected = [(e.step, e.seq_id, e.action, e.reason) for e in dry_run(workload, **kw)[0].trace]
    try:
        got = [(e.step, e.seq_id, e.action, e.reason) for e in dry_run(workload, rule=fn, **kw)[0].trace]
    except Exception as e:  # noqa: BLE001 - a rule that deadlocks or breaks the pool
        print(f"[fail] admission_rule: the scheduler with your rule failed: {type(e).__name__}: {e}")
        return False
    if got != expected:
        i = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        print(f"[fail] admission_rule: single decisions match, but the traces differ at event {i}: "
              f"yours {got[i] if i < len(got) else 'nothing'}, expected {expected[i] if i < len(expected) else 'nothing'}")
        return False
    print(f"[ok] admission_rule: {len(cases)} decisions and a {len(expected)}-event scheduler trace match")
    _record("admission_rule", fn)
    return True
