"""The tensors behind a :class:`~kvlab.cache.paged.BlockManager` (notebook 02).

Per layer, ``k_cache`` and ``v_cache`` are ``[num_blocks, block_size, H_kv, D]``: one layout end to
end, shared by the PyTorch reference attention (:mod:`kvlab.attention`) and the Triton kernels, so
a notebook can show the very tensor a kernel reads. Slot ``s`` is row ``s`` of the flattened
``[num_blocks * block_size, H_kv, D]`` view.
"""

from __future__ import annotations

import torch

from kvlab.cache.paged import _check_block_size


class PagedKVCache:
    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"{name} must be a positive integer, got {value!r}")
        self.block_size = _check_block_size(block_size)
        self.num_layers, self.num_blocks, self.num_kv_heads, self.head_dim = num_layers, num_blocks, num_kv_heads, head_dim
        self.dtype = dtype
        shape = (num_blocks, block_size, num_kv_heads, head_dim)  # (N_blocks, block_size, H_kv, D)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def from_model(cls, model, num_blocks: int, block_size: int = 16, dtype: torch.dtype | None = None,
                   device=None) -> "PagedKVCache":
        from kvlab.sizing import kv_config

        cfg = kv_config(model)
        p = next(model.parameters())
        return cls(cfg.num_layers, num_blocks, block_size, cfg.num_kv_heads, cfg.head_dim,
                   dtype=dtype or p.dtype, device=device or p.device)

    def write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """Scatter ``k, v`` of shape (N, H_kv, D) to their slots (N,)."""
        if k.shape != v.shape or k.dim() != 3 or k.shape[1:] != (self.num_kv_heads, self.head_dim):
            raise ValueError(f"k/v must be (N, {self.num_kv_heads}, {self.head_dim}), got {tuple(k.shape)}, {tuple(v.shape)}")
        if slot_mapping.shape != (k.shape[0],):
            raise ValueError(f"slot_mapping must have one slot per token: {tuple(slot_mapping.shape)} vs {k.shape[0]} tokens")
        if isinstance(layer_idx, bool) or not isinstance(layer_idx, int) or not 0 <= layer_idx < self.num_layers:
            raise ValueError(f"layer_idx must be in [0, {self.num_layers}), got {layer_idx!r}")
        flat = (-1, self.num_kv_heads, self.head_dim)
        try:  # an out-of-pool slot fails on the first write (K), before anything was written
            self.k_cache[layer_idx].view(flat)[slot_mapping] = k.to(self.dtype)
        except IndexError:
            raise ValueError(f"slot_mapping must hold slots in [0, {self.num_blocks * self.block_size}) "
                             f"({self.num_blocks} blocks of {self.block_size})") from None
        self.v_cache[layer_idx].view(flat)[slot_mapping] = v.to(self.dtype)

    def copy_blocks(self, pairs) -> None:
        """Apply copy-on-write copies ``(src, dst)`` in every layer."""
        if not pairs:
            return
        src = torch.tensor([s for s, _ in pairs], device=self.k_cache[0].device)
        dst = torch.tensor([d for _, d in pairs], device=self.k_cache[0].device)
        for kc, vc in zip(self.k_cache, self.v_cache):
            kc[dst] = kc[src]
            vc[dst] = vc[src]

    def gather(self, layer_idx: int, block_table, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's K and V, (num_tokens, H_kv, D), read through its block table (a copy)."""
        from kvlab.attention import gather_kv

        return gather_kv(self.k_cache[layer_idx], self.v_cache[layer_idx], block_table, num_tokens)

    @property
    def bytes_reserved(self) -> int:
        return sum(t.nbytes for t in self.k_cache + self.v_cache)

    @property
    def bytes_per_block(self) -> int:
        return self.bytes_reserved // self.num_blocks

    @property
    def fixed_bytes(self) -> int:
        """Bytes not in any block (a float pool has none; a quantized one has its scale tables)."""
        return 0
