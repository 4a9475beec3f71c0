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

The paged path (notebook 02 on) goes further: it registers its own attention function, so it must
honour whatever a model's layers hand that function (sliding windows, soft caps, sinks, the score
scale). :func:`paged_attention_spec` checks that once per model, before any paged forward, and
refuses the rest in one line (issue 12; the mask-function hook it relies on is transformers 5.x's
``masking_utils``).
"""

from __future__ import annotations

import functools
import inspect
import weakref
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


#: keyword arguments HF models hand their attention function that carry no attention feature: forward
#: flags passed through. Anything else a model passes is a feature kvlab honours (``FEATURES``) or refuses.
PASSED_THROUGH = frozenset({"position_ids", "use_cache", "output_attentions", "output_router_logits",
                            "output_hidden_states", "return_dict", "cache_position", "kvlab_paged"})
#: what the paged attention honours, by the names HF passes them under: the score scale, dropout (only 0,
#: eval mode), a sliding window, a logit soft cap, attention sinks (gpt-oss's ``s_aux``), is_causal (True)
FEATURES = frozenset({"scaling", "dropout", "sliding_window", "softcap", "s_aux", "is_causal"})


def _unknown_arguments(kwargs: dict) -> list[str]:
    """Arguments a model passes its attention function that kvlab neither ignores safely nor honours."""
    return sorted(k for k, v in kwargs.items() if v is not None and k not in PASSED_THROUGH | FEATURES)


def _features(kwargs: dict) -> dict:
    """The paged attention's keyword arguments from what a model passed (window, softcap, sinks)."""
    window, softcap, sinks = kwargs.get("sliding_window"), kwargs.get("softcap"), kwargs.get("s_aux")
    return dict(window=int(window) if window is not None else None,
                softcap=float(softcap) if softcap is not None else None,
                sinks=sinks.detach() if sinks is not None else None)


def _paged_attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    from kvlab import attention as A

    batch: PagedBatch | None = kwargs.get("kvlab_paged")
    if batch is None:
        raise RuntimeError(f"attention '{PAGED_ATTENTION}' needs a kvlab_paged=PagedBatch(...) argument; "
                           "use kvlab.engine.LLM or kvlab.generate.paged_generate")
    unknown = _unknown_arguments(kwargs)
    if unknown or dropout or kwargs.get("is_causal") is False:  # paged_attention_spec refuses these up front
        what = unknown or ([f"dropout={dropout}"] if dropout else ["is_causal=False"])
        raise UnsupportedModelError(f"{type(module).__name__} passes {', '.join(what)} to its attention function, "
                                    "which kvlab's paged attention does not honour")
    feat = _features(kwargs)
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
                                     v_new[:nd] if quantized else None, **feat)
    elif nd:  # decodes (packed first, one token each): one batched gather + SDPA
        if quantized:
            out[:nd] = A.quantized_batched_decode_attention(q[:nd], k_new[:nd], v_new[:nd], cache, layer,
                                                            batch.decode, scale, **feat)
        else:
            out[:nd] = A.batched_decode_attention(q[:nd], cache.k_cache[layer], cache.v_cache[layer], batch.decode,
                                                  scale, **feat)
    if nd < q.shape[0]:  # everything else one sequence at a time: the reference, the specification
        rest = (batch.block_tables[nd:], batch.context_lens[nd:], batch.query_lens[nd:])
        if quantized:
            out[nd:] = A.quantized_paged_attention(q[nd:], k_new[nd:], v_new[nd:], cache, layer, *rest, scale,
                                                   **feat)
        else:
            out[nd:] = A.paged_attention(q[nd:], cache.k_cache[layer], cache.v_cache[layer], *rest, scale=scale,
                                         **feat)
    return out.unsqueeze(0), None  # (1, T, H_q, D), as HF's attention functions return


def _no_mask(*args, **kwargs):
    return None  # the paged attention function builds each sequence's causal mask itself


def register_paged_attention() -> str:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(PAGED_ATTENTION, _paged_attention_forward)
    AttentionMaskInterface.register(PAGED_ATTENTION, _no_mask)
    return PAGED_ATTENTION


# ---- which models the paged path can run (issue 12) -----------------------------------------------
# The paged attention function replaces HF's: whatever a model's layers hand their attention function
# must be honoured there, or the model refused, never silently dropped. Before the first paged forward,
# kvlab runs the model once on 3 tokens with a recording attention function (the "probe") and checks
# every layer's arguments and every attention mask the model builds.

class UnsupportedModelError(ValueError):
    """kvlab's paged attention cannot run this model faithfully; raised before any paged forward."""


@dataclass(frozen=True)
class LayerAttention:
    """What one layer hands its attention function, as the probe saw it."""

    layer: int
    scaling: float
    sliding_window: int | None = None
    softcap: float | None = None
    sinks: bool = False


_PROBE = "kvlab_probe"
_probe_record: dict = {}
#: model -> (config fingerprint, its layers' spec or the refusal's message); only strings and plain values,
#: so a refused model is not kept alive by its own exception's traceback
_SPECS: "weakref.WeakKeyDictionary" = weakref.WeakKeyDictionary()


def _probe_attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    mask = _probe_record["masks"].get(attention_mask.data_ptr()) if torch.is_tensor(attention_mask) else None
    _probe_record["calls"].append((module, tuple(query.shape), tuple(key.shape), tuple(value.shape), scaling,
                                   dropout, {k: v for k, v in kwargs.items() if k != "kvlab_paged"}, mask))
    return query.new_zeros(query.shape[0], query.shape[2], query.shape[1], value.shape[-1]), None


def _probe_mask(*args, mask_function=None, **kwargs):
    """Hand out a token tensor per mask built; the layer that receives it tells which mask is its own."""
    token = torch.ones((1, 1, 1, 1), dtype=torch.bool)
    _probe_record["masks"][token.data_ptr()] = (token, mask_function)
    return token


@functools.cache
def _mask_grid(window: int | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(query, key) absolute positions to read a mask function at: every pair below 256; around powers
    of two up to 2**20 (window and chunk edges) for the long contexts; and, for a layer told a sliding
    ``window``, keys at distance window - 1, window and window + 1 from queries beyond it (an off-by-one
    between the mask and the argument shows there, whatever the window's size)."""
    dense = torch.arange(256)
    q_big = {b + d for k in range(8, 21) for b in (2 ** k, 3 * 2 ** (k - 1)) for d in (-1, 0, 1)}
    offsets = {-1, 0} | {2 ** j + d for j in range(21) for d in (-1, 0, 1)}
    if window is not None:
        q_big |= {window + d for d in (-1, 0, 1, 2, 7)} | {3 * window + 5}
        offsets |= {window - 1, window, window + 1}
    q_big, offsets = torch.tensor(sorted(q_big)), torch.tensor(sorted(offsets))
    q = torch.cat([dense.repeat_interleave(256), q_big.repeat_interleave(len(offsets))])
    kv = torch.cat([dense.repeat(256), (q_big[:, None] - offsets[None, :]).clamp(min=0).flatten()])
    return q, kv


def _read_mask(mask_function, window: int | None = None) -> torch.Tensor | None:
    """An HF mask function read on the grid of :func:`_mask_grid` (None: it cannot be read there)."""
    q, kv = _mask_grid(window)
    zero = torch.zeros((), dtype=torch.long)
    try:
        return torch.as_tensor(mask_function(zero, zero, q, kv)).bool().expand_as(q)
    except Exception:  # a mask function that only works under vmap or on a device: not one we can check
        return None


def _describe_mask(got: torch.Tensor | None, window: int | None) -> str:
    """What a mask that is not the expected one is, in words, for the refusal."""
    from kvlab.attention import visible

    if got is None:
        return "a mask function kvlab cannot evaluate"
    q, kv = _mask_grid(window)
    if bool((got & (kv > q)).any()):
        return "bidirectional attention (a query sees later tokens)"
    causal = visible(q, kv)
    cut = q[causal & ~got]  # queries that miss a key causal attention would let them see
    if not len(cut):
        return "causal attention without a window"
    first = int(cut.min())  # a window W first hides a key at query W; a chunk C first at query C
    if torch.equal(got, causal & (kv // first == q // first)):
        return f"chunked attention (chunks of {first} tokens)"
    if torch.equal(got, visible(q, kv, first)):
        return f"a sliding window of {first} tokens"
    return "a mask pattern kvlab does not build"


def _model_name(model) -> str:
    return getattr(model.config, "model_type", None) or type(model).__name__


def _fingerprint(model) -> str:
    cfgs = [{k: v for k, v in c.to_dict().items() if not k.startswith("_attn")} for c in model_configs(model)]
    return repr((cfgs, model.training))


def paged_attention_spec(model) -> tuple[LayerAttention, ...]:
    """What each layer of ``model`` hands its attention function, checked to be something kvlab's paged
    attention honours: causal attention with the score ``scaling``, a per-layer ``sliding_window``,
    ``softcap`` and attention sinks. Anything else is an :class:`UnsupportedModelError` (one line naming
    the model and the feature). One 3-token forward, remembered per model until its config changes (a
    forward that fails is not remembered: it may be an out-of-memory error or a bug, not the model)."""
    key = _fingerprint(model)
    hit = _SPECS.get(model)
    if hit is not None and hit[0] == key:
        if isinstance(hit[1], str):
            raise UnsupportedModelError(hit[1]) from None
        return hit[1]
    try:
        spec = _probe(model)
    except _ForwardFailed as e:
        raise UnsupportedModelError(str(e)) from None
    except UnsupportedModelError as e:
        _SPECS[model] = (key, str(e))
        raise UnsupportedModelError(str(e)) from None
    _SPECS[model] = (key, spec)
    return spec


class _ForwardFailed(Exception):
    """The probe's forward raised: refused now, not remembered."""


#: RoPE variants that recompute their frequencies from the largest position in each forward
#: (``modeling_rope_utils.dynamic_rope_update``): in a packed batch that is the longest sequence's
SEQUENCE_DEPENDENT_ROPE = ("dynamic", "longrope")


def _rope_types(model) -> set[str]:
    types = set()
    for m in model.modules():
        rt = getattr(m, "rope_type", None)
        types |= set(rt.values()) if isinstance(rt, dict) else {rt} if isinstance(rt, str) else set()
    return types


def _probe(model) -> tuple[LayerAttention, ...]:
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    from kvlab.attention import visible
    from kvlab.sizing import kv_config

    name = _model_name(model)

    def refuse(reason: str, hf_attention_runs: bool = True):
        # where only the attention function is the problem, HF's own attention (and kvlab's caches that
        # plug into it) still runs the model; not where the cache shapes or the forward are the problem
        tail = "; the 'dynamic' and 'static' caches can (they use HF's own attention)" if hf_attention_runs else ""
        return UnsupportedModelError(f"kvlab's paged cache cannot run {name!r}: {reason}{tail}")

    rope = sorted(_rope_types(model) & set(SEQUENCE_DEPENDENT_ROPE))
    if rope:
        raise refuse(f"its RoPE ({rope[0]!r}) recomputes its frequencies from the largest position in each forward, "
                     "so in a packed batch one sequence's positions would be encoded by another's length")
    AttentionInterface.register(_PROBE, _probe_attention)
    AttentionMaskInterface.register(_PROBE, _probe_mask)
    device = next(model.parameters()).device
    _probe_record.update(calls=[], masks={})
    try:
        with torch.inference_mode(), attention_implementation(model, _PROBE):
            model(input_ids=torch.tensor([[1, 2, 3]], device=device), position_ids=torch.arange(3, device=device)[None],
                  use_cache=False, logits_to_keep=1)
        calls = _probe_record["calls"]
    except torch.OutOfMemoryError:
        raise
    except Exception as e:  # e.g. a forward without logits_to_keep or position_ids: the engine passes both
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise _ForwardFailed(str(refuse(f"its 3-token forward with kvlab's arguments fails ({type(e).__name__}: "
                                        f"{first})", False))) from None
    finally:
        _probe_record.clear()  # no module or mask kept alive here
    if not calls:
        raise refuse("its layers compute attention themselves instead of calling transformers' AttentionInterface, "
                     "so there is no attention function to replace")
    cfg = kv_config(model)
    layers = [getattr(c[0], "layer_idx", None) for c in calls]
    if None in layers or sorted(layers) != list(range(cfg.num_layers)):
        raise refuse(f"its attention is called for layers {layers}, not once for each of its {cfg.num_layers} layers",
                     False)
    spec = []
    for module, q_shape, k_shape, v_shape, scaling, dropout, kw, mask in sorted(calls, key=lambda c: c[0].layer_idx):
        i = module.layer_idx
        if k_shape[-1] != v_shape[-1]:
            raise refuse(f"its keys and values have different head sizes ({k_shape[-1]} and {v_shape[-1]}: multi-head "
                         "latent attention) and kvlab's caches store both at one head_dim", False)
        for what, shape in (("key", k_shape), ("value", v_shape)):
            if (shape[1], shape[-1]) != (cfg.num_kv_heads, cfg.head_dim):
                raise refuse(f"layer {i} has {shape[1]} {what} heads of {shape[-1]} dims, its config says "
                             f"{cfg.num_kv_heads} of {cfg.head_dim}, and kvlab sizes its caches from the config", False)
        if q_shape[1] % k_shape[1] or q_shape[-1] != k_shape[-1]:
            raise refuse(f"layer {i} has {q_shape[1]} query heads of {q_shape[-1]} dims for {k_shape[1]} KV heads "
                         f"of {k_shape[-1]}")
        unknown = _unknown_arguments(kw)
        if unknown:
            raise refuse(f"layer {i} passes {', '.join(unknown)} to its attention function, which kvlab's paged "
                         "attention does not honour")
        if dropout:
            raise refuse(f"attention dropout {dropout} is on (the model is in training mode: call model.eval())")
        if kw.get("is_causal") is False:
            raise refuse(f"layer {i} asks for non-causal attention")
        sinks = kw.get("s_aux")
        if sinks is not None and tuple(sinks.shape) != (q_shape[1],):
            raise refuse(f"layer {i}'s attention sinks have shape {tuple(sinks.shape)}, not one per query head")
        window, softcap = kw.get("sliding_window"), kw.get("softcap")
        window = int(window) if window is not None else None
        if window is not None and window < 1:
            raise refuse(f"layer {i} passes sliding_window={window}: a query would see no key, not even itself")
        # HF's own attention obeys the mask, not the sliding_window argument: they must say the same
        if mask is None:
            raise refuse(f"layer {i} gets no attention mask from transformers' masking_utils, so kvlab cannot "
                         "check that its attention is causal")
        got = _read_mask(mask[1], window)
        if got is None or not torch.equal(got, visible(*_mask_grid(window), window)):
            told = f"a window of {window}" if window else "no window"
            raise refuse(f"layer {i} attends with {_describe_mask(got, window)}, but the paged attention builds only "
                         f"causal masks with the sliding window a layer passes it (layer {i} passes {told})")
        spec.append(LayerAttention(i, float(scaling if scaling is not None else q_shape[-1] ** -0.5), window,
                                   float(softcap) if softcap is not None else None, sinks is not None))
    return tuple(spec)


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
           "register_paged_attention", "paged_attention_spec", "LayerAttention", "UnsupportedModelError",
           "attention_implementation"]
