"""Which models kvlab's paged path can run, found out before the first paged forward (notebook 02).

The paged attention replaces HF's, so whatever a model's layers hand it must be honoured or the model
refused, never silently dropped; one recorded 3-token forward checks every layer's arguments and masks.
"""

from __future__ import annotations

import functools
import weakref
from dataclasses import dataclass

import torch
from transformers import AttentionInterface
from transformers.masking_utils import AttentionMaskInterface

from kvlab.attention import visible
from kvlab.hf import UnsupportedModelError, attention_implementation, model_configs, unknown_arguments
from kvlab.sizing import kv_config


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
    """(query, key) positions to probe a mask at: all pairs below 256, around powers of two up to 2**20,
    and keys window +- 1 away, where an off-by-one between mask and argument shows whatever the window."""
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
    """What each layer hands its attention function, if kvlab honours it (causal, scaling, window, softcap,
    sinks), else a one-line :class:`UnsupportedModelError`. Remembered per model until its config changes;
    a failed forward is not remembered (it may be out of memory or a bug, not the model)."""
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
        unknown = unknown_arguments(kw)
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


__all__ = ["paged_attention_spec", "LayerAttention", "UnsupportedModelError", "SEQUENCE_DEPENDENT_ROPE"]
