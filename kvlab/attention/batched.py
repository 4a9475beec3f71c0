"""Attention for a whole step at once over the paged pool (notebook 04: the ``"torch"`` backend).

A step's block tables fit in ONE tensor, built once and read by every layer, so one gather and one
masked SDPA replace the spec's Python loop; equal to the spec within fp32 rounding.
"""

from __future__ import annotations

import torch

from kvlab.attention.spec import scores_softmax
from kvlab.quant.rotation import rotate
from kvlab.validate import cdiv, check_attention_features as check_features


def _table_tensor(block_tables, n_blocks: int, device) -> torch.Tensor:
    """Block tables as one (B, n_blocks) tensor of physical block ids, 0-padded, cut at n_blocks."""
    table = torch.zeros((len(block_tables), n_blocks), dtype=torch.long)
    for i, t in enumerate(block_tables):
        t = t[:n_blocks]
        table[i, :len(t)] = torch.as_tensor(t, dtype=torch.long)
    return table.to(device)


class DecodeIndex:
    """One step's decode block tables: ``table`` (B, n_blocks) block ids (0-padded), ``valid``
    (B, n_blocks * block_size) which key positions exist, ``seq_lens`` (B,)."""

    #: at most this many length groups in :meth:`groups` (1: one padded gather for all decodes)
    max_groups = 4
    #: a group's fixed cost (one more gather + SDPA call), in padded (row x block) units
    group_overhead = 48

    def __init__(self, block_tables, seq_lens, block_size: int, device="cpu"):
        self.num = len(block_tables)
        self._tables, self._lens, self._block_size, self._device = block_tables, list(seq_lens), block_size, device
        self._groups = None
        n_blocks = cdiv(max(seq_lens), block_size)
        self.table = _table_tensor(block_tables, n_blocks, device)
        self.flat, self.scratch = self.table.flatten(), {}  # :func:`gather_pages`
        self.seq_lens = torch.as_tensor(seq_lens, dtype=torch.long, device=device)
        pos = torch.arange(n_blocks * block_size, device=device)
        self.valid = pos[None, :] < self.seq_lens[:, None]  # (B, n_blocks * block_size)
        self._pos, self._windowed = pos, {None: self.valid}

    def groups(self) -> list[tuple[torch.Tensor | None, "DecodeIndex"]]:
        """Up to :attr:`max_groups` ``(rows, index)`` groups of similar context length (``rows`` None: one).
        Contexts are heavy-tailed, so padding all to the longest would attend mostly padding."""
        if self._groups is None:
            self._groups = self._split()
        return self._groups

    def _split(self):
        n, bs = self.num, self._block_size
        if n < 2 or self.max_groups < 2:
            return [(None, self)]
        order = sorted(range(n), key=self._lens.__getitem__)
        blocks = [cdiv(self._lens[i], bs) for i in order]
        best_cost, best = n * blocks[-1] + self.group_overhead, None
        for k in range(2, min(self.max_groups, n) + 1):
            bounds = [0] + [round(n * j / k) for j in range(1, k + 1)]
            cost = sum((b - a) * blocks[b - 1] for a, b in zip(bounds, bounds[1:])) + k * self.group_overhead
            if cost < best_cost:
                best_cost, best = cost, bounds
        if best is None:
            return [(None, self)]
        out = []
        for a, b in zip(best, best[1:]):
            rows = order[a:b]
            sub = DecodeIndex([self._tables[i] for i in rows], [self._lens[i] for i in rows], bs, self._device)
            sub.max_groups = 1
            out.append((torch.as_tensor(rows, dtype=torch.long, device=self._device), sub))
        return out

    def visible(self, window: int | None = None) -> torch.Tensor:
        """(B, S) the keys each new token sees under a sliding window; cached per window for the step."""
        if window not in self._windowed:
            check_features(1, window)
            self._windowed[window] = self.valid & (self._pos[None, :] >= self.seq_lens[:, None] - window)
        return self._windowed[window]


def step_buffer(index, which: str, shape: tuple, dtype: torch.dtype, device) -> torch.Tensor:
    """One buffer per ``which`` ("k", "v") for the step ``index`` describes, that every layer reuses. A fresh
    tensor per layer paid its page faults each time (glibc maps one that large anew and unmaps it when
    freed): 16 requests x 1k tokens, 2 cores, 2.9 -> 0.5 ms a gather, a decode step ~420 -> ~210 ms."""
    buf = index.scratch.get(which)
    if buf is None or buf.shape != shape or buf.dtype != dtype or buf.device != device:
        buf = index.scratch[which] = torch.empty(shape, dtype=dtype, device=device)
    return buf


def gather_pages(index, pages: torch.Tensor, which: str) -> torch.Tensor:
    """``pages`` (num_blocks, bs, H, D) -> (rows x n_blocks, bs, H, D): the blocks of ``index.table``, in
    the step's buffer (:func:`step_buffer`)."""
    buf = step_buffer(index, which, (index.flat.numel(), *pages.shape[1:]), pages.dtype, pages.device)
    return torch.index_select(pages, 0, index.flat, out=buf)


def _decode_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float,
                 softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, H_q, D); k, v (B, S, H_kv, D); valid (B, S) -> (B, H_q, D). GQA without repeating K/V:
    a KV head's G query heads ride on SDPA's query-length axis."""
    b, h_q, d = q.shape
    h_kv = k.shape[2]
    check_features(h_q, None, softcap, sinks)
    qh = q.reshape(b, h_kv, h_q // h_kv, d)  # (B, H_kv, G, D)
    kt, vt = k.transpose(1, 2), v.transpose(1, 2)  # (B, H_kv, S, D)
    if softcap is None and sinks is None:
        out = torch.nn.functional.scaled_dot_product_attention(qh, kt, vt, attn_mask=valid[:, None, None, :],
                                                               scale=scale)
    else:
        s = torch.matmul(qh, kt.transpose(-1, -2)) * scale  # (B, H_kv, G, S)
        p = scores_softmax(s[:, :, :, None], valid[:, None, None, None, :], softcap, sinks)[:, :, :, 0]
        out = torch.matmul(p.to(vt.dtype), vt)
    return out.reshape(b, h_q, d)


def batched_decode_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: DecodeIndex,
                             scale: float, *, window: int | None = None, softcap: float | None = None,
                             sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, H_q, D), one token per sequence: one gather and one masked SDPA per length group."""
    groups = index.groups()
    if len(groups) > 1:
        out = torch.empty_like(q)
        for rows, sub in groups:
            out[rows] = batched_decode_attention(q[rows], k_cache, v_cache, sub, scale, window=window, softcap=softcap,
                                                 sinks=sinks)
        return out
    b, n_blocks = index.table.shape
    shape = (b, n_blocks * k_cache.shape[1], *k_cache.shape[2:])  # (B, S, H_kv, D)
    # index_select, not k_cache[table]: the same copy, ~6x faster (advanced indexing takes a general path)
    k = gather_pages(index, k_cache, "k").reshape(shape)  # (B * n_blocks, bs, H_kv, D) -> (B, S, H_kv, D)
    v = gather_pages(index, v_cache, "v").reshape(shape)
    return _decode_sdpa(q, k, v, index.visible(window), scale, softcap, sinks)


def quantized_batched_decode_attention(q, k_new, v_new, cache, layer: int, index: DecodeIndex,
                                       scale: float, *, window: int | None = None, softcap: float | None = None,
                                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Over a quantized pool: cached blocks dequantized in one read, the own new token at full precision."""
    b, n_blocks = index.table.shape
    shape = (b * n_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim)
    out = tuple(step_buffer(index, w, shape, torch.float32, q.device) for w in "kv")
    k, v = cache.read(layer, index.flat, out=out)  # (B * n_blocks, bs, H_kv, D) float32 each
    k, v = k.reshape(b, -1, *k.shape[2:]), v.reshape(b, -1, *v.shape[2:])  # (B, S, H_kv, D)
    own = index.seq_lens - 1
    rows = torch.arange(b, device=k.device)
    qf, k_own = q.float(), k_new.float()
    if cache.rotate_k:  # cached keys are stored rotated; rotation is orthogonal, so rotate q and k_own too
        qf, k_own = rotate(qf), rotate(k_own)  # along head_dim
    k[rows, own], v[rows, own] = k_own, v_new.float()
    return _decode_sdpa(qf, k, v, index.visible(window), scale, softcap, sinks).to(q.dtype)


class PrefillIndex:
    """One step's prefill chunks as tensors: ``table`` (P, n_blocks), ``q_index`` (P, L) the packed row of
    each padded query slot (L: the longest chunk), ``q_rows`` the real ones, in packed order."""

    #: batch the chunks only while padding at most doubles the (query x key) work
    max_padding = 2.0

    @classmethod
    def pays(cls, seq_lens, query_lens, block_size: int) -> bool:
        """Whether one padded call beats the per-sequence spec: little padding. One chunk alone pays too
        (no padding but the last block's): its single call ran a 1,000-token prompt in half the spec's
        time and a 40-token one no slower (SmolLM2, 2 cores)."""
        if not seq_lens:
            return False
        s = cdiv(max(seq_lens), block_size) * block_size
        padded = len(seq_lens) * max(query_lens) * s
        return padded <= cls.max_padding * sum(q * c for q, c in zip(query_lens, seq_lens))

    def __init__(self, block_tables, seq_lens, query_lens, block_size: int, device="cpu"):
        self.num = len(block_tables)
        n_blocks = cdiv(max(seq_lens), block_size)
        self.table = _table_tensor(block_tables, n_blocks, device)
        self.flat, self.scratch = self.table.flatten(), {}  # :func:`gather_pages`
        self.max_query_len = max(query_lens)
        lens = torch.as_tensor(seq_lens, dtype=torch.long)
        qlens = torch.as_tensor(query_lens, dtype=torch.long)
        slot = torch.arange(self.max_query_len)
        real = slot[None, :] < qlens[:, None]  # (P, L)
        starts = torch.cumsum(qlens, 0) - qlens
        self.q_index = torch.where(real, starts[:, None] + slot[None, :], 0).to(device)  # padding reads row 0
        self.q_rows = torch.nonzero(real.flatten()).flatten().to(device)  # (T,) in packed order
        # absolute position of each query; a padding slot stands at its sequence's last token (it sees keys)
        self.q_pos = torch.where(real, (lens - qlens)[:, None] + slot[None, :], (lens - 1)[:, None]).to(device)
        self._k_pos = torch.arange(n_blocks * block_size, device=device)
        self.seq_lens = lens.to(device)
        self._masks: dict = {}

    def visible(self, window: int | None = None) -> torch.Tensor:
        if window not in self._masks:
            check_features(1, window)
            k, q = self._k_pos[None, None, :], self.q_pos[:, :, None]
            mask = (k <= q) & (k < self.seq_lens[:, None, None])
            if window is not None:
                mask &= k > q - window
            self._masks[window] = mask
        return self._masks[window]


def batched_prefill_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, index: PrefillIndex,
                              scale: float, *, window: int | None = None) -> torch.Tensor:
    """Every prefill chunk in ONE masked SDPA over a float pool already holding their K/V (the write comes
    first): q (T, H_q, D) packed -> (T, H_q, D)."""
    p, n_blocks = index.table.shape
    s = n_blocks * k_cache.shape[1]
    h_kv, d = k_cache.shape[2], k_cache.shape[3]
    h_q, g, L = q.shape[1], q.shape[1] // h_kv, index.max_query_len
    k = gather_pages(index, k_cache, "k").reshape(p, s, h_kv, d).transpose(1, 2)  # (P, H_kv, S, D)
    v = gather_pages(index, v_cache, "v").reshape(p, s, h_kv, d).transpose(1, 2)
    # the G query heads of a KV head and the chunk's L positions share SDPA's query axis (no K/V repeat)
    qp = q.index_select(0, index.q_index.flatten()).reshape(p, L, h_kv, g, d).permute(0, 2, 3, 1, 4)
    qp = qp.reshape(p, h_kv, g * L, d)
    mask = index.visible(window)[:, None, None].expand(p, 1, g, L, s).reshape(p, 1, g * L, s)
    out = torch.nn.functional.scaled_dot_product_attention(qp, k, v, attn_mask=mask, scale=scale)
    out = out.reshape(p, h_kv, g, L, d).permute(0, 3, 1, 2, 4).reshape(p * L, h_q, d)
    return out.index_select(0, index.q_rows)
