"""The host tier behind the block pool (notebook 07; vLLM's CPU offloading, SGLang's HiCache).

Blocks the device LRU gives away are copied here for a later prefix hit; a hash is on the device or
here, never both. The tier only books slots and queues copies; the storage applies them.
"""

from __future__ import annotations

from collections import OrderedDict, deque
from dataclasses import dataclass


@dataclass(frozen=True)
class HostHit:
    """A prefix block found in the host tier (its chain hash), not on the device."""

    hash: bytes


class HostTier:
    """``num_slots`` host slots, an LRU of the blocks in them, and the copies queued for the storage."""

    def __init__(self, num_slots: int, counters: dict):
        self.num_slots = num_slots
        self.counters = counters  # the block manager's: offloaded_blocks, loaded_blocks, host_evictions
        self.entries: OrderedDict[bytes, tuple[int, bytes | None, tuple]] = OrderedDict()  # hash -> (slot, parent, tokens)
        self.free: deque[int] = deque(range(num_slots))
        self.out: list[tuple[int, int]] = []  # (device block, host slot): copied before the block is reused
        self.into: list[tuple[int, int]] = []  # (host slot, device block): copied before the forward reads
        self.loading: list[int] = []  # slots a pending load reads: free again once it is applied

    def __len__(self) -> int:
        return len(self.entries)

    def holds(self, h: bytes, tokens: tuple) -> bool:
        """Whether block ``h`` is here, holding exactly ``tokens`` (a hash collision is not a hit)."""
        return h in self.entries and self.entries[h][2] == tokens

    def offload(self, block_id: int, h: bytes, parent: bytes | None, tokens: tuple) -> None:
        """A cached block leaves the device: queue its copy to a slot (the LRU entry gives way)."""
        if not self.free:
            if not self.entries:  # no slots, or every slot is read by a load of this step: forgotten
                return
            _, (slot, _, _) = self.entries.popitem(last=False)
            self.free.append(slot)
            self.counters["host_evictions"] += 1
        slot = self.free.popleft()
        self.entries[h] = (slot, parent, tokens)
        self.out.append((block_id, slot))
        self.counters["offloaded_blocks"] += 1

    def load(self, h: bytes, take_block) -> tuple[int, bytes | None, tuple]:
        """Load block ``h`` into a fresh device block; its entry leaves the LRU first, so an offload the
        take causes cannot push it out."""
        slot, parent, tokens = self.entries.pop(h)
        block_id = take_block()
        self.into.append((slot, block_id))
        self.loading.append(slot)  # not reusable before the copy ran: an offload this step could overwrite it
        self.counters["loaded_blocks"] += 1
        return block_id, parent, tokens

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies to make before this step's forward, in this order: ``out``, then ``in``."""
        out, into = self.out, self.into
        self.out, self.into = [], []
        self.free.extend(self.loading)  # the caller applies the loads now: their slots are free after
        self.loading = []
        return out, into

    def drop_pending(self) -> list[int]:
        """After an aborted step, forget what its copies were to fill; returns the blocks left unloaded."""
        pending = {slot for _, slot in self.out}
        for h in [h for h, (slot, _, _) in self.entries.items() if slot in pending]:
            self.free.append(self.entries.pop(h)[0])
        _, into = self.take_transfers()  # cleared, the loading slots freed: nothing will copy into them
        return [block_id for _, block_id in into]

    def check(self) -> None:
        """Every slot is in exactly one place: an entry, the free list, or a pending load."""
        slots = [slot for slot, _, _ in self.entries.values()]
        assert len(set(slots)) == len(slots) and not set(slots) & set(self.free), "a host slot used twice"
        assert not set(self.loading) & (set(slots) | set(self.free)), "a loading host slot reused"
        assert len(slots) + len(self.free) + len(self.loading) == self.num_slots, "host slots lost"
