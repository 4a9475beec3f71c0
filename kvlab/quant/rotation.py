"""Hadamard rotation of keys (and queries) before low-bit quantization (notebook 03).

It spreads K's outlier channels over all channels, so one scale no longer stretches for them; attention
is unchanged since ``(q H) . (k H) = q . k``, so rotate K when storing, Q when attending, never back.
"""

from __future__ import annotations

from functools import lru_cache

import torch


@lru_cache(maxsize=8)
def hadamard(n: int) -> torch.Tensor:
    """Orthonormal Sylvester Hadamard matrix of size n (a power of two), float32."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard size must be a power of two, got {n}")
    h = torch.ones(1, 1)
    while h.shape[0] < n:
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return h / n ** 0.5


def rotate(x: torch.Tensor) -> torch.Tensor:
    """Rotate the last (head_dim) axis: x @ H."""
    return (x.float() @ hadamard(x.shape[-1]).to(x.device)).to(x.dtype)
