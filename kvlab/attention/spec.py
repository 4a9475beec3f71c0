"""The PyTorch specification of paged attention (notebook 02): every backend and kernel is tested against it.

Packed queries: sequence i owns the LAST ``query_lens[i]`` positions of its ``seq_lens[i]`` tokens.
``window``: query p sees keys ``p - window < j <= p`` (HF's rule); ``softcap`` (Gemma-2) is applied after
scaling, before the mask; ``sinks`` (gpt-oss) is one logit per query head with a zero value.
"""

from __future__ import annotations

import torch

from kvlab.cache.paged_storage import gather_kv
from kvlab.quant.rotation import rotate
from kvlab.validate import cdiv, check_attention_features as check_features

__all__ = ["gather_kv", "visible", "scores_softmax", "attend", "paged_attention", "quantized_paged_attention"]


def visible(q_pos: torch.Tensor, k_pos: torch.Tensor, window: int | None = None) -> torch.Tensor:
    """Which keys each query sees (absolute positions, broadcast): ``k <= q``, and ``k > q - window``."""
    mask = k_pos <= q_pos
    return mask if window is None else mask & (k_pos > q_pos - window)


def _sink_logits(sinks: torch.Tensor, h_kv: int, like: torch.Tensor) -> torch.Tensor:
    """gpt-oss's per-query-head sink logits (H_q,) as (H_kv, G, 1, 1) for scores laid out (H_kv, G, q, n)."""
    return sinks.to(like.dtype).reshape(h_kv, -1, 1, 1)


def scores_softmax(s: torch.Tensor, mask: torch.Tensor, softcap: float | None = None,
                   sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Softmax of scaled scores ``s`` (..., H_kv, G, q, n) as HF's eager attention of Gemma-2 and gpt-oss
    computes it: soft cap before the mask, sinks joining the softmax and then dropped."""
    if softcap is not None:
        s = torch.tanh(s / softcap) * softcap
    s = s.masked_fill(~mask, float("-inf"))
    if sinks is None:
        return torch.softmax(s, dim=-1)
    sink = _sink_logits(sinks, s.shape[-4], s).expand(*s.shape[:-1], 1)
    return torch.softmax(torch.cat([s, sink], dim=-1), dim=-1)[..., :-1]


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float, *, window: int | None = None,
           softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Causal GQA attention of the last ``q_len`` positions: q (q_len, H_q, D); k, v (ctx, H_kv, D) ->
    (q_len, H_q, D). A soft cap or sinks write the scores out, as HF's eager attention does."""
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
                    seq_lens, query_lens, scale: float, *, window: int | None = None,
                    softcap: float | None = None, sinks: torch.Tensor | None = None) -> torch.Tensor:
    """Packed queries (T, H_q, D) -> (T, H_q, D), each sequence reading only its own blocks, no padding."""
    if len(block_tables) != len(seq_lens) or len(seq_lens) != len(query_lens):
        raise ValueError("block_tables, seq_lens and query_lens need one entry per sequence")
    if sum(query_lens) != q.shape[0]:
        raise ValueError(f"query_lens sum to {sum(query_lens)} but q holds {q.shape[0]} tokens")
    out = torch.empty_like(q)
    start = 0
    for table, ctx, q_len in zip(block_tables, seq_lens, query_lens):
        if not 0 < q_len <= ctx:
            raise ValueError(f"need 0 < query_len <= context_len, got {q_len} and {ctx}")
        k, v = gather_kv(k_cache, v_cache, table, ctx)
        out[start:start + q_len] = attend(q[start:start + q_len], k, v, scale, window=window, softcap=softcap,
                                          sinks=sinks)
        start += q_len
    return out


# ---- over a quantized pool (notebook 03) ------------------------------------------------------------

def _online_update(state, q, k, v, scale, mask=None, softcap=None):
    """One step of online softmax (FlashAttention's recurrence): q (q_len, H_kv, G, D); k, v (n, H_kv, D);
    state (max m, sum l, acc); mask (q_len, n). A query that has seen no key keeps m = -inf."""
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


def quantized_paged_attention(q, k_new, v_new, cache, layer: int, block_tables, seq_lens, query_lens,
                              scale: float, tile_blocks: int = 8, *, window: int | None = None,
                              softcap: float | None = None, sinks: torch.Tensor | None = None,
                              as_decodes: bool = False) -> torch.Tensor:
    """Attention reading everything cached BEFORE this forward from a quantized pool; the new tokens'
    own k_new, v_new (T, H_kv, D) stay full precision. Tiles are dequantized and folded in by online
    softmax, so no full-precision copy exists: the PyTorch picture of a fused kernel.

    ``as_decodes``: each new token sees the earlier new tokens as stored (already written to the pool)
    and only itself at full precision, as if the chunk had been decoded one token a step; a chunk of
    forced tokens then scores in one forward what decoding would (text fed through a quantized cache)."""
    check_features(q.shape[1], window, softcap, sinks)
    out = torch.empty_like(q, dtype=torch.float32)
    bs = cache.block_size
    start = 0
    for table, ctx, q_len in zip(block_tables, seq_lens, query_lens):
        qi = q[start:start + q_len].float()
        h_q, d = qi.shape[1:]
        h_kv = k_new.shape[1]
        qg = qi.reshape(q_len, h_kv, h_q // h_kv, d)  # (q_len, H_kv, G, D)
        q_cached = rotate(qg) if cache.rotate_k else qg  # cached keys are stored rotated
        g = h_q // h_kv
        if sinks is None:
            state = (torch.full((h_kv, g, q_len), float("-inf")), torch.zeros(h_kv, g, q_len))
        else:  # the sink as a first key: m = its logit, l = exp(0) = 1, acc = its zero value
            state = (_sink_logits(sinks.float(), h_kv, qi)[..., 0].expand(h_kv, g, q_len).clone(),
                     torch.ones(h_kv, g, q_len))
        state = (*state, torch.zeros(h_kv, g, q_len, d))
        cached = ctx - q_len
        q_pos = torch.arange(cached, ctx)[:, None]  # (q_len, 1) absolute positions of the queries
        stored = ctx - 1 if as_decodes else cached  # positions read back from the pool
        first = 0 if window is None else max(0, (cached - window + 1) // (bs * tile_blocks) * tile_blocks)
        n_blocks = cdiv(stored, bs)
        for t0 in range(first, n_blocks, tile_blocks):  # under a window, tiles no query sees are skipped
            ids = torch.as_tensor(table[t0:t0 + tile_blocks], dtype=torch.long)
            k, v = cache.read(layer, ids)  # (n, bs, H_kv, D) each, float32
            valid = min(stored - t0 * bs, len(ids) * bs)
            k_pos = torch.arange(t0 * bs, t0 * bs + valid)[None, :]
            mask = None if window is None else visible(q_pos, k_pos, window)
            if as_decodes:  # strictly earlier tokens only: a query's own key comes at full precision below
                mask = (k_pos < q_pos) if mask is None else mask & (k_pos < q_pos)
            state = _online_update(state, q_cached, k.flatten(0, 1)[:valid], v.flatten(0, 1)[:valid], scale, mask,
                                   softcap)
        # among the new tokens: causal, or (as_decodes) each token only itself
        causal = torch.eye(q_len, dtype=torch.bool) if as_decodes else visible(q_pos, q_pos.T, window)
        state = _online_update(state, qg, k_new[start:start + q_len].float(), v_new[start:start + q_len].float(),
                               scale, causal, softcap)
        m, l, acc = state
        out[start:start + q_len] = (acc / l[..., None]).permute(2, 0, 1, 3).reshape(q_len, h_q, d)
        start += q_len
    return out.to(q.dtype)
