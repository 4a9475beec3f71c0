"""Notebook 04's build tasks: the scheduler's three rules (admission, decodes first with preemption,
chunked prefill), each then run by the real engine."""

from __future__ import annotations

from typing import Callable

from kvlab.engine.dry_run import dry_run
from kvlab.engine.scheduler import admission_rule as ref_admission_rule
from kvlab.engine.scheduler import chunk_prefills as ref_chunk_prefills
from kvlab.engine.scheduler import schedule_decodes as ref_schedule_decodes
from kvlab.check.core import run_task
from kvlab.check.kept import passed


def admission_rule(fn: Callable[[int, int, int, int, int, int], "str | None"]) -> bool:
    """``fn(num_running, max_num_seqs, budget_left, blocks_needed, blocks_free, watermark_blocks)`` ->
    why the queue's head waits ("token budget", "seq limit", "no blocks"), or None; then a whole dry run's
    trace must equal the one kvlab's own rule produces."""
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
            print(f"[todo] admission_rule: not written yet - {len(cases)} decisions and a scheduler trace wait for it")
            return False
        except Exception as e:  # noqa: BLE001 - the learner's bug, shown rather than raised
            print(f"[fail] admission_rule: your function raised {type(e).__name__}: {e}. For {call}")
            return False
        want = ref_admission_rule(*args)
        if got != want:
            r, m, b, n, f, w = args
            holds = {"token budget": b <= 0, "seq limit": r >= m, "no blocks": n > f - (w if r else 0)}
            hint = ""
            if r == 0 and want == "no blocks" and got is None:
                hint = ("alone, only the watermark is waived: a request needing more blocks than are free still "
                        "waits (admitting it would break the pool). ")
            elif r == 0 and want is None and got == "no blocks" and n <= f:
                hint = "with nothing running there is nobody to preempt, so the watermark does not apply. "
            elif args[2] < 0 and want == "token budget":
                hint = "budget_left can be negative (a step's budget overdrawn): no tokens left means <= 0. "
            elif r and want is None and got == "no blocks" and n == f - w:
                hint = ("needing exactly the blocks the watermark leaves (blocks_free - watermark_blocks) still fits: "
                        "wait only when blocks_needed is greater (>, not >=). ")
            elif r and want == "no blocks" and got is None and n <= f:
                hint = ("with others running, the watermark stays free for their next tokens: wait when blocks_needed "
                        "> blocks_free - watermark_blocks. ")
            elif want is not None and isinstance(got, str) and holds.get(got):
                hint = ("several reasons hold here: return the first in the order 'token budget', 'seq limit', "
                        "'no blocks'. ")
            elif got not in ("token budget", "seq limit", "no blocks", None):
                hint = "return one of 'token budget', 'seq limit', 'no blocks', or None to admit. "
            print(f"[fail] admission_rule: {hint}For {call}: yours {got!r}, expected {want!r}")
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
    passed("admission_rule", fn)
    return True


class _Pool:
    """A stand-in for the block manager in the decode step's checker: blocks of 4 tokens, counted."""

    def __init__(self, running, decoding, tokens, held, free):
        self.running, self.decoding = list(running), set(decoding)
        self.tokens, self.held, self.free = dict(tokens), dict(held), free
        self.preempted, self.appended = [], []
        self.asking, self.gave_way = None, set()  # whose append failed last; who preempted itself

    def append(self, sid):
        if sid in self.gave_way:
            raise ValueError(f"sequence {sid} preempted itself: stop there (it is back in the queue), do not append "
                             "it again")
        if sid in self.preempted:
            raise ValueError(f"sequence {sid} was preempted this step: it is back in the queue and cannot decode")
        if sid not in self.decoding:
            raise ValueError(f"sequence {sid} is still prefilling (not in decoding): it has no token to append")
        if sid in self.appended:
            raise ValueError(f"sequence {sid} already has its slot this step: append once per decode")
        if self.tokens[sid] % 4 == 0:  # the last block is full: a new one
            if not self.free:
                self.asking = sid
                return False
            self.free -= 1
            self.held[sid] += 1
        self.tokens[sid] += 1
        self.appended.append(sid)
        self.asking = None
        return True

    def preempt(self, sid):
        if sid not in self.running:
            raise ValueError(f"sequence {sid} is not running: it cannot be preempted")
        self.free += self.held[sid]
        self.running.remove(sid)
        self.preempted.append(sid)
        if sid == self.asking:
            self.gave_way.add(sid)


# (running ids oldest first, decoding ids, tokens each holds, blocks each holds, free blocks); blocks of 4
_DECODE_CASES = [
    ([0, 1, 2], {0, 1, 2}, {0: 5, 1: 6, 2: 7}, {0: 2, 1: 2, 2: 2}, 0),  # nobody needs a block
    ([0, 1, 2], {0, 1}, {0: 8, 1: 5, 2: 3}, {0: 2, 1: 2, 2: 1}, 0),  # the tail is still prefilling: it goes
    ([0, 1, 2], {0, 1, 2}, {0: 8, 1: 5, 2: 4}, {0: 2, 1: 2, 2: 1}, 1),  # the last to ask finds none: itself
    ([0, 1, 2], {0, 1, 2}, {0: 8, 1: 5, 2: 6}, {0: 2, 1: 2, 2: 2}, 0),  # the oldest needs one: the tail goes
    ([0, 1, 2, 3], {0, 1, 2, 3}, {0: 8, 1: 8, 2: 8, 3: 8}, {0: 2, 1: 2, 2: 2, 3: 2}, 0),  # two go
    ([0], {0}, {0: 8}, {0: 2}, 0),  # alone and full: it preempts itself
]


def schedule_decodes(fn: Callable) -> bool:
    """``fn(running, decoding, append, preempt) -> the ids that decode this step``: decodes first,
    preempting the most recently admitted when the pool has no room."""
    def run(running, decoding, tokens, held, free, f=fn):
        pool = _Pool(running, decoding, tokens, held, free)
        got = f(pool.running, set(decoding), pool.append, pool.preempt)
        return (list(got) if isinstance(got, (list, tuple)) else got), pool.preempted, pool.appended
    cases = [(a, run(*a, f=ref_schedule_decodes)) for a in _DECODE_CASES]
    def hint(args, got, expected):
        running = args[0]
        decoded, preempted, appended = got
        want_decoded, want_preempted, _ = expected
        if not isinstance(decoded, list):
            return "return the list of ids that decode"
        if preempted and want_preempted and preempted[0] == running[0] != want_preempted[0]:
            return "preempt the most recently admitted sequence, running[-1]: the oldest has waited longest"
        if not preempted and want_preempted:
            return "no room is not a reason to skip a sequence: preempt from the tail (running[-1]) until append works"
        if len(preempted) > len(want_preempted):
            return "stop preempting once append works, or once the sequence has preempted itself"
        if decoded != appended:
            return "return exactly the sequences whose append worked, in order"
        return None
    return run_task("schedule_decodes", run, cases, hint=hint, learner=fn)


def chunk_prefills(fn: Callable) -> bool:
    """``fn(uncomputed, budget) -> the prompt tokens each prefill feeds this step``."""
    shapes = [([10, 20, 3], 12), ([5], 100), ([], 10), ([4, 4], 8), ([30, 5], 0), ([7, 9, 2], 15), ([700], 64)]
    cases = [((list(u), b), ref_chunk_prefills(list(u), b)) for u, b in shapes]
    def hint(args, got, expected):
        need, budget = args
        if not isinstance(got, (list, tuple)) or len(got) != len(need):
            return "return one number per prefill (0 when it gets nothing this step)"
        if any(g > n for g, n in zip(got, need)):
            return "no prefill takes more than it still needs"
        if sum(got) > budget:
            return "the budget is shared: subtract each chunk before sizing the next"
        if all(g in (0, n) for g, n in zip(got, need)):
            return "a prompt that does not fit whole takes a chunk of what is left: the rest follows next step"
        if sum(got) == min(budget, sum(need)):
            return ("in order: each prefill takes all it needs before the next gets anything; only the one that "
                    "meets the end of the budget is chunked")
        return None
    return run_task("chunk_prefills", lambda u, b: fn(list(u), b), cases,
                   same=lambda a, b: isinstance(a, (list, tuple)) and list(a) == b, hint=hint, learner=fn)
