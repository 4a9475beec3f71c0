"""The two contiguous KV caches every engine starts from (notebook 01), ``[B, H_kv, T, D]`` per layer.

:class:`ContiguousCache` is tight but copies the layer cache on every append (it counts the bytes);
:class:`StaticCache` copies nothing but reserves slots for nothing (it reports its utilization).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvlab.sizing import kv_config
from kvlab.validate import check_int, is_int

_DTYPE_NAMES = {torch.float32: "fp32", torch.float16: "fp16", torch.bfloat16: "bf16"}


def static_utilization(tokens_per_sequence, max_batch: int, max_seq_len: int) -> float:
    """Share of a static cache's reserved slots that hold real tokens: sum(tokens) / (rows x slots)."""
    return sum(tokens_per_sequence) / (max_batch * max_seq_len)


def static_tokens_stored(prompt_lens, answer_lens) -> list[int]:
    """Real tokens per row after one padded greedy batch: the prompt plus the tokens fed back. The last
    step's token is never fed back; a row that ended earlier writes pads after its EOS, not tokens."""
    prompt_lens, answer_lens = list(prompt_lens), list(answer_lens)
    if len(prompt_lens) != len(answer_lens) or not prompt_lens:
        raise ValueError(f"need one answer length per prompt, got {len(prompt_lens)} prompts and "
                         f"{len(answer_lens)} answers")
    fed = max(answer_lens) - 1
    return [p + min(a, fed) for p, a in zip(prompt_lens, answer_lens)]


def _check_kv(name: str, k: torch.Tensor, v: torch.Tensor) -> None:
    if not isinstance(k, torch.Tensor) or not isinstance(v, torch.Tensor):
        raise TypeError(f"{name}: keys and values must be tensors, got {type(k).__name__}, {type(v).__name__}")
    if k.dim() != 4 or k.shape != v.shape:
        raise ValueError(f"{name}: keys/values must both be [B, H_kv, T, D], got {tuple(k.shape)} and {tuple(v.shape)}")


@dataclass(frozen=True)
class CacheShape:
    """The per-layer geometry a cache needs, read from an HF config (or given by hand)."""

    num_layers: int
    num_kv_heads: int
    head_dim: int

    @classmethod
    def from_model(cls, model) -> "CacheShape":
        cfg = kv_config(model)
        return cls(cfg.num_layers, cfg.num_kv_heads, cfg.head_dim)


def grow(cached: torch.Tensor | None, new: torch.Tensor) -> torch.Tensor:
    """The growing cache's append (notebook 01, Task 1): the layer's tokens so far, then the new ones,
    along the token axis. ``cached`` (B, H_kv, T, D) or None before the first append; ``new``
    (B, H_kv, q_len, D). ``torch.cat`` makes a fresh tensor: the whole old cache is copied."""
    return new if cached is None else torch.cat([cached, new], dim=2)  # (B, H_kv, T + q_len, D)


def static_write(buffer: torch.Tensor, new: torch.Tensor, start: int) -> torch.Tensor:
    """The static cache's write (notebook 01, Task 3): put ``new`` (B, H_kv, q_len, D) into the reserved
    ``buffer`` (B_max, H_kv, T_max, D) at slots ``start .. start + q_len`` of the first B rows, in place,
    and return a view of every filled slot (B, H_kv, start + q_len, D): attention must never read the
    reserved slots that hold nothing yet."""
    b, q = new.shape[0], new.shape[2]
    buffer[:b, :, start:start + q] = new
    return buffer[:b, :, :start + q]


def check_layer(layer_idx, num_layers: int) -> None:
    """ValueError unless ``layer_idx`` is an int in ``0..num_layers - 1`` (every cache's update/write)."""
    if not is_int(layer_idx) or not 0 <= layer_idx < num_layers:
        raise ValueError(f"layer_idx must be in [0, {num_layers}), got {layer_idx!r}")


def _check_hook(name: str, fn) -> None:
    if fn is not None and not callable(fn):
        raise TypeError(f"{name} must be a function (or None for kvlab's own), got {type(fn).__name__}")


def _check_result(who: str, got, shape: tuple) -> None:
    """Catch a plugged-in function's wrong shape here, before attention fails on it."""
    if not isinstance(got, torch.Tensor) or tuple(got.shape) != shape:
        found = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
        raise ValueError(f"{who} returned {found}, expected a tensor of shape {shape} (B, H_kv, tokens, D)")


class ContiguousCache:
    """Grows by ``torch.cat`` on every append, like HF's DynamicCache; ``append`` replaces :func:`grow`."""

    kind = "dynamic"

    def __init__(self, num_layers: int, append=None):
        self.num_layers = check_int("num_layers", num_layers)
        _check_hook("append", append)
        self.append = append or grow
        self.keys: list[torch.Tensor | None] = [None] * num_layers  # each (B, H_kv, T, D)
        self.values: list[torch.Tensor | None] = [None] * num_layers
        self.bytes_copied = 0  # bytes moved by torch.cat into new tensors, over all layers
        self.appends = 0

    @classmethod
    def from_model(cls, model, append=None) -> "ContiguousCache":
        return cls(CacheShape.from_model(model).num_layers, append=append)

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Append ``k, v`` (B, H_kv, q_len, D) and return the layer's whole cache (B, H_kv, T, D)."""
        check_layer(layer_idx, self.num_layers)
        _check_kv("ContiguousCache.update", k, v)
        old_k, old_v = self.keys[layer_idx], self.values[layer_idx]
        if old_k is not None and (old_k.shape[:2], old_k.shape[3]) != (k.shape[:2], k.shape[3]):
            raise ValueError(f"ContiguousCache.update: new keys {tuple(k.shape)} do not match the cached "
                             f"{tuple(old_k.shape)} in batch, heads or head_dim")
        shape = (*k.shape[:2], (0 if old_k is None else old_k.shape[2]) + k.shape[2], k.shape[3])
        new_k, new_v = self.append(old_k, k), self.append(old_v, v)  # (B, H_kv, T + q_len, D)
        _check_result("append", new_k, shape)
        _check_result("append", new_v, shape)
        if old_k is None:
            new_k, new_v = new_k.contiguous(), new_v.contiguous()
        else:
            self.bytes_copied += old_k.nbytes + old_v.nbytes  # torch.cat copies the old cache into a new tensor
        self.keys[layer_idx], self.values[layer_idx] = new_k, new_v
        self.appends += 1
        return new_k, new_v

    def seq_len(self, layer_idx: int = 0) -> int:
        k = self.keys[layer_idx]
        return 0 if k is None else k.shape[2]

    @property
    def max_seq_len(self) -> int | None:
        return None

    def reset(self) -> None:
        self.keys = [None] * self.num_layers
        self.values = [None] * self.num_layers
        self.bytes_copied = 0
        self.appends = 0

    def stats(self) -> dict:
        allocated = sum(t.nbytes for t in self.keys + self.values if t is not None)
        k0 = self.keys[0]
        return {"kind": self.kind, "batch": 0 if k0 is None else k0.shape[0], "seq_len": self.seq_len(0),
                "bytes_allocated": allocated, "bytes_copied": self.bytes_copied, "appends": self.appends}


class StaticCache:
    """``max_batch`` x ``max_seq_len`` slots per layer, reserved up front like HF's ``StaticCache``.
    ``update`` returns views of the filled slots only, so the waste is memory, not compute."""

    kind = "static"

    def __init__(self, num_layers: int, max_batch: int, num_kv_heads: int, max_seq_len: int, head_dim: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu", write=None):
        for name, value in (("num_layers", num_layers), ("max_batch", max_batch), ("num_kv_heads", num_kv_heads),
                            ("max_seq_len", max_seq_len), ("head_dim", head_dim)):
            check_int(name, value)
        if not isinstance(dtype, torch.dtype) or not dtype.is_floating_point:
            raise TypeError(f"dtype must be a floating torch.dtype, got {dtype!r}")
        _check_hook("write", write)
        self.write = write or static_write  # write(buffer, new, start) -> view of the filled slots
        self.num_layers, self.max_batch, self.num_kv_heads = num_layers, max_batch, num_kv_heads
        self.max_seq_len, self.head_dim, self.dtype = max_seq_len, head_dim, dtype
        shape = (max_batch, num_kv_heads, max_seq_len, head_dim)  # (B_max, H_kv, T_max, D)
        self.k_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self.v_cache = [torch.zeros(shape, dtype=dtype, device=device) for _ in range(num_layers)]
        self._len = [0] * num_layers  # filled slots per layer (all rows advance together)
        self.batch = 0  # rows in use
        self.real_tokens: list[int] | None = None  # per row, when the caller knows (see set_real_tokens)

    @classmethod
    def from_model(cls, model, max_batch: int, max_seq_len: int, dtype: torch.dtype | None = None,
                   device=None, write=None) -> "StaticCache":
        shape = CacheShape.from_model(model)
        p = next(model.parameters())
        return cls(shape.num_layers, max_batch, shape.num_kv_heads, max_seq_len, shape.head_dim,
                   dtype=dtype or p.dtype, device=device or p.device, write=write)

    def set_real_tokens(self, tokens_per_row: list[int]) -> None:
        """How many of each row's filled slots are real tokens: the cache cannot tell a pad from a token,
        and without this call every filled slot counts as one."""
        tokens_per_row = list(tokens_per_row)
        if not all(is_int(t) for t in tokens_per_row):
            raise TypeError(f"tokens_per_row must be a list of ints, got {tokens_per_row!r}")
        if len(tokens_per_row) > self.max_batch or any(t < 0 for t in tokens_per_row):
            raise ValueError(f"tokens_per_row must have <= {self.max_batch} non-negative entries, got {tokens_per_row}")
        self.real_tokens = tokens_per_row

    def update(self, layer_idx: int, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Write ``k, v`` (B, H_kv, q_len, D) at the next free slots; return views (B, H_kv, T, D)."""
        check_layer(layer_idx, self.num_layers)
        _check_kv("StaticCache.update", k, v)
        b, h, q_len, d = k.shape
        start = self._len[layer_idx]
        # every check happens before the first write, so a refused update leaves the cache as it was
        if b > self.max_batch:
            raise ValueError(f"batch {b} exceeds this static cache's max_batch={self.max_batch}")
        if h != self.num_kv_heads or d != self.head_dim:
            raise ValueError(f"keys have {h} heads x {d} dims, the cache holds {self.num_kv_heads} x {self.head_dim}")
        if start > 0 and b != self.batch:
            raise ValueError(f"batch changed from {self.batch} to {b} mid-sequence; reset() the cache first")
        if start + q_len > self.max_seq_len:
            raise ValueError(f"static cache full: {start} + {q_len} tokens exceed max_seq_len={self.max_seq_len}")
        end = start + q_len
        k_all = self.write(self.k_cache[layer_idx], k, start)  # (B, H_kv, end, D): a view of the filled slots
        v_all = self.write(self.v_cache[layer_idx], v, start)
        _check_result("write", k_all, (b, h, end, d))
        _check_result("write", v_all, (b, h, end, d))
        self._len[layer_idx] = end
        self.batch = b
        return k_all, v_all

    def seq_len(self, layer_idx: int = 0) -> int:
        return self._len[layer_idx]

    def reset(self) -> None:
        """Forget the contents (the memory stays reserved, as in a real static cache)."""
        self._len = [0] * self.num_layers
        self.batch = 0
        self.real_tokens = None

    @property
    def bytes_reserved(self) -> int:
        return sum(t.nbytes for t in self.k_cache + self.v_cache)

    def stats(self) -> dict:
        """Where the reserved slots went: real tokens, padding, and slots never written."""
        slots, n = self.max_batch * self.max_seq_len, self._len[0]
        filled = n * self.batch
        per_row = [n] * self.batch if self.real_tokens is None else [min(t, n) for t in self.real_tokens[:self.batch]]
        tokens = sum(per_row)
        return {"kind": self.kind, "dtype": _DTYPE_NAMES.get(self.dtype, str(self.dtype)), "max_batch": self.max_batch,
                "max_seq_len": self.max_seq_len, "batch": self.batch, "seq_len": n, "slots_reserved": slots,
                "tokens_stored": tokens, "padding_slots": filled - tokens, "empty_slots": slots - filled,
                "utilization": static_utilization(per_row, self.max_batch, self.max_seq_len),
                "bytes_reserved": self.bytes_reserved, "bytes_holding_tokens": tokens * (self.bytes_reserved // slots)}
