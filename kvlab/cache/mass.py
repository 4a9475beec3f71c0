"""The attention a scoring eviction policy reads (kvlab.cache.evict): per sequence, how much each kept key
is attended, recomputed in PyTorch from the pool after each layer's attention, whatever backend ran it."""

from __future__ import annotations

import itertools

import torch

from kvlab.quant.rotation import rotate


class AttentionMass:
    """Per watched sequence, the attention its queries at ``>= from_pos`` give each key, summed over
    heads, queries and layers. Recomputed in PyTorch from the pool whatever backend ran. Per recorded
    sequence, also every query row's attention (``rows[i]``: (queries, keys), summed over heads and
    layers): a prompt block's rows, kept with the prefix cache, stand in for the rows a later request
    that hits that block does not compute."""

    def __init__(self, watch: dict[int, tuple[int, int]], record=()):
        self.watch, self.record = watch, set(record)
        self.mass: dict[int, torch.Tensor] = {}
        self.rows: dict[int, torch.Tensor] = {}
        self._plan = None  # the forward's batch (its id), split into sequences scored together and one by one

    def _split(self, batch):
        """Once per forward: the packed row each sequence starts at, the ones scored one by one (sequence,
        first row that counts, first row computed), the watched one-token decodes scored in one padded pass
        and the block ids of that pass (each table padded with its own first block)."""
        starts, alone, decodes = [0, *itertools.accumulate(batch.query_lens)], [], []
        for i in sorted(set(self.watch) | self.record):
            q_len = batch.query_lens[i]
            end, from_pos = self.watch.get(i, (q_len, q_len))  # unwatched: no row counts for the policy
            first = max(0, from_pos - (end - q_len))  # the first query row that counts for the policy
            top = 0 if i in self.record else first  # the first row computed here
            if top < q_len:
                (decodes.append(i) if q_len == 1 and i not in self.record else alone.append((i, first, top)))
        tables = [batch.block_tables[i] for i in decodes]
        width = max(map(len, tables), default=0)
        ids = torch.tensor([list(t) + [t[0]] * (width - len(t)) for t in tables], dtype=torch.long).flatten()
        return starts, alone, decodes, ids

    def observe(self, layer: int, q: torch.Tensor, pool, batch, scale: float) -> None:
        if self._plan is None or self._plan[0] != id(batch):  # once per forward, not per layer (the id: holding
            self._plan = (id(batch), *self._split(batch))  # the batch, which holds this, would make a cycle)
        _, starts, alone, decodes, ids = self._plan
        if decodes:
            self._decodes(layer, q[[starts[i] for i in decodes]], pool, ids, [batch.seq_lens[i] for i in decodes],
                          decodes, scale)
        for i, first, top in alone:
            q_len, ctx = batch.query_lens[i], batch.seq_lens[i]
            qi = q[starts[i] + top:starts[i + 1]].float()  # (n_q, H_q, D)
            k = pool.read_k(layer, batch.block_tables[i]).flatten(0, 1)[:ctx]  # (ctx, H_kv, D) as attention reads them
            h_kv = k.shape[1]
            qg = qi.reshape(qi.shape[0], h_kv, -1, qi.shape[-1])  # (n_q, H_kv, G, D)
            if getattr(pool, "rotate_k", False):  # stored keys are rotated: q . k == (q H) . (k H)
                qg = rotate(qg)
            s = torch.matmul(qg.permute(1, 2, 0, 3), k.permute(1, 2, 0)[:, None]).mul_(scale)  # (H_kv, G, n_q, ctx)
            row = torch.arange(ctx - q_len + top, ctx, device=s.device)[:, None]  # each query's index among the keys
            s.masked_fill_(torch.arange(ctx, device=s.device)[None, :] > row, float("-inf"))  # in place: 1/3 faster
            p = torch.softmax(s, dim=-1)
            if i in self.record:
                p = p.sum(dim=(0, 1))  # (n_q, ctx)
                self.rows[i] = p if i not in self.rows else self.rows[i] + p
                m = p[first - top:].sum(dim=0) if first < q_len else None
            else:
                m = p.sum(dim=(0, 1, 2))  # (ctx,)
            if m is not None:
                self.mass[i] = m if i not in self.mass else self.mass[i] + m

    def _decodes(self, layer: int, q: torch.Tensor, pool, ids: torch.Tensor, ctxs: list[int], seqs: list[int],
                 scale: float) -> None:
        """One token each (q: (B, H_q, D)): their keys read in one padded gather (``ids``), masked past each
        context: the same sums as one sequence at a time (07's H2O runs score ~10 a layer, a step)."""
        k = pool.read_k(layer, ids)
        k = k.reshape(len(seqs), -1, *k.shape[2:])  # (B, S, H_kv, D)
        qg = q.float().reshape(q.shape[0], k.shape[2], -1, q.shape[-1])  # (B, H_kv, G, D)
        if getattr(pool, "rotate_k", False):
            qg = rotate(qg)
        s = (qg @ k.transpose(1, 2).contiguous().transpose(-1, -2)) * scale  # (B, H_kv, G, S); 3x einsum's speed
        past = torch.arange(k.shape[1], device=k.device)[None, :] >= torch.tensor(ctxs, device=k.device)[:, None]
        m = torch.softmax(s.masked_fill(past[:, None, None], float("-inf")), dim=-1).sum(dim=(1, 2))  # (B, S)
        for b, (i, ctx) in enumerate(zip(seqs, ctxs)):
            self.mass[i] = m[b, :ctx] if i not in self.mass else self.mass[i] + m[b, :ctx]
