"""PyTorch reference attention over a paged KV cache (notebook 02).

This is the specification the Triton kernels (notebook 05) are tested against: plain tensor ops,
one sequence at a time, K/V read through the block table. Queries of several sequences arrive
packed along one token axis; sequence i owns ``query_lens[i]`` of them, which are the LAST
``query_lens[i]`` positions of its ``context_lens[i]`` cached tokens (prefill: all of a prompt
not found in the prefix cache; decode: one).

Every function here also honours what an HF model hands its attention function besides Q, K, V
(issue 12), as keyword arguments:

- ``window``: sliding-window attention (Mistral, Gemma-2/3's local layers, gpt-oss): the query at
  position p sees keys ``p - window < j <= p``, HF's rule (``masking_utils.sliding_window_overlay``).
  Only the mask changes: the paged cache keeps every block (see :mod:`kvlab.cache.paged`).
- ``softcap``: logit soft-capping (Gemma-2): scores become ``softcap * tanh(scores / softcap)``
  after scaling, before the mask.
- ``sinks``: attention sinks (gpt-oss's ``s_aux``), one learned logit per query head that joins
  every softmax as an extra key whose value is zero: it takes probability mass, adds nothing.
"""

from __future__ import annotations

import torch


def gather_kv(k_cache: torch.Tensor, v_cache: torch.Tensor, block_table, num_tokens: int):
    """One sequence's K and V, (num_tokens, H_kv, D), from ``[num_blocks, block_size, H_kv, D]`` pages."""
    block_size = k_cache.shape[1]
    n_blocks = -(-num_tokens // block_size)
    table = torch.as_tensor(block_table[:n_blocks], device=k_cache.device, dtype=torch.long)
    k = k_cache[table].flatten(0, 1)[:num_tokens]  # (n_blocks * block_size, H_kv, D) -> (T, H_kv, D)
    v = v_cache[table].flatten(0, 1)[:num_tokens]
    return k, v


def check_features(h_q: int, window=None, softcap=None, sinks=None) -> None:
    """A ValueError naming the argument unless ``window`` is a positive int, ``softcap`` a positive
    number and ``sinks`` one logit per query head (H_q,), each or None."""
    if window is not None and (isinstance(window, bool) or not isinstance(window, int) or window < 1):
        raise ValueError(f"window must be a positive int (the keys a query sees, itself included) or None, "
                         f"got {window!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (h_q,)):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be a tensor of one logit per query head, shape ({h_q},), got {shape}")


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Which keys each query sees: ``k <= q``, and ``k > q - window`` under a sliding window.
    Broadcasts ``q_pos`` against ``k_pos`` (absolute token positions)."""
    mask = k_pos <= q_pos
    return mask if window is None else mask & (k_pos > q_pos - window)


def _sink_logits(sinks: torch.Tensor, h_kv: int, like: torch.Tensor) -> torch.Tensor:
    """gpt-oss's per-query-head sink logits (H_q,) as (H_kv, G, 1, 1) for scores laid out (H_kv, G, q, n)."""
    return sinks.to(like.dtype).reshape(h_kv, -1, 1, 1)


def scores_softmax(s: torch.Tensor, mask: torch.Tensor, softcap: float | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax of scaled scores ``s`` (..., H_kv, G, q, n) over the keys ``mask`` lets through, with the
    soft cap applied before the mask and the sinks joining the softmax (then dropped), as HF's eager
    attention of Gemma-2 and gpt-oss computes them."""
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(s, dim=-1)
    sink = _sink_logits(sinks, s.shape[-4], s).expand(*s.shape[:-1], 1)
    return torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, window: int | None = None,
           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal attention of the last ``q_len`` positions over ``ctx`` keys, GQA aware.

    q: (q_len, H_q, D); k, v: (ctx, H_kv, D) -> (q_len, H_q, D). Query j sits at position
    ``ctx - q_len + j`` and sees keys 0..that position (the last ``window`` of them under a sliding
    window). Without a soft cap or sinks this is one SDPA call; with them, the (q_len, ctx) scores of
    every head are written out, as HF's eager attention does for Gemma-2 and gpt-oss.
    """
    q_len, h_q, d = q.shape
    ctx, h_kv, _ = k.shape
    if h_q % h_kv:
        raise ValueError(f"query heads ({h_q}) must be a multiple of KV heads ({h_kv})")
    check_features(h_q, window, softcap, sinks)
    group = h_q // h_kv  # query heads sharing one KV head
    qh = q.reshape(q_len, h_kv, group, d).permute(1, 2, 0, 3)  # (H_kv, G, q_len, D)
    kh = k.permute(1, 0, 2).unsqueeze(1)  # (H_kv, 1, ctx, D)
    vh = v.permute(1, 0, 2).unsqueeze(1)
    pos = torch.arange(ctx - q_len, ctx, device=q.device)[:, None]  # (q_len, 1) absolute query positions
    mask = visible(pos, torch.arange(ctx, device=q.device)[None, :], window)  # (q_len, ctx)
    if softcap is None and sinks is None:
        out = torch.nn.functional.scaled_dot_product_attention(qh, kh, vh, attn_mask=mask, scale=scale)
    else:
        p = scores_softmax(torch.matmul(qh, kh.transpose(-1, -2)) * scale, mask, softcap, sinks)
        out = torch.matmul(p.to(vh.dtype), vh)
    return out.permute(2, 0, 1, 3).reshape(q_len, h_q, d)  # (q_len, H_q, D)


def paged_attention(q: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables,
                    context_lens, query_lens, scale: float, *, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Packed queries (T, H_q, D) of several sequences -> outputs (T, H_q, D).

    Each sequence's K/V are gathered through its own block table; nothing outside its blocks
    is read, and no padding exists anywhere. ``window``, ``softcap``, ``sinks``: see the module.
    """
    if len(block_tables) != len(context_lens) or len(context_lens) != len(query_lens):
        raise ValueError("block_tables, context_lens and query_lens need one entry per sequence")
    if sum(query_lens) != q.shape[0]:
        raise ValueError(f"query_lens sum to {sum(query_lens)} but q holds {q.shape[0]} tokens")
    out = torch.empty_like(q)
    start = 0
    for table, ctx, q_len in zip(block_tables, context_lens, query_lens):
        if not 0 < q_len <= ctx:
            raise ValueError(f"need 0 < query_len <= context_len, got {q_len} and {ctx}")
        k, v = gather_kv(k_cache, v_cache, table, ctx)
        out[start:start + q_len] = attend(q[start:start + q_len], k, v, scale, window=window, softcap=softcap,
                                          sinks=sinks)
        start += q_len
    return out


# ---- over a quantized pool (notebook 03) ------------------------------------------------------------

def _online_update(state, q, k, v, scale, mask=None, softcap=None):
    """One step of online softmax (FlashAttention's recurrence) over a chunk of keys.

    q (q_len, H_kv, G, D); k, v (n, H_kv, D); state = (running max m, running sum l, accumulator acc);
    mask (q_len, n) the keys each query sees. A query that has seen no key yet keeps m = -inf.
    """
    m, l, acc = state
    s = torch.einsum("qhgd,nhd->hgqn", q, k) * scale  # (H_kv, G, q_len, n)
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    m_new = torch.maximum(m, s.amax(-1))
    m_use = m_new.masked_fill(torch.isinf(m_new), 0.0)  # all masked so far: exp(-inf - 0) = 0, not NaN
    p = torch.exp(s - m_use[..., None])
    corr = torch.exp(m - m_use)
    return m_new, l * corr + p.sum(-1), acc * corr[..., None] + torch.einsum("hgqn,nhd->hgqd", p, v)


def quantized_paged_attention(q, k_new, v_new, cache, layer: int, block_tables, context_lens, query_lens,
                              scale: float, tile_blocks: int = 8, *, window: int | None = None,
                              softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Attention where everything cached BEFORE this forward is read from a quantized pool.

    q (T, H_q, D) packed queries; k_new, v_new (T, H_kv, D) the same tokens' own keys/values, used in
    full precision (prefill never attends to its own quantization error; only what is stored is
    quantized). Cached blocks are dequantized ``tile_blocks`` at a time and folded in with online
    softmax, so no full-precision copy of a sequence's cache ever exists: the PyTorch picture of
    what a fused kernel does in registers. Under a sliding ``window`` the tiles that no query of the
    sequence can see are not read at all; ``sinks`` start the softmax state (a key of logit ``sink``
    and value 0).
    """
    from kvlab.quant.rotation import rotate

    check_features(q.shape[1], window, softcap, sinks)
    out = torch.empty_like(q, dtype=torch.float32)
    bs = cache.block_size
    start = 0
    for table, ctx, q_len in zip(block_tables, context_lens, query_lens):
        qi = q[start:start + q_len].float()
        h_q, d = qi.shape[1:]
        h_kv = k_new.shape[1]
        qg = qi.reshape(q_len, h_kv, h_q // h_kv, d)  # (q_len, H_kv, G, D)
        q_cached = rotate(qg) if cache.config.rotate_k else qg  # cached keys are stored rotated
        g = h_q // h_kv
        if sinks is None:
            state = (torch.full((h_kv, g, q_len), float("-inf")), torch.zeros(h_kv, g, q_len))
        else:  # the sink as a first key: m = its logit, l = exp(0) = 1, acc = its zero value
            state = (_sink_logits(sinks.float(), h_kv, qi)[..., 0].expand(h_kv, g, q_len).clone(),
                     torch.ones(h_kv, g, q_len))
        state = (*state, torch.zeros(h_kv, g, q_len, d))
        cached = ctx - q_len
        q_pos = torch.arange(cached, ctx)[:, None]  # (q_len, 1) absolute positions of the queries
        first = 0 if window is None else max(0, (cached - window + 1) // (bs * tile_blocks) * tile_blocks)
        n_blocks = -(-cached // bs)
        for t0 in range(first, n_blocks, tile_blocks):  # under a window, tiles no query sees are skipped
            ids = torch.as_tensor(table[t0:t0 + tile_blocks], dtype=torch.long)
            k, v = cache.read(layer, ids)  # (n, bs, H_kv, D) each, float32
            valid = min(cached - t0 * bs, len(ids) * bs)
            mask = None if window is None else visible(q_pos, torch.arange(t0 * bs, t0 * bs + valid)[None, :], window)
            state = _online_update(state, q_cached, k.flatten(0, 1)[:valid], v.flatten(0, 1)[:valid], scale, mask,
                                   softcap)
        causal = visible(q_pos, q_pos.T, window)  # (q_len, q_len) among the new tokens
        state = _online_update(state, qg, k_new[start:start + q_len].float(), v_new[start:start + q_len].float(),
                               scale, causal, softcap)
        m, l, acc = state
        out[start:start + q_len] = (acc / l[..., None]).permute(2, 0, 1, 3).reshape(q_len, h_q, d)
        start += q_len
    return out.to(q.dtype)


# ---- batched decode over the pool (notebook 04: the engine's "torch" backend) -----------------------

class DecodeIndex:
    """The block tables of one step's decode sequences as ONE tensor, built once and read by every
    layer: ``table`` (B, n_blocks) physical block ids (0-padded), ``valid`` (B, n_blocks * block_size)
    which key positions exist, ``context_lens`` (B,). :meth:`visible` adds a sliding window."""

    def __init__(self, block_tables, context_lens, block_size: int, device="cpu"):
        self.num = len(block_tables)
        n_blocks = -(-max(context_lens) // block_size)
        table = torch.zeros((self.num, n_blocks), dtype=torch.long)
        for i, t in enumerate(block_tables):
            t = t[:n_blocks]
            table[i, :len(t)] = torch.as_tensor(t, dtype=torch.long)
        self.table = table.to(device)
        self.context_lens = torch.as_tensor(context_lens, dtype=torch.long, device=device)
        pos = torch.arange(n_blocks * block_size, device=device)
        self.valid = pos[None, :] < self.context_lens[:, None]  # (B, n_blocks * block_size)
        self._pos, self._windowed = pos, {None: self.valid}

    def visible(self, window: int | None = None) -> torch.Tensor:
        """(B, S) the key positions each sequence's new token sees: the last ``window`` of its context
        under a sliding window. Built once per window and step, shared by the layers that use it."""
        if window not in self._windowed:
            check_features(1, window)
            self._windowed[window] = self.valid & (self._pos[None, :] >= self.context_lens[:, None] - window)
        return self._windowed[window]


def _decode_sdpa(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float,
                 softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """q (B, H_q, D); k, v (B, S, H_kv, D); valid (B, S) -> (B, H_q, D), GQA without repeating K/V:
    the G query heads of one KV head ride on SDPA's query-length axis (on the scores' row axis when a
    soft cap or sinks need the scores written out)."""
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
    """One query token per sequence (B, H_q, D) over the pool: one gather through the block-table
    tensor and one masked SDPA for the whole batch, instead of a Python loop over sequences."""
    b, n_blocks = index.table.shape
    shape = (b, n_blocks * k_cache.shape[1], *k_cache.shape[2:])  # (B, S, H_kv, D)
    k = k_cache[index.table].reshape(shape)  # (B, n_blocks, bs, H_kv, D) -> (B, S, H_kv, D)
    v = v_cache[index.table].reshape(shape)
    return _decode_sdpa(q, k, v, index.visible(window), scale, softcap, sinks)


def quantized_batched_decode_attention(q, k_new, v_new, cache, layer: int, index: DecodeIndex,
                                       scale: float, *, window: int | None = None, softcap: float | None = None,
                                       sinks: torch.Tensor | None = None) -> torch.Tensor:
    """The batched path over a quantized pool: cached blocks dequantized in one read, each
    sequence's own new token in full precision (as :func:`quantized_paged_attention` does)."""
    from kvlab.quant.rotation import rotate

    b, n_blocks = index.table.shape
    k, v = cache.read(layer, index.table.flatten())  # (B * n_blocks, bs, H_kv, D) float32 each
    k, v = k.reshape(b, -1, *k.shape[2:]), v.reshape(b, -1, *v.shape[2:])  # (B, S, H_kv, D)
    own = index.context_lens - 1
    rows = torch.arange(b, device=k.device)
    qf, k_own = q.float(), k_new.float()
    if cache.config.rotate_k:  # cached keys are stored rotated; rotation is orthogonal, so rotate q and k_own too
        qf, k_own = rotate(qf), rotate(k_own)  # along head_dim
    k[rows, own], v[rows, own] = k_own, v_new.float()
    return _decode_sdpa(qf, k, v, index.visible(window), scale, softcap, sinks).to(q.dtype)
