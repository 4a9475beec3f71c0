"""Paged KV cache: PagedAttention's memory manager, made inspectable (notebook 02).

Token t is stored at slot ``block_table[t // block_size] * block_size + t % block_size``.
:class:`BlockManager` is bookkeeping only (vLLM's names): allocate on demand, free tail first, share
equal prefixes' full blocks (hash chain, refcounts, an LRU of freed ones), fork with copy-on-write.
"""

from __future__ import annotations

import math
from collections import OrderedDict, deque
from types import MappingProxyType

# INT32, Block, OutOfBlocksError, check_token_ids ...: imported from here too (kvlab.cache.paged's names)
from kvlab.cache.blocks import (INT32, Block, OutOfBlocksError, SeqBlocks, block_hash, check_append,  # noqa: F401
                                check_block_size, check_hits, check_pool, check_token_ids)
from kvlab.cache.dropped import blocks_outside_window, checked_drop, shift_after_drops
from kvlab.cache.host_tier import HostHit, HostTier
from kvlab.validate import check_int, is_int


def append_slot(block_table: list[int], num_tokens: int, block_size: int, ref_count, take_block):
    """Room for one more token of a sequence (notebook 02, Task 2): returns ``(slot, copy)``.

    ``block_table`` (changed in place) holds ``num_tokens`` tokens. A new block is taken only when the
    last one is full; a last block other sequences share (``ref_count(block) > 1``, after a fork) is
    replaced by a fresh one first, and ``copy`` is the ``(src, dst)`` the storage must copy before the
    write (copy-on-write); else ``copy`` is None.
    """
    copy = None
    if num_tokens % block_size == 0:  # the last block is full (or there is none yet)
        block_table.append(take_block())
    elif ref_count(block_table[-1]) > 1:  # shared partial block: copy it, then write into the copy
        copy = (block_table[-1], take_block())
        block_table[-1] = copy[1]
    return block_table[-1] * block_size + num_tokens % block_size, copy


def prefix_hits(token_ids: list[int], block_size: int, cached, block_hash=block_hash) -> list[int]:
    """Physical blocks that already hold this prompt's leading full blocks (notebook 02, Task 3).

    Block i's key is ``block_hash(key of block i - 1, its tokens)``, from ``None``: the same tokens after
    another prefix have other K/V. ``cached`` maps keys to blocks. The walk stops at the first miss and
    never covers the last prompt token: its logits are needed to sample the first new token.
    """
    hits, parent = [], None
    for i in range((len(token_ids) - 1) // block_size):
        key = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        if key not in cached:
            break
        hits.append(cached[key])
        parent = key
    return hits


class BlockManager:
    """Free pool, block tables, refcounts and the prefix cache. Knows token ids, never tensors."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 host_blocks: int = 0, slot_mapping=None, append=None, prefix_match=None):
        """``slot_mapping``, ``append`` and ``prefix_match`` replace :meth:`slot_mapping_of`, :func:`append_slot`
        and :func:`prefix_hits` (notebook 02 plugs the participant's in)."""
        for name, fn in (("slot_mapping", slot_mapping), ("append", append), ("prefix_match", prefix_match)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a function (or None for kvlab's own), got {type(fn).__name__}")
        if prefix_match is not None and host_blocks:
            raise ValueError("prefix_match cannot be combined with host_blocks: the host tier's hits are kvlab's own")
        if slot_mapping is not None:
            self.slot_mapping_of = slot_mapping  # the model runner calls block_manager.slot_mapping_of
        self._append, self._prefix_match = append or append_slot, prefix_match
        self.num_blocks = check_int("num_blocks", num_blocks)
        self.block_size = check_block_size(block_size)
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [Block(i) for i in range(num_blocks)]
        self.free_ids: deque[int] = deque(range(num_blocks))  # never used, or freed without a hash
        self.cached_ids: OrderedDict[int, None] = OrderedDict()  # freed but reusable, oldest first (LRU)
        self.hash_to_block: dict[bytes, int] = {}
        self.seqs: dict[int, SeqBlocks] = {}
        self.finished: set[int] = set()
        self.blocks_to_copy: list[tuple[int, int]] = []  # copy-on-write (src, dst) for the storage
        # evictions: cached blocks the LRU gave away; policy_evictions: blocks an eviction policy dropped
        self.counters = dict(prefix_queries=0, prefix_hits=0, evictions=0, cow_copies=0, policy_evictions=0,
                             offloaded_blocks=0, loaded_blocks=0, host_evictions=0, host_hits=0)
        self.sliding_window: int | None = None  #: the most tokens any layer reads back (set by the engine)
        if not is_int(host_blocks) or host_blocks < 0:
            raise ValueError(f"host_blocks must be an int >= 0 (0: no host tier), got {host_blocks!r}")
        if host_blocks and not enable_prefix_caching:
            raise ValueError("host_blocks needs enable_prefix_caching=True: the host tier keeps cached blocks")
        self.host_blocks = host_blocks
        self.host = HostTier(host_blocks, self.counters)

    def _seq(self, seq_id: int) -> SeqBlocks:
        if seq_id in self.seqs:
            return self.seqs[seq_id]
        raise ValueError(f"sequence {seq_id!r} is " + ("finished: its blocks were freed" if seq_id in self.finished
                                                          else "not allocated"))

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: free ones plus evictable cached ones."""
        return len(self.free_ids) + len(self.cached_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).block_table)

    def num_tokens(self, seq_id: int) -> int:
        return len(self._seq(seq_id).token_ids)

    def logical_blocks(self, seq_id: int) -> list[int]:
        """The logical block index of each table entry: ``0, 1, 2, ...`` until a policy dropped some."""
        return self._seq(seq_id).logical_blocks()

    def kept_tokens(self, seq_id: int) -> int:
        """Tokens attention reads: all of them, less the dropped blocks' (always full)."""
        seq = self._seq(seq_id)
        return len(seq.token_ids) - seq.evicted * self.block_size

    @staticmethod
    def slot_mapping_of(block_table, block_size: int, start: int, end: int) -> list[int]:
        """``slot = block_table[t // block_size] * block_size + t % block_size`` for t in start..end-1."""
        return [block_table[t // block_size] * block_size + t % block_size for t in range(start, end)]

    def slot_mapping(self, seq_id: int, start: int = 0, end: int | None = None) -> list[int]:
        """Slots of the sequence's tokens ``start..end-1``: where the storage writes their K/V."""
        seq = self._seq(seq_id)
        end = len(seq.token_ids) if end is None else end
        for name, v in (("start", start), ("end", end)):
            if not is_int(v):
                raise TypeError(f"{name} must be an int token position, got {type(v).__name__} {v!r}")
        if not 0 <= start <= end <= len(seq.token_ids):
            raise ValueError(f"token range [{start}, {end}) is outside sequence {seq_id}'s {len(seq.token_ids)} tokens")
        shift = shift_after_drops(seq_id, seq, start, self.block_size)
        return self.slot_mapping_of(seq.block_table, self.block_size, start - shift, end - shift)

    def cached_prefix_blocks(self, token_ids) -> list:
        """The cached blocks a prompt would hit, changing nothing: per leading full block a device block
        id, or a :class:`~kvlab.cache.host_tier.HostHit` for one on the host tier."""
        return self._match_prefix(check_token_ids(token_ids))

    def _match_prefix(self, token_ids: list[int]) -> list:
        if not self.enable_prefix_caching:
            return []
        bs = self.block_size
        if self._prefix_match is not None:  # a plugged-in match, held to what a hit must be
            hits = self._prefix_match(list(token_ids), bs, MappingProxyType(self.hash_to_block), block_hash)
            return check_hits(hits, token_ids, bs, self.blocks)
        hits, parent = [], None
        for i in range((len(token_ids) - 1) // bs):  # never the last token: it must go through the model
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            h = block_hash(parent, chunk)
            bid = self.hash_to_block.get(h)
            if bid is not None and self.blocks[bid].token_ids == chunk:  # a hash collision is not a hit
                hits.append(bid)
            elif self.host.holds(h, chunk):  # loaded back at allocate
                hits.append(HostHit(h))
            else:
                break
            parent = h
        return hits

    def _take_block(self) -> int:
        if self.free_ids:
            bid = self.free_ids.popleft()
        else:  # reuse the least recently freed cached block; the host tier, if any, keeps a copy
            bid, _ = self.cached_ids.popitem(last=False)
            b = self.blocks[bid]
            self.host.offload(bid, b.hash, b.parent, b.token_ids)
            self._unregister(b)
            self.counters["evictions"] += 1
        b = self.blocks[bid]
        b.ref_count, b.num_tokens = 1, 0
        return bid

    def _ref(self, bid: int) -> None:
        if self.blocks[bid].ref_count == 0:
            del self.cached_ids[bid]  # a cached block comes back into use
        self.blocks[bid].ref_count += 1

    def _release(self, bid: int, keep_cached: bool = True, first: bool = False) -> bool:
        """Drop one reference; at none the block goes back, to the LRU while registered and ``keep_cached``,
        else free (at the front when ``first`` undoes a take). Returns whether it went back."""
        b = self.blocks[bid]
        b.ref_count -= 1
        if b.ref_count:
            return False
        if b.hash is not None and not keep_cached:
            self._unregister(b)
        if b.hash is not None:
            self.cached_ids[bid] = None
        else:
            b.num_tokens = 0
            (self.free_ids.appendleft if first else self.free_ids.append)(bid)
        return True

    def _unregister(self, b: Block) -> None:
        del self.hash_to_block[b.hash]
        b.hash, b.parent, b.token_ids = None, None, ()

    def _register_full(self, seq: SeqBlocks, logical: int) -> None:
        """A block just became full: extend the hash chain, and offer it to the prefix cache."""
        bs = self.block_size
        chunk = tuple(seq.token_ids[logical * bs:(logical + 1) * bs])
        parent = seq.hashes[-1] if seq.hashes else None
        h = block_hash(parent, chunk)
        seq.hashes.append(h)
        if seq.logical is not None:  # after an eviction, a new block's K/V were computed without the
            return  # dropped tokens: not what a full prefill writes, so no other request may hit them
        b = self.blocks[seq.block_table[logical]]
        if self.enable_prefix_caching and h not in self.hash_to_block and b.hash is None:
            self.hash_to_block[h] = b.block_id
            b.hash, b.parent, b.token_ids = h, parent, chunk

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """Host-tier copies to make before this step's forward: ``out`` (device -> host), then ``in``."""
        return self.host.take_transfers()

    def drop_pending_transfers(self) -> None:
        """After an aborted step: the host entries and blocks its copies were to fill hold nothing."""
        for bid in self.host.drop_pending():
            b = self.blocks[bid]
            if b.hash is not None and self.hash_to_block.get(b.hash) == bid:
                self._unregister(b)
                if bid in self.cached_ids:
                    del self.cached_ids[bid]
                    self.free_ids.append(bid)

    def allocation_cost(self, token_ids, hits: list | None = None) -> tuple[int, int]:
        """``(needed, available)`` blocks for a prompt after prefix hits. A host hit still needs a device
        block; hit blocks waiting in the LRU are not free for it: it is about to use them."""
        token_ids = check_token_ids(token_ids)
        device = [bid for bid in (self._match_prefix(token_ids) if hits is None else hits) if not isinstance(bid, HostHit)]
        cached_hits = sum(1 for bid in device if self.blocks[bid].ref_count == 0)
        return self.blocks_needed(len(token_ids)) - len(device), self.num_free_blocks - cached_hits

    def can_allocate(self, token_ids) -> bool:
        needed, available = self.allocation_cost(token_ids)
        return needed <= available

    def allocate(self, seq_id: int, token_ids, register: bool = True) -> int:
        """Blocks for a new prompt; returns its cached tokens. ``register=False`` keeps its blocks out of
        the prefix cache until :meth:`mark_computed`, so no request hits a chunk not yet written."""
        token_ids = check_token_ids(token_ids)
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        hits = self._match_prefix(token_ids)
        needed, available = self.allocation_cost(token_ids, hits)
        if needed > available:
            raise OutOfBlocksError(needed, available, f"a prompt of {len(token_ids)} tokens")
        self.finished.discard(seq_id)  # commit: nothing below can fail
        bs = self.block_size
        seq = self.seqs[seq_id] = SeqBlocks(token_ids=token_ids, cached_tokens=len(hits) * bs)
        host_hits = [h for h in hits if isinstance(h, HostHit)]
        for bid in hits:  # device hits are taken first, so loading the host hits cannot evict them
            if not isinstance(bid, HostHit):
                self._ref(bid)
        for bid in hits:
            if isinstance(bid, HostHit):  # a fresh device block, registered under its hash, filled by a copy
                h = bid.hash
                bid, parent, tokens = self.host.load(h, self._take_block)
                b = self.blocks[bid]
                b.hash, b.parent, b.token_ids, b.num_tokens = h, parent, tokens, bs
                self.hash_to_block[h] = bid
            seq.block_table.append(bid)
            seq.hashes.append(self.blocks[bid].hash)
        for _ in range(needed - len(host_hits)):  # the host hits' blocks were taken above
            seq.block_table.append(self._take_block())
        for i in range(len(hits), len(seq.block_table)):
            self.blocks[seq.block_table[i]].num_tokens = min(bs, len(token_ids) - i * bs)
            if register and (i + 1) * bs <= len(token_ids):
                self._register_full(seq, i)
        if self.enable_prefix_caching:
            self.counters["prefix_queries"] += (len(token_ids) - 1) // bs
            self.counters["prefix_hits"] += len(hits)
            self.counters["host_hits"] += len(host_hits)
        return seq.cached_tokens

    def mark_computed(self, seq_id: int, num_computed: int) -> None:
        """Offer full blocks of the first ``num_computed`` tokens (written or about to be) to prefix hits."""
        seq = self._seq(seq_id)
        for i in range(len(seq.hashes), min(num_computed, len(seq.token_ids)) // self.block_size):
            self._register_full(seq, i)

    def can_append(self, seq_id: int) -> bool:
        seq = self._seq(seq_id)
        needs_block = len(seq.token_ids) % self.block_size == 0 or self.blocks[seq.block_table[-1]].ref_count > 1
        return not needs_block or self.num_free_blocks > 0

    def append_slot(self, seq_id: int, token_id: int) -> int:
        """Reserve and return one more token's slot; a copy-on-write goes to ``blocks_to_copy``."""
        seq = self._seq(seq_id)
        (token_id,) = check_token_ids([token_id], "token_id")  # before anything changes
        bs, n = self.block_size, len(seq.token_ids)
        own = self._append is append_slot  # kvlab's rule changes the table in place; a plugged-in one is checked first
        table, taken = (seq.block_table if own else list(seq.block_table)), []

        def take_block() -> int:
            if self.num_free_blocks == 0:
                raise OutOfBlocksError(1, 0, f"sequence {seq_id} growing to {n + 1} tokens"
                                       if n % bs == 0 else f"copy-on-write for sequence {seq_id}")
            taken.append(self._take_block())
            return taken[-1]

        try:
            slot, copy = self._append(table, n, bs, lambda b: self.blocks[b].ref_count, take_block)
            if not own:
                check_append(seq.block_table, table, n, bs, slot, copy, len(taken))
        except BaseException:
            for bid in taken:  # the pool as it was: the blocks taken go back
                self._release(bid, first=True)
            raise
        if n % bs == 0 and seq.logical is not None:  # a new block joined the table
            seq.logical.append(n // bs)
        if copy is not None:
            self.blocks[copy[1]].num_tokens = self.blocks[copy[0]].num_tokens
            self._release(copy[0])
            self.blocks_to_copy.append(copy)
            self.counters["cow_copies"] += 1
        seq.block_table[:] = table
        seq.token_ids.append(token_id)
        block = self.blocks[seq.block_table[-1]]
        block.num_tokens += 1
        if block.num_tokens == bs:  # registers every full block not registered yet, in chain order
            self.mark_computed(seq_id, len(seq.token_ids))
        return slot

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every parent block (parallel sampling); writing a shared last block copies it."""
        parent = self._seq(parent_id)
        if child_id in self.seqs:
            raise ValueError(f"sequence {child_id!r} is already allocated")
        for bid in parent.block_table:
            self._ref(bid)
        self.finished.discard(child_id)
        self.seqs[child_id] = SeqBlocks(list(parent.block_table), list(parent.token_ids), list(parent.hashes),
                                        parent.cached_tokens, None if parent.logical is None else list(parent.logical))

    def free(self, seq_id: int, keep_cached: bool = True) -> None:
        """Release blocks tail first, so the tail leaves the LRU before the prefix others likelier share.
        ``keep_cached=False`` forgets their hashes (after a failed forward the contents are not trusted)."""
        seq = self._seq(seq_id)
        for bid in reversed(seq.block_table):
            self._release(bid, keep_cached)
        del self.seqs[seq_id]
        self.finished.add(seq_id)

    def evict(self, seq_id: int, logical_blocks) -> int:
        """Drop full blocks (logical indices, never the last) a policy chose; returns how many went back
        to the pool, since a shared block stays its other owners'. Bad input changes nothing."""
        seq = self._seq(seq_id)
        drop = set(checked_drop(seq_id, seq, logical_blocks, self.block_size))
        if not drop:
            return 0
        pairs = list(zip(seq.logical_blocks(), seq.block_table))
        freed = sum(self._release(bid) for lb, bid in pairs if lb in drop)  # oldest first: they leave the LRU first
        seq.block_table = [bid for lb, bid in pairs if lb not in drop]
        seq.logical = [lb for lb, _ in pairs if lb not in drop]
        self.counters["policy_evictions"] += len(drop)
        return freed

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        copies, self.blocks_to_copy = self.blocks_to_copy, []
        return copies

    def stats(self) -> dict:
        """``empty_slots``: held slots with no token *now* (growing sequences fill them: not all waste)."""
        used = [b for b in self.blocks if b.ref_count > 0]
        tokens = sum(b.num_tokens for b in used)  # physical: a shared block counts once
        slots = len(used) * self.block_size
        q, h = self.counters["prefix_queries"], self.counters["prefix_hits"]
        return {"kind": "paged", "num_blocks": self.num_blocks, "block_size": self.block_size,
                "blocks_used": len(used), "blocks_free": len(self.free_ids), "blocks_cached": len(self.cached_ids),
                "blocks_shared": sum(1 for b in used if b.ref_count > 1), "sequences": len(self.seqs),
                "tokens_stored": tokens,
                "logical_tokens": sum(len(s.token_ids) - s.evicted * self.block_size for s in self.seqs.values()),
                "tokens_evicted": sum(s.evicted for s in self.seqs.values()) * self.block_size,
                "slots_reserved": slots, "empty_slots": slots - tokens,
                "empty_slot_share": 1 - tokens / slots if slots else 0.0,
                "prefix_queries": q, "prefix_hits": h, "prefix_hit_rate": h / q if q else 0.0,
                "blocks_saved": self.blocks_needed_for_all() - len(used), "sliding_window": self.sliding_window,
                "blocks_outside_window": self.blocks_outside_window(), "host_blocks": self.host_blocks,
                "host_blocks_used": len(self.host),
                **{k: v for k, v in self.counters.items() if k not in ("prefix_queries", "prefix_hits")}}

    def eviction_order(self) -> list[int]:
        """Cached blocks (freed, hash kept) in the order they would be evicted: least recently freed first."""
        return list(self.cached_ids)

    def blocks_outside_window(self) -> int:
        """Held blocks no layer reads any more (kvlab keeps them; vLLM frees them); 0 without a window."""
        return blocks_outside_window(self.seqs.values(), self.sliding_window, self.block_size)

    def blocks_needed_for_all(self) -> int:
        """Blocks the live sequences would hold without any sharing (their kept blocks, after an eviction)."""
        return sum(self.blocks_needed(len(s.token_ids)) - s.evicted for s in self.seqs.values())

    def check_invariants(self) -> None:
        """Raises AssertionError at the first broken invariant (:func:`~kvlab.cache.blocks.check_pool`)."""
        check_pool(self)
