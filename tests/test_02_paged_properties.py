"""Property tests: random interleavings of add / append / fork / finish / prefix reuse / eviction
keep the block manager's invariants (>= 10,000 operations in all)."""

import random

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from kvlab.cache import BlockManager, OutOfBlocksError

PREFIXES = [[1, 2, 3, 4, 5, 6, 7, 8], [1, 2, 3, 4, 9, 9, 9, 9], [5, 5, 5, 5, 5, 5]]


def snapshot(bm):
    return ({k: (v.block_table[:], v.token_ids[:]) for k, v in bm.seqs.items()}, list(bm.free_ids),
            list(bm.cached_ids), [(b.ref_count, b.num_tokens, b.hash) for b in bm.blocks])


class BlockManagerMachine(RuleBasedStateMachine):
    @initialize(num_blocks=st.integers(1, 24), log_bs=st.integers(0, 3))
    def setup(self, num_blocks, log_bs):
        self.bm = BlockManager(num_blocks, block_size=2**log_bs)
        self.next_id = 0
        self.finished_prompts = []
        self.ops = 0

    def _new_id(self):
        self.next_id += 1
        return self.next_id

    def _try(self, fn):
        before = snapshot(self.bm)
        try:
            fn()
        except OutOfBlocksError:
            assert snapshot(self.bm) == before, "a refused operation changed the pool"

    @rule(prefix=st.sampled_from(PREFIXES), tail=st.lists(st.integers(0, 3), max_size=12))
    def add(self, prefix, tail):
        self.ops += 1
        self._try(lambda: self.bm.allocate(self._new_id(), prefix + tail))

    @precondition(lambda self: self.finished_prompts)
    @rule(data=st.data())
    def reuse_prefix(self, data):
        """A request repeating a finished one's prompt: hits whatever of it is still cached."""
        self.ops += 1
        prompt = data.draw(st.sampled_from(self.finished_prompts))
        self._try(lambda: self.bm.allocate(self._new_id(), prompt))

    @precondition(lambda self: self.bm.seqs)
    @rule(data=st.data(), token=st.integers(0, 3))
    def append(self, data, token):
        self.ops += 1
        sid = data.draw(st.sampled_from(sorted(self.bm.seqs)))
        self._try(lambda: self.bm.append_slot(sid, token))
        self.bm.take_blocks_to_copy()

    @precondition(lambda self: self.bm.seqs)
    @rule(data=st.data())
    def fork(self, data):
        self.ops += 1
        self.bm.fork(data.draw(st.sampled_from(sorted(self.bm.seqs))), self._new_id())

    @precondition(lambda self: self.bm.seqs)
    @rule(data=st.data())
    def finish(self, data):
        self.ops += 1
        sid = data.draw(st.sampled_from(sorted(self.bm.seqs)))
        self.finished_prompts.append(list(self.bm.seqs[sid].token_ids))
        self.bm.free(sid)

    @invariant()
    def invariants_hold(self):
        self.bm.check_invariants()

    def teardown(self):
        for sid in list(self.bm.seqs):
            self.bm.free(sid)
        self.bm.check_invariants()
        s = self.bm.stats()
        assert s["blocks_used"] == 0, "leaked blocks after every sequence finished"
        assert s["blocks_free"] + s["blocks_cached"] == self.bm.num_blocks


TestBlockManagerMachine = BlockManagerMachine.TestCase
# 200 runs x 60 steps = 12,000 random operations, each followed by the full invariant check
TestBlockManagerMachine.settings = settings(max_examples=200, stateful_step_count=60, deadline=None,
                                            suppress_health_check=[HealthCheck.too_slow])


def test_seeded_random_walk_of_20000_operations():
    """The same rules without shrinking, long enough to reach deep pool states (evictions, CoW)."""
    rng = random.Random(1234)
    bm = BlockManager(32, block_size=4)
    next_id, done = 0, []
    counts = dict(add=0, reuse=0, append=0, fork=0, finish=0, refused=0)
    for _ in range(20_000):
        op = rng.choices(["add", "reuse", "append", "fork", "finish"], weights=[2, 1, 8, 1, 2])[0]
        live = sorted(bm.seqs)
        try:
            if op == "add" or (op == "reuse" and not done):
                next_id += 1
                bm.allocate(next_id, rng.choice(PREFIXES) + [rng.randrange(4) for _ in range(rng.randrange(10))])
                op = "add"
            elif op == "reuse":
                next_id += 1
                bm.allocate(next_id, rng.choice(done))
            elif not live:
                continue
            elif op == "append":
                bm.append_slot(rng.choice(live), rng.randrange(4))
                bm.take_blocks_to_copy()
            elif op == "fork":
                next_id += 1
                bm.fork(rng.choice(live), next_id)
            else:
                sid = rng.choice(live)
                done.append(list(bm.seqs[sid].token_ids))
                bm.free(sid)
            counts[op] += 1
        except OutOfBlocksError:
            counts["refused"] += 1
        bm.check_invariants()
    for sid in list(bm.seqs):
        bm.free(sid)
    bm.check_invariants()
    assert bm.stats()["blocks_used"] == 0
    # the walk really exercised every path
    assert min(counts.values()) > 100, counts
    assert bm.counters["evictions"] > 0 and bm.counters["cow_copies"] > 0 and bm.counters["prefix_hits"] > 0
