"""One engine step on the model (notebook 04): pack, forward, pick the logits that sample.

All scheduled tokens go side by side in ONE ragged row ``(1, T)``; :mod:`kvlab.hf`'s attention
writes their K/V by ``slot_mapping`` and reads through block tables, the HF model unmodified.
Only rows that sample go through the LM head (``logits_to_keep``).
"""

from __future__ import annotations

import time

import torch

from kvlab.attention import BACKEND_NAMES, BACKENDS, AttentionBackend, DecodeIndex, PrefillIndex
from kvlab.engine.prepack import PrepackedLinears
from kvlab.hf import PagedBatch, attention_implementation, model_configs, register_paged_attention


class ModelRunner:
    """Runs the engine's steps through one attention backend (:mod:`kvlab.attention` has the table).
    ``prepack=True`` runs the linear layers on the model's one oneDNN packing, shared by every engine on it
    (:meth:`~kvlab.engine.prepack.PrepackedLinears.shared`, CPU fp32 only)."""

    def __init__(self, model, cache, attn_backend: str = "reference", prepack: bool = False):
        if isinstance(attn_backend, AttentionBackend):  # one built with its own functions (notebook 06's skeleton)
            self.backend = attn_backend
        elif not isinstance(attn_backend, str) or attn_backend not in BACKENDS:
            raise ValueError(f"attn_backend must be one of {BACKEND_NAMES}, got {attn_backend!r}")
        else:
            self.backend = BACKENDS[attn_backend]
        self.model, self.cache, self.attn_backend = model, cache, attn_backend
        self.backend.check(cache)  # a pool the backend cannot run fails here, not in the middle of a step
        self.device = next(model.parameters()).device
        self.attn_name = register_paged_attention()
        self._configs = model_configs(model)  # switched to kvlab's attention for each forward
        if not isinstance(prepack, bool):
            raise TypeError(f"prepack must be True or False, got {type(prepack).__name__} {prepack!r}")
        self.prepacked = PrepackedLinears.shared(model) if prepack else PrepackedLinears.empty()
        self.timings: dict[str, float] = {}  # seconds of the last step: "packing", "forward"

    @torch.inference_mode()
    def execute_model(self, batch, block_manager, all_logits: bool = False,
                      observer=None, as_decodes: bool = False) -> tuple[torch.Tensor, list[int]]:
        """Logits (R, V) of the R sequences that sample, and their rows in ``batch.seqs``; with
        ``all_logits`` (scoring text) logits (T, V) of every packed token; ``as_decodes``: chunks over a
        quantized pool attend as a token-a-step decode would (:func:`kvlab.attention.spec.quantized_paged_attention`).

        After eviction a table holds only the kept blocks: ``seq_len`` and the new slots count kept
        tokens, while positions (RoPE) stay the sequence's true ones.
        """
        t0 = time.perf_counter()
        out, into = block_manager.take_transfers()  # the host tier: offloads, then loads, before anything
        if out or into:
            self.cache.swap(out, into)
        self.cache.copy_blocks(batch.blocks_to_copy)  # copy-on-write before any write
        tokens, positions, slots, tables, seq_lens, sample_rows, last = [], [], [], [], [], [], []
        for i, (seq, n) in enumerate(zip(batch.seqs, batch.num_new_tokens)):
            start, end = seq.num_computed_tokens, seq.num_computed_tokens + n
            tokens += seq.token_ids[start:end]
            positions += range(start, end)
            blocks = block_manager.seqs[seq.seq_id]
            table = blocks.block_table  # read-only: no copy per step
            shift = blocks.evicted * block_manager.block_size  # positions dropped before the new tokens
            slots += block_manager.slot_mapping_of(table, block_manager.block_size, start - shift, end - shift)
            tables.append(table)
            seq_lens.append(end - shift)
            if end == seq.num_tokens:  # this chunk reaches the last token: it samples
                sample_rows.append(i)
                last.append(len(tokens) - 1)
        decode = None
        if self.backend.batched_decode and batch.num_decodes:
            nd = batch.num_decodes
            decode = DecodeIndex(tables[:nd], seq_lens[:nd], block_manager.block_size, self.device)
        prefill = None
        nd = batch.num_decodes if decode is not None else 0
        if (self.backend.batched_prefill and not self.cache.is_quantized
                and PrefillIndex.pays(seq_lens[nd:], batch.num_new_tokens[nd:], block_manager.block_size)):
            prefill = PrefillIndex(tables[nd:], seq_lens[nd:], batch.num_new_tokens[nd:], block_manager.block_size,
                                   self.device)
        paged = PagedBatch(cache=self.cache, block_tables=tables, seq_lens=seq_lens,
                           query_lens=list(batch.num_new_tokens),
                           slot_mapping=torch.tensor(slots, dtype=torch.long, device=self.device),
                           backend=self.backend, decode=decode, prefill=prefill, observer=observer,
                           as_decodes=as_decodes)
        ids = torch.tensor([tokens], device=self.device)
        pos = torch.tensor([positions], device=self.device)
        keep = torch.tensor(last, dtype=torch.long, device=self.device)
        t1 = time.perf_counter()
        with attention_implementation(self.model, self.attn_name, self._configs), self.prepacked.active():
            out = self.model(input_ids=ids, position_ids=pos, use_cache=False, kvlab_paged=paged,
                             logits_to_keep=0 if all_logits else keep if last else 1)  # 0: every position
        t2 = time.perf_counter()
        self.timings = {"packing": t1 - t0, "forward": t2 - t1}
        if all_logits:
            return out.logits[0], list(range(len(batch.seqs)))  # (T, V)
        logits = out.logits[0] if last else out.logits[0, :0]  # (R, V)
        return logits, sample_rows
