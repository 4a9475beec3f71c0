"""Paged KV cache: PagedAttention's memory manager, made inspectable (notebook 02).

Instead of one contiguous reservation per sequence, the cache is a pool of ``num_blocks`` physical
blocks of ``block_size`` token slots. Each sequence owns a *block table*: logical block i of the
sequence lives in physical block ``block_table[i]``. Token t of a sequence is stored at

    slot = block_table[t // block_size] * block_size + t % block_size

(the *slot mapping*), the same layout the PyTorch reference and the Triton kernels read.

:class:`BlockManager` is pure bookkeeping (vLLM's names): allocate on demand, free tail first,
share full blocks between sequences with the same prefix (hash chain + token check + refcounts,
LRU eviction of freed-but-cached blocks), fork with copy-on-write. :class:`PagedKVCache` holds the
tensors, ``[num_blocks, block_size, H_kv, D]`` per layer, and applies what the manager decides.

Sliding-window models (Mistral, Gemma-2/3, gpt-oss; README, "Models beyond Llama"): kvlab keeps every
block of a sequence until the sequence finishes, also those that fell out of the window, so a later
prompt can still hit them in the prefix cache. vLLM instead frees them as the window passes.
``stats()`` says which blocks those are: ``blocks_outside_window`` counts held blocks that no layer
reads anymore (only when every layer slides, ``sliding_window`` set by the engine; a model with a
global layer reads them all).
"""

from __future__ import annotations

from types import MappingProxyType

import hashlib
import math
import operator
from collections import OrderedDict, deque
from dataclasses import dataclass, field

import torch

from kvlab.validate import check_int, check_power_of_two, is_int


class OutOfBlocksError(RuntimeError):
    """The pool cannot supply the blocks a request needs. Nothing was changed: the caller may
    preempt another sequence (notebook 04) and retry."""

    def __init__(self, needed: int, available: int, what: str):
        self.needed, self.available = needed, available
        super().__init__(f"out of KV blocks: {what} needs {needed} block(s), {available} available")


def block_hash(parent: bytes | None, token_ids) -> bytes:
    """Hash of a full block, chained to its parent's hash so equal blocks at different prefixes
    differ. hashlib, not hash(): Python's hash() is salted per process."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids))
    return h.digest()


def append_slot(block_table: list[int], num_tokens: int, block_size: int, ref_count, take_block):
    """Room for one more token of a sequence (notebook 02, Task 2): returns ``(slot, copy)``.

    ``block_table`` (physical block ids, changed in place) holds ``num_tokens`` tokens. A new block is
    taken (``take_block()``) only when the last one is full; a last block other sequences share too
    (``ref_count(block) > 1``, after a fork) is replaced by a fresh one first, and ``copy`` is the
    ``(src, dst)`` pair the storage must copy before the write (copy-on-write); else ``copy`` is None.
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

    Each full block's key is ``block_hash(parent_key, its tokens)``, chained from ``None``: the same
    tokens after a different prefix have other K/V. ``cached`` maps keys to blocks. The walk stops at
    the first miss, and never covers the last prompt token: its logits are needed to sample the first
    new token, so at least that token goes through the model.
    """
    hits, parent = [], None
    for i in range((len(token_ids) - 1) // block_size):
        key = block_hash(parent, token_ids[i * block_size:(i + 1) * block_size])
        if key not in cached:
            break
        hits.append(cached[key])
        parent = key
    return hits


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    num_tokens: int = 0  # filled slots
    hash: bytes | None = None  # set while the block is registered in the prefix cache
    parent: bytes | None = None  # the previous block's hash in the chain (for checking)
    token_ids: tuple[int, ...] = ()  # a registered block's tokens: a hash hit is confirmed against them


@dataclass(frozen=True)
class HostHit:
    """A prefix block found in the host tier (its chain hash), not on the device."""

    hash: bytes


@dataclass
class SeqBlocks:
    """One sequence's view of the pool."""

    block_table: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # tokens whose K/V are (or will be) in the cache
    hashes: list[bytes] = field(default_factory=list)  # chain hash of each full block
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at allocate()
    #: after an eviction policy dropped blocks (:meth:`BlockManager.evict`): the logical block index
    #: (position // block_size) of each entry of ``block_table``, which then holds only the kept blocks
    #: in position order; None while nothing was dropped (entry i is logical block i)
    logical: list[int] | None = None

    @property
    def evicted(self) -> int:
        """Blocks an eviction policy dropped from this sequence."""
        return 0 if self.logical is None else self.logical[-1] + 1 - len(self.logical)


INT32 = 2**31


def check_token_ids(ids, name: str = "token_ids", vocab_size: int | None = None) -> list[int]:
    """Token ids as a list of Python ints, or a ValueError naming ``name``: ints or integer scalars
    (numpy, 0-d tensors), not bools, floats or strs; in ``0..vocab_size - 1`` when a vocabulary is
    given, else within the 32 bits the block hash stores. The one check behind the block manager,
    the decode loops, the engine's requests and the evaluation."""
    if isinstance(ids, (str, bytes)) or not hasattr(ids, "__iter__"):
        raise ValueError(f"{name} must be a list of ints, got {type(ids).__name__}")
    lo, hi = (0, vocab_size) if vocab_size else (-INT32, INT32)
    out = []
    for t in ids:
        try:
            if isinstance(t, bool):
                raise TypeError
            i = operator.index(t)
            if not lo <= i < hi:
                raise TypeError
        except TypeError:
            allowed = f"ints in {lo}..{hi - 1}" if vocab_size else "ints that fit in 32 bits"
            raise ValueError(f"{name} must be {allowed}, got {t!r}") from None
        out.append(i)
    return out


def check_block_size(block_size) -> int:
    """``block_size`` as an int, or a ValueError unless it is a power of two from 1 to 256."""
    return check_power_of_two("block_size", block_size, 1, 256)


class BlockManager:
    """Free pool, block tables, refcounts and the prefix cache. Knows token ids, never tensors."""

    def __init__(self, num_blocks: int, block_size: int = 16, enable_prefix_caching: bool = True,
                 host_blocks: int = 0, slot_mapping=None, append=None, prefix_match=None):
        """``slot_mapping``, ``append`` and ``prefix_match`` replace kvlab's :meth:`slot_mapping_of`,
        :func:`append_slot` and :func:`prefix_hits` (notebook 02 plugs the participant's in)."""
        for name, fn in (("slot_mapping", slot_mapping), ("append", append), ("prefix_match", prefix_match)):
            if fn is not None and not callable(fn):
                raise TypeError(f"{name} must be a function (or None for kvlab's own), got {type(fn).__name__}")
        if prefix_match is not None and host_blocks:
            raise ValueError("prefix_match cannot be combined with host_blocks: the host tier's hits are kvlab's own")
        if slot_mapping is not None:
            self.slot_mapping_of = slot_mapping  # the model runner calls block_manager.slot_mapping_of
        self._append = append or append_slot
        self._prefix_match = prefix_match
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
        # evictions: cached blocks the LRU gave away; policy_evictions: blocks an eviction policy
        # (kvlab.cache.evict) dropped from a live sequence's table, back to the pool
        self.counters = dict(prefix_queries=0, prefix_hits=0, evictions=0, cow_copies=0, policy_evictions=0)
        #: the most tokens any layer reads back when every layer slides (set by the engine), else None
        self.sliding_window: int | None = None
        # the host tier (notebook 07): cached blocks the device LRU gives away move here instead of being
        # forgotten, and a later prefix hit brings them back. Exclusive: a hash is on the device or here.
        if not is_int(host_blocks) or host_blocks < 0:
            raise ValueError(f"host_blocks must be an int >= 0 (0: no host tier), got {host_blocks!r}")
        if host_blocks and not enable_prefix_caching:
            raise ValueError("host_blocks needs enable_prefix_caching=True: the host tier keeps cached blocks")
        self.host_blocks = host_blocks
        self.host: OrderedDict[bytes, tuple[int, bytes | None, tuple]] = OrderedDict()  # hash -> (slot, parent, tokens), LRU
        self.host_free: deque[int] = deque(range(host_blocks))
        self.transfers_out: list[tuple[int, int]] = []  # (device block, host slot): copy before the block is reused
        self.transfers_in: list[tuple[int, int]] = []  # (host slot, device block): copy before the forward reads
        self.host_loading: list[int] = []  # slots being read by a pending load: free again once it is applied
        self.counters.update(offloaded_blocks=0, loaded_blocks=0, host_evictions=0, host_hits=0)

    # ---- queries ---------------------------------------------------------------------------------

    def _seq(self, seq_id: int) -> SeqBlocks:
        if seq_id in self.seqs:
            return self.seqs[seq_id]
        if seq_id in self.finished:
            raise ValueError(f"sequence {seq_id!r} is finished: its blocks were freed")
        raise ValueError(f"sequence {seq_id!r} is not allocated")

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now: never-used/unhashed ones plus evictable cached ones."""
        return len(self.free_ids) + len(self.cached_ids)

    def blocks_needed(self, num_tokens: int) -> int:
        return math.ceil(num_tokens / self.block_size)

    def block_table(self, seq_id: int) -> list[int]:
        return list(self._seq(seq_id).block_table)

    def num_tokens(self, seq_id: int) -> int:
        return len(self._seq(seq_id).token_ids)

    def logical_blocks(self, seq_id: int) -> list[int]:
        """The logical block index (positions ``i * block_size ...``) of each entry of the block table:
        ``0, 1, 2, ...`` until an eviction policy dropped some."""
        seq = self._seq(seq_id)
        return list(range(len(seq.block_table))) if seq.logical is None else list(seq.logical)

    def kept_tokens(self, seq_id: int) -> int:
        """Tokens attention reads for this sequence: all of them, less the dropped blocks' (always full)."""
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
        if seq.logical is not None:  # after an eviction, only tokens after the last dropped block have slots
            kept = set(seq.logical)
            first = max(l for l in range(seq.logical[-1]) if l not in kept) + 1  # past every dropped block
            if start < first * self.block_size:
                raise ValueError(f"tokens before position {first * self.block_size} of sequence {seq_id} include "
                                 f"evicted blocks: they have no slot")
            shift = seq.evicted * self.block_size
            return self.slot_mapping_of(seq.block_table, self.block_size, start - shift, end - shift)
        return self.slot_mapping_of(seq.block_table, self.block_size, start, end)

    def _match_prefix(self, token_ids: list[int]) -> list[int]:
        """Physical blocks already holding this prompt's leading full blocks (no state change).

        The last prompt token is never taken from the cache: its logits are needed to sample the
        first new token, so at least that token must go through the model.
        """
        if not self.enable_prefix_caching:
            return []
        if self._prefix_match is not None:
            return self._checked_hits(token_ids)
        hits, parent, bs = [], None, self.block_size
        for i in range((len(token_ids) - 1) // bs):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            h = block_hash(parent, chunk)
            bid = self.hash_to_block.get(h)
            if bid is None or self.blocks[bid].token_ids != chunk:  # a hash collision is not a hit
                if h in self.host and self.host[h][2] == chunk:  # on the host: HostHit(h), loaded at allocate
                    hits.append(HostHit(h))
                    parent = h
                    continue
                break
            hits.append(bid)
            parent = h
        return hits

    def _checked_hits(self, token_ids: list[int]) -> list[int]:
        """The plugged-in prefix match, held to what a hit must be: the prompt's leading full blocks,
        in order, each a cached block holding exactly those tokens, the last prompt token left out."""
        bs = self.block_size
        hits = self._prefix_match(list(token_ids), bs, MappingProxyType(self.hash_to_block), block_hash)
        if not isinstance(hits, (list, tuple)) or len(hits) > (len(token_ids) - 1) // bs:
            raise ValueError(f"prefix_match must return a list of at most {(len(token_ids) - 1) // bs} block ids "
                             f"(the full blocks before the last prompt token), got {hits!r}")
        for i, bid in enumerate(hits):
            chunk = tuple(token_ids[i * bs:(i + 1) * bs])
            if not is_int(bid) or not 0 <= bid < self.num_blocks or self.blocks[bid].token_ids != chunk:
                raise ValueError(f"prefix_match returned block {bid!r} for the prompt's block {i}, which does not "
                                 "hold those tokens after that prefix")
        return list(hits)

    # ---- allocation ------------------------------------------------------------------------------

    def _take_block(self) -> int:
        if self.free_ids:
            bid = self.free_ids.popleft()
        else:  # evict the least recently freed cached block
            bid, _ = self.cached_ids.popitem(last=False)
            b = self.blocks[bid]
            del self.hash_to_block[b.hash]
            if self.host_blocks:
                self._offload(b)
            b.hash, b.parent, b.token_ids = None, None, ()
            self.counters["evictions"] += 1
        b = self.blocks[bid]
        b.ref_count, b.num_tokens = 1, 0
        return bid

    def _offload(self, b: Block) -> None:
        """A cached block leaves the device: copy it to a host slot (the host's LRU entry gives way)."""
        if not self.host_free:
            if not self.host:  # every slot is being read by a load of this step: this block is forgotten
                return
            _, (slot, _, _) = self.host.popitem(last=False)
            self.host_free.append(slot)
            self.counters["host_evictions"] += 1
        slot = self.host_free.popleft()
        self.host[b.hash] = (slot, b.parent, b.token_ids)
        self.transfers_out.append((b.block_id, slot))
        self.counters["offloaded_blocks"] += 1

    def _load(self, hit: "HostHit") -> int:
        """A host hit comes back: a fresh device block, registered under its hash, filled by a copy."""
        slot, parent, tokens = self.host.pop(hit.hash)
        bid = self._take_block()
        b = self.blocks[bid]
        b.hash, b.parent, b.token_ids, b.num_tokens = hit.hash, parent, tokens, self.block_size
        self.hash_to_block[hit.hash] = bid
        self.transfers_in.append((slot, bid))
        self.host_loading.append(slot)  # not reusable before the copy ran: an offload in this step could overwrite it
        self.counters["loaded_blocks"] += 1
        return bid

    def take_transfers(self) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
        """The copies the storage must make before this step's forward, in this order: ``out``
        (device block -> host slot), then ``in`` (host slot -> device block)."""
        out, into = self.transfers_out, self.transfers_in
        self.transfers_out, self.transfers_in = [], []
        self.host_free.extend(self.host_loading)  # the caller applies the loads now: their slots are free after
        self.host_loading = []
        return out, into

    def drop_pending_transfers(self) -> None:
        """After an aborted step whose copies never ran: the host entries they would have filled hold
        nothing (forget them); blocks that were to be loaded belong to sequences being freed."""
        pending = {slot for _, slot in self.transfers_out}
        for h in [h for h, (slot, _, _) in self.host.items() if slot in pending]:
            self.host_free.append(self.host.pop(h)[0])
        for _, bid in self.transfers_in:
            b = self.blocks[bid]
            if b.hash is not None and self.hash_to_block.get(b.hash) == bid:
                del self.hash_to_block[b.hash]
                b.hash, b.parent, b.token_ids = None, None, ()
                if bid in self.cached_ids:
                    del self.cached_ids[bid]
                    self.free_ids.append(bid)
        self.transfers_out, self.transfers_in = [], []
        self.host_free.extend(self.host_loading)
        self.host_loading = []

    def _ref(self, bid: int) -> None:
        b = self.blocks[bid]
        if b.ref_count == 0:
            del self.cached_ids[bid]  # a cached block comes back into use
        b.ref_count += 1

    def _register_full(self, seq: SeqBlocks, logical: int) -> None:
        """A block just became full: extend the hash chain, and offer it to the prefix cache."""
        bs = self.block_size
        chunk = tuple(seq.token_ids[logical * bs:(logical + 1) * bs])
        parent = seq.hashes[-1] if seq.hashes else None
        h = block_hash(parent, chunk)
        seq.hashes.append(h)
        if seq.logical is not None:
            # after an eviction, a new block's K/V were computed without the dropped tokens: they are
            # not what a full prefill of the same tokens would write, so no other request may hit them
            return
        b = self.blocks[seq.block_table[logical]]
        if self.enable_prefix_caching and h not in self.hash_to_block and b.hash is None:
            self.hash_to_block[h] = b.block_id
            b.hash, b.parent, b.token_ids = h, parent, chunk

    def allocation_cost(self, token_ids, hits: list[int] | None = None) -> tuple[int, int]:
        """``(needed, available)``: new blocks a prompt would take after prefix hits, and blocks free
        for it (hit blocks waiting in the LRU are not free for us: we are about to use them)."""
        token_ids = check_token_ids(token_ids)
        return self._cost(len(token_ids), self._match_prefix(token_ids) if hits is None else hits)

    def _cost(self, num_tokens: int, hits: list) -> tuple[int, int]:
        """A host hit saves the prefill but still needs a device block to be loaded into."""
        device = [bid for bid in hits if not isinstance(bid, HostHit)]
        cached_hits = sum(1 for bid in device if self.blocks[bid].ref_count == 0)
        return self.blocks_needed(num_tokens) - len(device), self.num_free_blocks - cached_hits

    def can_allocate(self, token_ids) -> bool:
        needed, available = self.allocation_cost(token_ids)
        return needed <= available

    def allocate(self, seq_id: int, token_ids, register: bool = True) -> int:
        """Give a new sequence blocks for its prompt; return how many prompt tokens were already cached.

        ``register=False`` keeps the prompt's full blocks out of the prefix cache until the caller
        says their K/V are (being) written (:meth:`mark_computed`): an engine that prefills a long
        prompt in chunks over several steps must not let another request "hit" a block that no
        forward will fill before that request reads it.
        Raises :class:`OutOfBlocksError` (changing nothing) when the pool cannot hold the prompt.
        """
        token_ids = check_token_ids(token_ids)
        if seq_id in self.seqs:
            raise ValueError(f"sequence {seq_id!r} is already allocated")
        if not token_ids:
            raise ValueError("token_ids must not be empty")
        hits = self._match_prefix(token_ids)
        needed, available = self._cost(len(token_ids), hits)
        if needed > available:
            raise OutOfBlocksError(needed, available, f"a prompt of {len(token_ids)} tokens")
        # commit: nothing below can fail
        self.finished.discard(seq_id)
        seq = SeqBlocks(token_ids=token_ids, cached_tokens=len(hits) * self.block_size)
        self.seqs[seq_id] = seq
        for bid in hits:  # device hits are taken first, so loading the host hits cannot evict them
            if not isinstance(bid, HostHit):
                self._ref(bid)
        for bid in hits:
            if isinstance(bid, HostHit):
                bid = self._load(bid)
            seq.block_table.append(bid)
            seq.hashes.append(self.blocks[bid].hash)
        for _ in range(needed - sum(isinstance(h, HostHit) for h in hits)):  # host hits were loaded above
            seq.block_table.append(self._take_block())
        bs = self.block_size
        for i in range(len(hits), len(seq.block_table)):
            self.blocks[seq.block_table[i]].num_tokens = min(bs, len(token_ids) - i * bs)
            if register and (i + 1) * bs <= len(token_ids):
                self._register_full(seq, i)
        if self.enable_prefix_caching:
            self.counters["prefix_queries"] += (len(token_ids) - 1) // bs
            self.counters["prefix_hits"] += len(hits)
            self.counters["host_hits"] += sum(isinstance(h, HostHit) for h in hits)
        return seq.cached_tokens

    def mark_computed(self, seq_id: int, num_computed: int) -> None:
        """The first ``num_computed`` tokens' K/V are in the pool, or are written by the forward about
        to run (which writes every new token's K/V before any attention reads): offer the full blocks
        among them to the prefix cache (after ``allocate(..., register=False)``). Idempotent."""
        seq = self._seq(seq_id)
        for i in range(len(seq.hashes), min(num_computed, len(seq.token_ids)) // self.block_size):
            self._register_full(seq, i)

    def can_append(self, seq_id: int) -> bool:
        seq = self._seq(seq_id)
        last = self.blocks[seq.block_table[-1]]
        needs_block = len(seq.token_ids) % self.block_size == 0 or last.ref_count > 1
        return not needs_block or self.num_free_blocks > 0

    def append_slot(self, seq_id: int, token_id: int) -> int:
        """Reserve the slot for one more token of a sequence and return it.

        A new block is taken only when the last one is full. If the last block is shared (after a
        fork) it is copied first (copy-on-write): the copy is queued in ``blocks_to_copy`` for the
        storage, which must apply it before writing the new token.
        """
        seq = self._seq(seq_id)
        (token_id,) = check_token_ids([token_id], "token_id")  # before anything changes
        bs = self.block_size
        n = len(seq.token_ids)
        own = self._append is append_slot  # kvlab's own rule changes the table in place; a plugged-in one is checked first
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
                self._check_append(seq.block_table, table, n, slot, copy, len(taken))
        except BaseException:
            for bid in taken:  # the pool as it was: the blocks taken go back
                self.blocks[bid].ref_count = 0
                self.free_ids.appendleft(bid)
            raise
        if n % bs == 0 and seq.logical is not None:  # a new block joined the table
            seq.logical.append(n // bs)
        if copy is not None:
            last = self.blocks[copy[0]]
            self.blocks[copy[1]].num_tokens = last.num_tokens
            last.ref_count -= 1
            self.blocks_to_copy.append(copy)
            self.counters["cow_copies"] += 1
        if not own:
            seq.block_table[:] = table
        seq.token_ids.append(token_id)
        block = self.blocks[seq.block_table[-1]]
        block.num_tokens += 1
        if block.num_tokens == bs:  # registers every full block not registered yet, in chain order
            self.mark_computed(seq_id, len(seq.token_ids))
        return slot

    def _check_append(self, before: list[int], table: list[int], n: int, slot, copy, taken: int) -> None:
        """A plugged-in append, held to what an append is: one new block exactly when the last is full,
        or a copy of a shared partial last block, and the slot of token ``n`` in the resulting table."""
        bs, grew = self.block_size, len(table) - len(before)
        ok = (grew == (n % bs == 0) and table[:len(before) - 1] == before[:-1]
              and slot == table[-1] * bs + n % bs and taken == grew + (copy is not None)
              and (copy is None or (copy == (before[-1], table[-1]) and grew == 0)))
        if not ok:
            raise ValueError(f"append returned slot {slot!r}, copy {copy!r} and table {table} for a sequence of "
                             f"{n} tokens with table {before} (block size {bs}): not a consistent append")

    def fork(self, parent_id: int, child_id: int) -> None:
        """The child shares every block of the parent (parallel sampling); the first write to the
        shared partial last block copies it."""
        parent = self._seq(parent_id)
        if child_id in self.seqs:
            raise ValueError(f"sequence {child_id!r} is already allocated")
        for bid in parent.block_table:
            self._ref(bid)
        self.finished.discard(child_id)
        self.seqs[child_id] = SeqBlocks(list(parent.block_table), list(parent.token_ids), list(parent.hashes),
                                        parent.cached_tokens,
                                        None if parent.logical is None else list(parent.logical))

    def free(self, seq_id: int, keep_cached: bool = True) -> None:
        """Release all of a sequence's blocks, tail first. Registered blocks stay cached (reusable
        by a later prefix hit) until evicted; the tail goes into the LRU first, so it is evicted
        before the prefix that other requests are likelier to share. ``keep_cached=False`` forgets
        their hashes too (after a failed forward their contents cannot be trusted)."""
        seq = self._seq(seq_id)
        for bid in reversed(seq.block_table):
            b = self.blocks[bid]
            b.ref_count -= 1
            if b.ref_count == 0:
                if b.hash is not None and not keep_cached:
                    del self.hash_to_block[b.hash]
                    b.hash, b.parent, b.token_ids = None, None, ()
                if b.hash is not None:
                    self.cached_ids[bid] = None
                else:
                    b.num_tokens = 0
                    self.free_ids.append(bid)
        del self.seqs[seq_id]
        self.finished.add(seq_id)

    def evict(self, seq_id: int, logical_blocks) -> int:
        """Drop some of a live sequence's blocks (an eviction policy's choice, :mod:`kvlab.cache.evict`):
        ``logical_blocks`` are logical indices (block i holds positions ``i * block_size ...``). Each must
        be full, still held, and not the sequence's last block (the one being written). The table keeps
        the other blocks in position order; attention reads only them. A dropped block goes back to the
        pool like a freed one (cached if it is registered, so another request's prefix can still hit
        it). Returns how many blocks went back to the pool (a block shared with another sequence stays
        theirs). Bad input raises ValueError and changes nothing."""
        seq = self._seq(seq_id)
        if isinstance(logical_blocks, (str, bytes)) or not hasattr(logical_blocks, "__iter__"):
            raise TypeError(f"logical_blocks must be a list of block indices, got {type(logical_blocks).__name__}")
        drop = list(logical_blocks)
        logical = self.logical_blocks(seq_id)
        last = self.blocks_needed(len(seq.token_ids)) - 1
        for lb in drop:
            if not is_int(lb):
                raise TypeError(f"logical_blocks must hold int block indices, got {type(lb).__name__} {lb!r}")
            if lb not in logical or lb >= last:
                raise ValueError(f"block {lb!r} of sequence {seq_id} cannot be evicted: the sequence holds blocks "
                                 f"{logical[:-1]} besides its last ({last}), which is being written")
        if len(set(drop)) != len(drop):
            raise ValueError(f"logical_blocks names a block twice: {sorted(drop)}")
        if not drop:
            return 0
        gone = set(drop)
        keep = [(l, bid) for l, bid in zip(logical, seq.block_table) if l not in gone]
        freed = 0
        for l, bid in zip(logical, seq.block_table):  # oldest first: earlier positions leave the LRU first
            if l in gone:
                b = self.blocks[bid]
                b.ref_count -= 1
                if b.ref_count == 0:
                    freed += 1
                    if b.hash is not None:
                        self.cached_ids[bid] = None
                    else:
                        b.num_tokens = 0
                        self.free_ids.append(bid)
        seq.block_table = [bid for _, bid in keep]
        seq.logical = [l for l, _ in keep]
        self.counters["policy_evictions"] += len(drop)
        return freed

    def take_blocks_to_copy(self) -> list[tuple[int, int]]:
        copies, self.blocks_to_copy = self.blocks_to_copy, []
        return copies

    # ---- accounting ------------------------------------------------------------------------------

    def stats(self) -> dict:
        used = [b for b in self.blocks if b.ref_count > 0]
        tokens = sum(b.num_tokens for b in used)  # physical: a shared block counts once
        logical = sum(len(s.token_ids) - s.evicted * self.block_size for s in self.seqs.values())
        slots = len(used) * self.block_size
        q, h = self.counters["prefix_queries"], self.counters["prefix_hits"]
        return {
            "kind": "paged",
            "num_blocks": self.num_blocks,
            "block_size": self.block_size,
            "blocks_used": len(used),
            "blocks_free": len(self.free_ids),
            "blocks_cached": len(self.cached_ids),
            "blocks_shared": sum(1 for b in used if b.ref_count > 1),
            "sequences": len(self.seqs),
            "tokens_stored": tokens,
            "logical_tokens": logical,  # tokens as the sequences see them (shared ones counted per sequence)
            "tokens_evicted": sum(s.evicted for s in self.seqs.values()) * self.block_size,  # by a policy, live ones
            "slots_reserved": slots,
            # slots of held blocks with no token in them *now*; while a sequence grows, its next tokens
            # fill them (not "internal fragmentation", which counts only slots nothing will ever fill)
            "empty_slots": slots - tokens,
            "empty_slot_share": 1 - tokens / slots if slots else 0.0,
            "prefix_queries": q,
            "prefix_hits": h,
            "prefix_hit_rate": h / q if q else 0.0,
            "blocks_saved": self.blocks_needed_for_all() - len(used),  # by prefix sharing and forks
            "sliding_window": self.sliding_window,
            "blocks_outside_window": self.blocks_outside_window(),
            "host_blocks": self.host_blocks,
            "host_blocks_used": len(self.host),
            **{k: v for k, v in self.counters.items() if k not in ("prefix_queries", "prefix_hits")},
        }

    def eviction_order(self) -> list[int]:
        """Cached blocks (freed, hash kept) in the order they would be evicted: least recently freed
        first. :meth:`free` adds a sequence's blocks tail first, so its end leaves before its prefix."""
        return list(self.cached_ids)

    def blocks_outside_window(self) -> int:
        """Held blocks no layer reads anymore: every token in them is before the window of the newest
        token of every sequence holding them (kvlab keeps them; vLLM would free them). 0 without
        ``sliding_window``."""
        if self.sliding_window is None:
            return 0
        outside, inside = set(), set()
        for s in self.seqs.values():
            # the newest token sits at position n - 1 and sees keys > n - 1 - window: block i is out of
            # reach when its last position (i + 1) * block_size - 1 <= n - 1 - window
            cut = max(0, (len(s.token_ids) - self.sliding_window) // self.block_size)
            logical = range(len(s.block_table)) if s.logical is None else s.logical
            for lb, bid in zip(logical, s.block_table):
                (outside if lb < cut else inside).add(bid)
        return len(outside - inside)

    def blocks_needed_for_all(self) -> int:
        """Blocks the live sequences would hold without any sharing (their kept blocks, after an eviction)."""
        return sum(self.blocks_needed(len(s.token_ids)) - s.evicted for s in self.seqs.values())

    def check_invariants(self) -> None:
        """Every block is free xor cached xor owned; refcounts equal table references; registered
        hashes match their tokens. Raises AssertionError with the first violation."""
        refs = [0] * self.num_blocks
        for s in self.seqs.values():
            for bid in s.block_table:
                refs[bid] += 1
            assert len(s.block_table) == self.blocks_needed(len(s.token_ids)) - s.evicted, "table size != tokens"
            if s.logical is not None:
                assert len(s.logical) == len(s.block_table), "logical indices != table entries"
                assert all(a < b for a, b in zip(s.logical, s.logical[1:])), "kept blocks out of position order"
                assert s.logical[-1] == self.blocks_needed(len(s.token_ids)) - 1, "the last block was evicted"
        free, cached = set(self.free_ids), set(self.cached_ids)
        assert len(free) == len(self.free_ids), "a block is twice in the free pool"
        assert not free & cached, "a block is both free and cached"
        for b in self.blocks:
            assert b.ref_count == refs[b.block_id], f"block {b.block_id}: refcount {b.ref_count} != {refs[b.block_id]}"
            owned = b.ref_count > 0
            assert owned + (b.block_id in free) + (b.block_id in cached) == 1, f"block {b.block_id} state"
            if b.block_id in cached:
                assert b.hash is not None, f"cached block {b.block_id} has no hash"
        for h, bid in self.hash_to_block.items():  # every registered (in use or cached) block
            b = self.blocks[bid]
            assert b.hash == h and len(b.token_ids) == self.block_size, f"block {bid} hash entry"
            assert h == block_hash(b.parent, b.token_ids), f"block {bid}: hash does not match its tokens"
        assert sum(b.hash is not None for b in self.blocks) == len(self.hash_to_block), "unindexed hashed block"
        slots = [slot for slot, _, _ in self.host.values()]
        assert len(set(slots)) == len(slots) and not set(slots) & set(self.host_free), "a host slot used twice"
        assert not set(self.host_loading) & (set(slots) | set(self.host_free)), "a loading host slot reused"
        assert len(slots) + len(self.host_free) + len(self.host_loading) == self.host_blocks, "host slots lost"
        assert not set(self.host) & set(self.hash_to_block), "a block both on the host and on the device"
        for s in self.seqs.values():  # a registered block's hash matches the chain over its tokens
            parent = None
            where = dict(enumerate(s.block_table)) if s.logical is None else dict(zip(s.logical, s.block_table))
            for i, h in enumerate(s.hashes):
                chunk = tuple(s.token_ids[i * self.block_size:(i + 1) * self.block_size])
                assert h == block_hash(parent, chunk), "hash chain does not match tokens"
                if i in where:  # an evicted block is no longer this sequence's
                    b = self.blocks[where[i]]
                    assert b.hash in (None, h), f"block {b.block_id} registered under another hash"
                parent = h
