"""Blocks a live sequence no longer reads: the block manager's side of eviction and sliding windows.

After eviction a table holds the kept blocks in position order, ``SeqBlocks.logical`` their indices.
Blocks out of a sliding window are kept until the sequence finishes, so later prompts can still hit
them (vLLM frees them as the window passes).
"""

from __future__ import annotations

import math

from kvlab.validate import is_int


def checked_drop(seq_id: int, seq, logical_blocks, block_size: int) -> list[int]:
    """``logical_blocks`` as a list: each held by the sequence, never its last (being written), none twice."""
    if isinstance(logical_blocks, (str, bytes)) or not hasattr(logical_blocks, "__iter__"):
        raise TypeError(f"logical_blocks must be a list of block indices, got {type(logical_blocks).__name__}")
    drop, logical = list(logical_blocks), seq.logical_blocks()
    last = math.ceil(len(seq.token_ids) / block_size) - 1
    for lb in drop:
        if not is_int(lb):
            raise TypeError(f"logical_blocks must hold int block indices, got {type(lb).__name__} {lb!r}")
        if lb not in logical or lb >= last:
            raise ValueError(f"block {lb!r} of sequence {seq_id} cannot be evicted: the sequence holds blocks "
                             f"{logical[:-1]} besides its last ({last}), which is being written")
    if len(set(drop)) != len(drop):
        raise ValueError(f"logical_blocks names a block twice: {sorted(drop)}")
    return drop


def shift_after_drops(seq_id: int, seq, start: int, block_size: int) -> int:
    """Positions dropped before token ``start``, by which its table index moves down; a ValueError when
    ``start`` is not past every dropped block (those tokens have no slot)."""
    if seq.logical is None:
        return 0
    kept = set(seq.logical)
    first = max(lb for lb in range(seq.logical[-1]) if lb not in kept) + 1
    if start < first * block_size:
        raise ValueError(f"tokens before position {first * block_size} of sequence {seq_id} include "
                         f"evicted blocks: they have no slot")
    return seq.evicted * block_size


def blocks_outside_window(seqs, window: int | None, block_size: int) -> int:
    """Held blocks no layer reads: before the window of every sequence holding them; 0 without a window."""
    if window is None:
        return 0
    outside, inside = set(), set()
    for s in seqs:
        # the newest token, at n - 1, sees keys > n - 1 - window: block i is out of reach when its last
        # position (i + 1) * block_size - 1 <= n - 1 - window
        cut = max(0, (len(s.token_ids) - window) // block_size)
        for lb, bid in zip(s.logical_blocks(), s.block_table):
            (outside if lb < cut else inside).add(bid)
    return len(outside - inside)
