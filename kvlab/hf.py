"""Plug kvlab caches into an unmodified Hugging Face model.

transformers calls ``cache.update(k, v, layer_idx, ...)`` inside every attention layer with the
post-RoPE keys and values of the new tokens (B, H_kv, q_len, D) and attends over whatever comes
back. :class:`KVLabCache` is an HF ``Cache`` whose layers forward that call to a kvlab store
(:mod:`kvlab.cache`), so the model code stays untouched.

The Cache API moved several times inside transformers 5.x; everything version-specific lives in
this file (the "shim"): the name of the cache keyword (``cache=`` from 5.24 on, ``past_key_values=``
before) and the argument of ``get_mask_sizes`` (an int query length now, a ``cache_position``
tensor in older 5.x). Introduced in notebook 01; the decode loops that drive these caches live in
:mod:`kvlab.generate`.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, CacheLayerMixin

from kvlab.cache import ContiguousCache, StaticCache


def _cache_kwarg() -> str:
    from transformers.models.llama.modeling_llama import LlamaModel

    return "cache" if "cache" in inspect.signature(LlamaModel.forward).parameters else "past_key_values"


#: the keyword under which this transformers version takes a cache object (forward and generate)
CACHE_KWARG = _cache_kwarg()


def _query_length(arg) -> int:
    """get_mask_sizes gets an int query length (5.24) or a cache_position tensor (older 5.x)."""
    return int(arg) if isinstance(arg, int) else int(arg.shape[-1])


class _StoreLayer(CacheLayerMixin):
    """One model layer's view of a kvlab store."""

    is_compileable = False
    is_sliding = False

    def __init__(self, store, layer_idx: int):
        super().__init__()
        self.store, self.layer_idx = store, layer_idx

    def lazy_initialization(self, key_states, value_states) -> None:
        self.is_initialized = True

    def update(self, key_states, value_states, *args, **kwargs):
        self.is_initialized = True
        return self.store.update(self.layer_idx, key_states, value_states)

    def get_seq_length(self) -> int:
        return self.store.seq_len(self.layer_idx)

    def get_mask_sizes(self, query_length, *args) -> tuple[int, int]:
        # kv_length covers exactly the slots update() returns, kv_offset 0
        return self.get_seq_length() + _query_length(query_length), 0

    def get_max_length(self) -> int:
        return getattr(self.store, "max_seq_len", None) or -1

    def reset(self) -> None:
        self.store.reset()


class KVLabCache(Cache):
    """An HF ``Cache`` backed by a kvlab store (``ContiguousCache``, ``StaticCache``, ...)."""

    def __init__(self, store):
        self.store = store
        super().__init__(layers=[_StoreLayer(store, i) for i in range(store.num_layers)])

    def stats(self) -> dict:
        return self.store.stats()


def make_store(kind: str, model, batch: int = 1, max_seq_len: int | None = None):
    """A fresh kvlab store of ``kind`` ("dynamic" or "static") sized for ``model``."""
    if kind == "dynamic":
        return ContiguousCache.from_model(model)
    if kind == "static":
        if max_seq_len is None:
            raise ValueError("a static cache needs max_seq_len")
        return StaticCache.from_model(model, max_batch=batch, max_seq_len=max_seq_len)
    raise ValueError(f"cache kind must be 'dynamic' or 'static', got {kind!r}")


# ---- paged attention (notebook 02) ---------------------------------------------------------------
# A paged batch is PACKED: all sequences' new tokens side by side in one row (1, T), positions given
# per token. There is no padding and no HF Cache object: like vLLM's attention backends, the
# attention function itself writes the new K/V to their slots and attends through block tables.

PAGED_ATTENTION = "kvlab_paged"


@dataclass
class PagedBatch:
    """What one packed forward needs; travels to the attention function as ``kvlab_paged=``."""

    cache: object  # a kvlab.cache.PagedKVCache
    block_tables: list[list[int]]
    context_lens: list[int]  # tokens each sequence has in the cache after this forward
    query_lens: list[int]  # new tokens per sequence in this forward
    slot_mapping: torch.Tensor  # (T,) where the new tokens' K/V go
    backend: str = "reference"  # "reference": one sequence at a time; "torch": decodes batched; "triton": kernels
    decode: object = None  # backends "torch"/"triton": a kvlab.attention.DecodeIndex of the first decode.num sequences

    def __post_init__(self):
        if self.backend not in ATTENTION_BACKENDS:
            raise ValueError(f"attention backend must be one of {ATTENTION_BACKENDS}, got {self.backend!r}")


#: how the paged attention function reads the pool: the PyTorch specification, batched PyTorch
#: decodes (notebook 04), or the Triton kernels for the cache write and the decodes (notebook 05)
ATTENTION_BACKENDS = ("reference", "torch", "triton")


def _paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from kvlab import attention as A

    batch: PagedBatch | None = kwargs.get("kvlab_paged")
    if batch is None:
        raise RuntimeError(f"attention '{PAGED_ATTENTION}' needs a kvlab_paged=PagedBatch(...) argument; "
                           "use kvlab.engine.LLM or kvlab.generate.paged_generate")
    layer = module.layer_idx
    # query (1, H_q, T, D); key/value (1, H_kv, T, D), post-RoPE, new tokens only
    q, k_new, v_new = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # (T, H, D)
    cache = batch.cache
    triton_backend = batch.backend == "triton"
    if triton_backend:  # quantize-on-write in a kernel (notebook 05)
        from kvlab.kernels.ops import write_to_cache

        write_to_cache(cache, layer, k_new, v_new, batch.slot_mapping)
    else:
        cache.write(layer, k_new, v_new, batch.slot_mapping)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    quantized = hasattr(cache, "config")  # a quantized pool (notebook 03)
    nd = batch.decode.num if batch.backend != "reference" and batch.decode is not None else 0
    out = torch.empty_like(q)
    if nd and triton_backend:  # decodes: one kernel launch, dequantization fused
        from kvlab.kernels.ops import decode_from_cache

        out[:nd] = decode_from_cache(q[:nd], cache, layer, batch.decode, scale, k_new[:nd] if quantized else None,
                                     v_new[:nd] if quantized else None)
    elif nd:  # decodes (packed first, one token each): one batched gather + SDPA
        if quantized:
            out[:nd] = A.quantized_batched_decode_attention(q[:nd], k_new[:nd], v_new[:nd], cache, layer,
                                                            batch.decode, scale)
        else:
            out[:nd] = A.batched_decode_attention(q[:nd], cache.k_cache[layer], cache.v_cache[layer], batch.decode,
                                                  scale)
    if nd < q.shape[0]:  # everything else one sequence at a time: the reference, the specification
        rest = (batch.block_tables[nd:], batch.context_lens[nd:], batch.query_lens[nd:])
        if quantized:
            out[nd:] = A.quantized_paged_attention(q[nd:], k_new[nd:], v_new[nd:], cache, layer, *rest, scale)
        else:
            out[nd:] = A.paged_attention(q[nd:], cache.k_cache[layer], cache.v_cache[layer], *rest, scale=scale)
    return out.unsqueeze(0), None  # (1, T, H_q, D), as HF's attention functions return


def _no_mask(*args, **kwargs):
    return None  # the paged attention function builds each sequence's causal mask itself


def register_paged_attention() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PAGED_ATTENTION, _paged_attention_forward)
    AttentionMaskInterface.register(PAGED_ATTENTION, _no_mask)
    return PAGED_ATTENTION


def model_configs(model) -> list:
    """Every distinct config object in the model (the top one and any its submodules carry)."""
    return list({id(model.config): model.config,
                 **{id(m.config): m.config for m in model.modules() if hasattr(m, "config")}}.values())


@contextmanager
def attention_implementation(model, name: str, configs=None):
    """Run ``model`` with another registered attention function, then put the old one back.

    ``configs``: the model's config objects (:func:`model_configs`), for a caller that switches every
    step and need not walk the modules each time.
    """
    configs = model_configs(model) if configs is None else configs
    old = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = name
    try:
        yield model
    finally:
        for c, o in zip(configs, old):
            c._attn_implementation = o


__all__ = ["CACHE_KWARG", "KVLabCache", "make_store", "PAGED_ATTENTION", "PagedBatch", "ATTENTION_BACKENDS",
           "register_paged_attention",
           "attention_implementation"]
