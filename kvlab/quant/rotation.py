"""Hadamard rotation of keys (and queries) before low-bit quantization (notebook 03).

A few channels of K carry most of its magnitude (outliers), so one scale per group must stretch
to cover them and every other channel gets coarse steps. Multiplying by an orthonormal Hadamard
matrix H spreads each outlier over all channels. Attention is unchanged, because
``(q H) . (k H) = q H H^T k = q . k`` for orthonormal H: rotate K when storing it and Q when
attending, and never rotate back.
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
