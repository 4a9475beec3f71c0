"""The tensors behind a :class:`~kvlab.cache.paged.BlockManager` (notebook 02), and the one pool interface.

Pages are ``[num_blocks, block_size, H_kv, D]`` per layer, one layout for the PyTorch spec and the Triton
kernels, so a notebook can show the very tensor a kernel reads; slot ``s`` is row ``s`` of the flat view.
Backends and the engine reach a pool (float or quantized) only through these names:

| member                                   | what                                                     |
|------------------------------------------|----------------------------------------------------------|
| ``num_layers, num_blocks, block_size, num_kv_heads, head_dim`` | the geometry             |
| ``is_quantized``, ``rotate_k``           | stored values are codes / keys are Hadamard-rotated       |
| ``formats(layer)``                       | how K and V of a layer are stored (two ``TensorFormat`` s) |
| ``write(layer, k, v, slot_mapping)``     | new tokens' K/V (T, H_kv, D) to their slots               |
| ``read(layer, block_ids)``               | K, V of some blocks as float32 (n, block_size, H_kv, D)   |
| ``read_k(layer, block_ids)``             | K alone, as ``read`` (an eviction policy's scores)        |
| ``layer_pages(layer)``                   | the stored page tensors themselves (float pools)          |
| ``copy_blocks(blocks_to_copy)``          | copy-on-write copies ``(src, dst)`` in every layer        |
| ``kernel_operands(layer)``               | K and V as :class:`kvlab.kernels.pool.Operand` (views)    |
| ``kernel_write(layer, k, v, slot_mapping, launch)`` | a write whose scatter runs in ``launch`` (a kernel), with the pool's own bookkeeping around it |
| ``counters_snapshot()`` / ``restore_counters(s)`` | write counters to put back after an aborted step |
| ``bytes_reserved, bytes_per_block, fixed_bytes`` | the bytes it holds                               |
"""

from __future__ import annotations

import torch

from kvlab.cache.naive import check_layer
from kvlab.cache.paged import check_block_size
from kvlab.kernels.pool import FLOAT, Operand
from kvlab.quant.config import TensorFormat
from kvlab.sizing import kv_config
from kvlab.validate import cdiv, check_int


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table, num_tokens: int):
    """One sequence's K and V, (num_tokens, H_kv, D), from ``[num_blocks, block_size, H_kv, D]`` pages."""
    block_size = k_cache.shape[1]
    n_blocks = cdiv(num_tokens, block_size)
    table = torch.as_tensor(block_table[:n_blocks], device=k_cache.device, dtype=torch.long)
    # index_select: the same copy as k_cache[table], several times faster on the CPU
    k = k_cache.index_select(0, table).flatten(0, 1)[:num_tokens]  # (n_blocks * block_size, H_kv, D) -> (T, H_kv, D)
    v = v_cache.index_select(0, table).flatten(0, 1)[:num_tokens]
    return k, v


def dtype_label(dtype: torch.dtype) -> str:
    """torch.float16 -> 'fp16', the lab's name for a float storage dtype."""
    return str(dtype).replace("torch.", "").replace("bfloat", "bf").replace("float", "fp")


class PagedKVCache:
    """Float pages, ``[num_blocks, block_size, H_kv, D]`` per layer for K and for V."""

    is_quantized = False
    rotate_k = False

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu"):
        for name, value in (("num_layers", num_layers), ("num_blocks", num_blocks), ("num_kv_heads", num_kv_heads),
                            ("head_dim", head_dim)):
            check_int(name, value)
        self.block_size = check_block_size(block_size)
        self.num_layers, self.num_blocks, self.num_kv_heads, self.head_dim = num_layers, num_blocks, num_kv_heads, head_dim
        self.dtype = dtype
        shape = (num_blocks, block_size, num_kv_heads, head_dim)  # (N_blocks, block_size, H_kv, D)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]

    @classmethod
    def from_model(cls, model, num_blocks: int, block_size: int = 16, dtype: torch.dtype | None = None,
                   device=None) -> "PagedKVCache":
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
        check_layer(layer_idx, self.num_layers)
        flat = (-1, self.num_kv_heads, self.head_dim)
        try:  # an out-of-pool slot fails on the first write (K), before anything was written
            self.k_cache[layer_idx].view(flat)[slot_mapping] = k.to(self.dtype)
        except IndexError:
            raise ValueError(f"slot_mapping must hold slots in [0, {self.num_blocks * self.block_size}) "
                             f"({self.num_blocks} blocks of {self.block_size})") from None
        self.v_cache[layer_idx].view(flat)[slot_mapping] = v.to(self.dtype)

    def kernel_write(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                     launch) -> None:
        """The write with the scatter done by ``launch`` (the Triton kernel); a float pool keeps no books."""
        launch(k, v, slot_mapping, *self.kernel_operands(layer_idx))

    def copy_blocks(self, blocks_to_copy) -> None:
        """Apply copy-on-write copies ``(src, dst)`` in every layer."""
        if not blocks_to_copy:
            return
        src, dst = torch.tensor(blocks_to_copy, device=self.k_cache[0].device).T
        for kc, vc in zip(self.k_cache, self.v_cache):
            kc[dst] = kc[src]
            vc[dst] = vc[src]

    def attach_host(self, num_host_blocks: int) -> None:
        """The same layout in host memory, pinned on a GPU so copies run at the link's speed (notebook 07)."""
        check_int("num_host_blocks", num_host_blocks)
        shape = (num_host_blocks, *self.k_cache[0].shape[1:])
        pin = self.k_cache[0].device.type == "cuda"
        self.host_k = [torch.zeros(shape, dtype=self.dtype, pin_memory=pin) for _ in range(self.num_layers)]
        self.host_v = [torch.zeros(shape, dtype=self.dtype, pin_memory=pin) for _ in range(self.num_layers)]

    def swap(self, out, into) -> None:
        """Apply the host transfers in every layer, ``out`` (device block, host slot) before ``into``."""
        if not out and not into:
            return
        if getattr(self, "host_k", None) is None:
            raise ValueError("this pool has no host tier: attach_host(n) first")
        dev = self.k_cache[0].device
        for pairs, to_host in ((out, True), (into, False)):
            if not pairs:
                continue
            a = torch.tensor([p[0] for p in pairs])
            b = torch.tensor([p[1] for p in pairs])
            for layer in range(self.num_layers):
                for pages, host in ((self.k_cache[layer], self.host_k[layer]), (self.v_cache[layer], self.host_v[layer])):
                    if to_host:  # device blocks a -> host slots b
                        host[b] = pages[a.to(dev)].to("cpu")
                    else:  # host slots a -> device blocks b
                        pages[b.to(dev)] = host[a].to(dev, non_blocking=True)

    def layer_pages(self, layer_idx: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The K and V pages of one layer, ``[num_blocks, block_size, H_kv, D]`` each (no copy)."""
        return self.k_cache[layer_idx], self.v_cache[layer_idx]

    def read(self, layer_idx: int, block_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """K and V of some blocks as float32, (n, block_size, H_kv, D) each (a copy)."""
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=self.k_cache[layer_idx].device).flatten()
        return self.read_k(layer_idx, ids), self.v_cache[layer_idx].index_select(0, ids).float()

    def read_k(self, layer_idx: int, block_ids: torch.Tensor) -> torch.Tensor:
        """K alone, as :meth:`read` (what an eviction policy's attention scores read)."""
        ids = torch.as_tensor(block_ids, dtype=torch.long, device=self.k_cache[layer_idx].device).flatten()
        return self.k_cache[layer_idx].index_select(0, ids).float()

    def gather(self, layer_idx: int, block_table, num_tokens: int) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's K and V, (num_tokens, H_kv, D), read through its block table (a copy)."""
        return gather_kv(self.k_cache[layer_idx], self.v_cache[layer_idx], block_table, num_tokens)

    def kernel_operands(self, layer_idx: int) -> tuple[Operand, Operand]:
        """(K, V) of one layer as the kernels read them: views of the pages, nothing copied."""
        label = dtype_label(self.dtype)
        return Operand(self.k_cache[layer_idx], FLOAT, label=label), Operand(self.v_cache[layer_idx], FLOAT, label=label)

    def formats(self, layer_idx: int) -> tuple[TensorFormat, TensorFormat]:
        """How K and V of one layer are stored: both in the pool's float dtype."""
        fmt = TensorFormat(dtype_label(self.dtype))
        return fmt, fmt

    def counters_snapshot(self) -> list:
        """A float pool keeps no write counters: nothing to put back after an aborted step."""
        return []

    def restore_counters(self, snapshot: list) -> None:
        pass

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
