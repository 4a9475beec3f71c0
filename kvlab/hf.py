"""Plug kvlab caches into an unmodified Hugging Face model (notebook 01 on).

transformers hands every layer's new post-RoPE K/V (B, H_kv, q_len, D) to ``cache.update`` and attends
over what comes back; the paged path registers its own attention function instead. Everything
version-specific in transformers 5.x lives here: the cache keyword (``cache=`` from 5.24) and
``get_mask_sizes``'s argument.
"""

from __future__ import annotations

import inspect
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.cache_utils import Cache, CacheLayerMixin
from transformers.masking_utils import AttentionMaskInterface

from kvlab.attention import DecodeIndex, PrefillIndex, get_backend
from kvlab.cache import ContiguousCache, StaticCache


def _cache_kwarg() -> str:
    from transformers.models.llama.modeling_llama import LlamaModel  # only to read its signature, once
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

    cache: object  # a paged pool (kvlab.cache.PagedKVCache or QuantizedPagedKVCache)
    block_tables: list[list[int]]
    seq_lens: list[int]  # tokens each sequence has in the cache after this forward
    query_lens: list[int]  # new tokens per sequence in this forward
    slot_mapping: torch.Tensor  # (T,) where the new tokens' K/V go
    backend: object = "reference"  # a kvlab.attention backend or its name: "reference", "torch", "triton"
    decode: DecodeIndex | None = None  # backends that batch decodes: the first decode.num sequences
    prefill: PrefillIndex | None = None  # backends that batch prefill chunks: the sequences after the decodes
    observer: object = None  # kvlab.cache.evict.AttentionMass: a scoring eviction policy watches the attention
    as_decodes: bool = False  # chunks attend as if decoded a token a step (forced text through a quantized pool)

    def __post_init__(self):
        self.backend = get_backend(self.backend)


class UnsupportedModelError(ValueError):
    """kvlab's paged attention cannot run this model faithfully; raised before any paged forward."""


#: keyword arguments HF models hand their attention function that carry no attention feature: forward
#: flags passed through. Anything else a model passes is a feature kvlab honours (``FEATURES``) or refuses.
PASSED_THROUGH = frozenset({"position_ids", "use_cache", "output_attentions", "output_router_logits",
                            "output_hidden_states", "return_dict", "cache_position", "kvlab_paged"})
#: what the paged attention honours, by the names HF passes them under: the score scale, dropout (only 0,
#: eval mode), a sliding window, a logit soft cap, attention sinks (gpt-oss's ``s_aux``), is_causal (True)
FEATURES = frozenset({"scaling", "dropout", "sliding_window", "softcap", "s_aux", "is_causal"})


def unknown_arguments(kwargs: dict) -> list[str]:
    """Arguments a model passes its attention function that kvlab neither ignores safely nor honours."""
    return sorted(k for k, v in kwargs.items() if v is not None and k not in PASSED_THROUGH | FEATURES)


def attention_features(kwargs: dict) -> dict:
    """The backends' keyword arguments from what a model passed (window, softcap, sinks)."""
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    return dict(window=int(window) if window is not None else None,
                softcap=float(softcap) if softcap is not None else None,
                sinks=sinks.detach() if sinks is not None else None)


def _paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """HF's attention function under ``attn_implementation="kvlab_paged"``, handing the layer to the batch's
    backend: query (1, H_q, T, D), key/value (1, H_kv, T, D), post-RoPE, new tokens only -> (1, T, H_q, D)."""
    batch: PagedBatch | None = kwargs.get("kvlab_paged")
    if batch is None:
        raise RuntimeError(f"attention '{PAGED_ATTENTION}' needs a kvlab_paged=PagedBatch(...) argument; "
                           "use kvlab.engine.LLM or kvlab.generate.paged_generate")
    unknown = unknown_arguments(kwargs)
    if unknown or dropout or kwargs.get("is_causal") is False:  # the probe refuses these up front
        what = unknown or ([f"dropout={dropout}"] if dropout else ["is_causal=False"])
        raise UnsupportedModelError(f"{type(module).__name__} passes {', '.join(what)} to its attention function, "
                                    "which kvlab's paged attention does not honour")
    q, k, v = query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1)  # (T, H, D)
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = batch.backend.forward(batch, module.layer_idx, q, k, v, scale, **attention_features(kwargs))
    return out.unsqueeze(0), None  # (1, T, H_q, D)


def _no_mask(*args, **kwargs):
    return None  # the paged attention function builds each sequence's causal mask itself


def register_paged_attention() -> str:
    AttentionInterface.register(PAGED_ATTENTION, _paged_attention_forward)
    AttentionMaskInterface.register(PAGED_ATTENTION, _no_mask)
    return PAGED_ATTENTION


def model_configs(model) -> list:
    """Every distinct config object in the model (the top one and any its submodules carry)."""
    return list({id(model.config): model.config,
                 **{id(m.config): m.config for m in model.modules() if hasattr(m, "config")}}.values())


@contextmanager
def attention_implementation(model, name: str, configs=None):
    """Run ``model`` with another registered attention function, then put the old one back; pass
    ``configs`` (:func:`model_configs`) to skip walking the modules every step."""
    configs = model_configs(model) if configs is None else configs
    old = [c._attn_implementation for c in configs]
    for c in configs:
        c._attn_implementation = name
    try:
        yield model
    finally:
        for c, o in zip(configs, old):
            c._attn_implementation = o


__all__ = ["CACHE_KWARG", "KVLabCache", "make_store", "PAGED_ATTENTION", "PagedBatch", "UnsupportedModelError",
           "unknown_arguments", "attention_features", "register_paged_attention", "model_configs",
           "attention_implementation"]
