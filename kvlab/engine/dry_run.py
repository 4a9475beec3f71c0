"""The scheduler without a model (notebook 04): fake tokens, real decisions.

Scheduling only needs token COUNTS, so a real scheduler and block manager run a workload in
milliseconds, and a learner (or the exercise checker) can watch their decisions.
"""

from __future__ import annotations

from kvlab.cache.paged import BlockManager
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.scheduler import Scheduler, admission_rule
from kvlab.engine.sequence import Sequence, SequenceStatus


def dry_run(requests, num_blocks: int = 32, block_size: int = 4, max_num_seqs: int = 4,
            max_num_batched_tokens: int = 16, policy: str = "continuous", watermark: float = 0.0,
            rule=admission_rule, max_steps: int = 10_000, check: bool = True, schedule_decodes=None,
            chunk_prefills=None) -> tuple[Scheduler, list[dict]]:
    """Serve ``(prompt_len, output_len[, arrival_step])`` tuples with fake tokens; returns the scheduler
    and one dict per step. The prefix cache is off: each prompt is one repeated placeholder id.
    ``rule``, ``schedule_decodes``, ``chunk_prefills``: the scheduler's three rules (None: kvlab's own), so
    notebook 04's tasks can be watched in a whole run in milliseconds, no model needed."""
    bm = BlockManager(num_blocks, block_size, enable_prefix_caching=False)
    rules = {k: v for k, v in (("schedule_decodes", schedule_decodes), ("chunk_prefills", chunk_prefills))
             if v is not None}
    sched = Scheduler(bm, max_num_seqs, max_num_batched_tokens, policy, watermark, admission_rule=rule, **rules)
    pending = sorted(((r[2] if len(r) > 2 else 0), i, r[0], r[1]) for i, r in enumerate(requests))
    seqs, steps = [], []
    for step in range(1, max_steps + 1):
        while pending and pending[0][0] < step:
            _, i, p, o = pending.pop(0)
            seq = Sequence(i, [1000 + i] * p, SamplingParams(max_tokens=o), 0.0, arrival_step=step - 1)
            seqs.append(seq)
            sched.add(seq)
        if not sched.has_unfinished():
            if not pending:
                break
            sched.step_count += 1  # an idle step: nothing has arrived yet
            steps.append(dict(step=sched.step_count, running=0, waiting=0, prefill_tokens=0, decode_tokens=0,
                              blocks_used=0))
            continue
        batch = sched.schedule()
        if not batch.seqs:
            raise RuntimeError(f"step {batch.step}: requests are pending but nothing could be scheduled")
        steps.append(dict(step=batch.step, running=len(sched.running), waiting=len(sched.waiting),
                          prefill_tokens=batch.num_prefill_tokens, decode_tokens=batch.num_decodes,
                          blocks_used=bm.num_blocks - bm.num_free_blocks))
        for seq, n in zip(batch.seqs, batch.num_new_tokens):
            seq.num_computed_tokens += n
            if seq.num_computed_tokens == seq.num_tokens:  # the chunk reached the end: it "samples"
                seq.append_token(7)
                if len(seq.output_token_ids) >= seq.params.max_tokens:
                    sched.finish(seq, "length")
        if check:
            bm.check_invariants()
    else:
        raise RuntimeError(f"dry run did not finish in {max_steps} steps")
    assert all(s.status == SequenceStatus.FINISHED for s in seqs)
    return sched, steps
