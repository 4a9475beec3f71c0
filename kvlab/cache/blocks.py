"""What the block manager (:mod:`kvlab.cache.paged`) is made of, and what it is held to (notebook 02)."""

from __future__ import annotations

import hashlib
import math
import operator
from dataclasses import dataclass, field

from kvlab.validate import check_power_of_two, is_int


class OutOfBlocksError(RuntimeError):
    """Nothing was changed, so the caller may preempt another sequence (notebook 04) and retry."""

    def __init__(self, needed: int, available: int, what: str):
        self.needed, self.available = needed, available
        super().__init__(f"out of KV blocks: {what} needs {needed} block(s), {available} available")


def block_hash(parent: bytes | None, token_ids) -> bytes:
    """A full block's key, chained to its parent's so equal blocks after different prefixes differ.
    hashlib, not hash(): Python's hash() is salted per process."""
    h = hashlib.blake2b(digest_size=16)
    h.update(parent or b"\0" * 16)
    h.update(b"".join(int(t).to_bytes(4, "little", signed=True) for t in token_ids))
    return h.digest()


@dataclass
class Block:
    block_id: int
    ref_count: int = 0
    num_tokens: int = 0  # filled slots
    hash: bytes | None = None  # set while registered in the prefix cache
    parent: bytes | None = None  # the previous block's hash in the chain
    token_ids: tuple[int, ...] = ()  # a registered block's tokens: a hash hit is confirmed against them


@dataclass
class SeqBlocks:
    """One sequence's view of the pool."""

    block_table: list[int] = field(default_factory=list)
    token_ids: list[int] = field(default_factory=list)  # tokens whose K/V are (or will be) in the cache
    hashes: list[bytes] = field(default_factory=list)  # chain hash of each full block
    cached_tokens: int = 0  # prompt tokens found in the prefix cache at allocate()
    #: the logical block index (position // block_size) of each table entry once a policy dropped blocks
    #: (:mod:`kvlab.cache.dropped`); None while nothing was dropped (entry i is logical block i)
    logical: list[int] | None = None

    @property
    def evicted(self) -> int:
        """Blocks an eviction policy dropped from this sequence."""
        return 0 if self.logical is None else self.logical[-1] + 1 - len(self.logical)

    def logical_blocks(self) -> list[int]:
        return list(range(len(self.block_table))) if self.logical is None else list(self.logical)


INT32 = 2**31


def check_token_ids(ids, name: str = "token_ids", vocab_size: int | None = None) -> list[int]:
    """Token ids as Python ints (integer scalars too, never bools), in the vocabulary or else within
    the 32 bits the block hash stores; every entry point taking tokens uses it."""
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


def check_hits(hits, token_ids: list[int], block_size: int, blocks: list[Block]) -> list[int]:
    """A plugged-in prefix match must name the prompt's leading full blocks, each holding just its tokens."""
    bs = block_size
    if not isinstance(hits, (list, tuple)) or len(hits) > (len(token_ids) - 1) // bs:
        raise ValueError(f"prefix_match must return a list of at most {(len(token_ids) - 1) // bs} block ids "
                         f"(the full blocks before the last prompt token), got {hits!r}")
    for i, bid in enumerate(hits):
        chunk = tuple(token_ids[i * bs:(i + 1) * bs])
        if not is_int(bid) or not 0 <= bid < len(blocks) or blocks[bid].token_ids != chunk:
            raise ValueError(f"prefix_match returned block {bid!r} for the prompt's block {i}, which does not "
                             "hold those tokens after that prefix")
    return list(hits)


def check_append(before: list[int], table: list[int], n: int, bs: int, slot, copy, taken: int) -> None:
    """A plugged-in append must take a block only when the last is full (or copy a shared one) and
    return token ``n``'s slot."""
    grew = len(table) - len(before)
    ok = (grew == (n % bs == 0) and table[:len(before) - 1] == before[:-1]
          and slot == table[-1] * bs + n % bs and taken == grew + (copy is not None)
          and (copy is None or (copy == (before[-1], table[-1]) and grew == 0)))
    if not ok:
        raise ValueError(f"append returned slot {slot!r}, copy {copy!r} and table {table} for a sequence of "
                         f"{n} tokens with table {before} (block size {bs}): not a consistent append")


def check_pool(bm) -> None:
    """A block manager's invariants (:meth:`~kvlab.cache.paged.BlockManager.check_invariants`)."""
    needed = lambda s: math.ceil(len(s.token_ids) / bm.block_size)  # noqa: E731
    refs = [0] * bm.num_blocks
    for s in bm.seqs.values():
        for bid in s.block_table:
            refs[bid] += 1
        assert len(s.block_table) == needed(s) - s.evicted, "table size != tokens"
        if s.logical is not None:
            assert len(s.logical) == len(s.block_table), "logical indices != table entries"
            assert all(a < b for a, b in zip(s.logical, s.logical[1:])), "kept blocks out of position order"
            assert s.logical[-1] == needed(s) - 1, "the last block was evicted"
    free, cached = set(bm.free_ids), set(bm.cached_ids)
    assert len(free) == len(bm.free_ids), "a block is twice in the free pool"
    assert not free & cached, "a block is both free and cached"
    for b in bm.blocks:
        assert b.ref_count == refs[b.block_id], f"block {b.block_id}: refcount {b.ref_count} != {refs[b.block_id]}"
        assert (b.ref_count > 0) + (b.block_id in free) + (b.block_id in cached) == 1, f"block {b.block_id} state"
        assert b.block_id not in cached or b.hash is not None, f"cached block {b.block_id} has no hash"
    for h, bid in bm.hash_to_block.items():  # every registered (in use or cached) block
        b = bm.blocks[bid]
        assert b.hash == h and len(b.token_ids) == bm.block_size, f"block {bid} hash entry"
        assert h == block_hash(b.parent, b.token_ids), f"block {bid}: hash does not match its tokens"
    assert sum(b.hash is not None for b in bm.blocks) == len(bm.hash_to_block), "unindexed hashed block"
    bm.host.check()
    assert not set(bm.host.entries) & set(bm.hash_to_block), "a block both on the host and on the device"
    for s in bm.seqs.values():  # a registered block's hash matches the chain over its tokens
        parent, where = None, dict(zip(s.logical_blocks(), s.block_table))
        for i, h in enumerate(s.hashes):
            chunk = tuple(s.token_ids[i * bm.block_size:(i + 1) * bm.block_size])
            assert h == block_hash(parent, chunk), "hash chain does not match tokens"
            if i in where:  # an evicted block is no longer this sequence's
                b = bm.blocks[where[i]]
                assert b.hash in (None, h), f"block {b.block_id} registered under another hash"
            parent = h
