"""Turn the last position's logits into the next token, per request (notebook 04).

Greedy rows take the argmax together; sampled rows apply temperature, top-k and top-p, then draw
with their own sequence's generator, so a request's samples are the same alone or in any batch.
"""

from __future__ import annotations

import torch


def _filtered_probs(logits: torch.Tensor, temperature: float, top_k: int, top_p: float) -> torch.Tensor:
    """(V,) logits -> (V,) probabilities after temperature, top-k and top-p (nucleus)."""
    logits = logits.float() / temperature
    if 0 < top_k < logits.shape[-1]:
        kth = torch.topk(logits, top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    probs = torch.softmax(logits, dim=-1)
    if top_p < 1.0:
        sorted_p, order = probs.sort(descending=True)
        # keep the smallest prefix whose mass reaches top_p (the token that crosses it stays in)
        drop = sorted_p.cumsum(-1) - sorted_p >= top_p
        sorted_p = sorted_p.masked_fill(drop, 0.0)
        probs = torch.zeros_like(probs).scatter(-1, order, sorted_p)
        probs = probs / probs.sum()
    return probs


def sample(logits: torch.Tensor, seqs) -> list[int]:
    """logits (B, V), one row per sequence in ``seqs`` -> one token id per sequence."""
    out = logits.argmax(dim=-1).tolist()  # greedy for everyone; sampled rows overwrite below
    for i, seq in enumerate(seqs):
        p, n = seq.params, len(seq.output_token_ids)
        if n < len(p.forced_token_ids):  # teacher forcing: the text's own next token
            out[i] = p.forced_token_ids[n]
        elif not p.greedy:
            probs = _filtered_probs(logits[i], p.temperature, p.top_k, p.top_p)
            out[i] = int(torch.multinomial(probs.cpu(), 1, generator=seq.generator))
    return out
