"""The bridge to production: kvlab's calibrated FP8 scales in vLLM's checkpoint form (notebook 06).

vLLM keeps ``model.layers.{i}.self_attn.k_scale`` / ``.v_scale``, float32 ``[1]`` ("tensor") or
``[num_kv_heads]`` ("attn_head"), declared under ``kv_cache_scheme`` in ``config.json``; ``absmax / 448``
is exactly kvlab's own static FP8 scale. Per-head scales need vLLM's FlashAttention backend (per its docs).
Sources: vLLM's "Quantized KV Cache" docs, compressed-tensors, and vLLM itself (tests/test_peer_vllm.py).
"""

from __future__ import annotations

import json
import os
import textwrap
from collections.abc import Mapping
from pathlib import Path
from typing import NamedTuple

import torch

from kvlab.bench import vllm_peer
from kvlab.calibrate import default_calibration
from kvlab.engine import LLM, SamplingParams
from kvlab.quant import named_config
from kvlab.quant.calibration import Calibration
from kvlab.quant.core import FP8_MAX
from kvlab.sizing import kv_config

STRATEGIES = ("tensor", "attn_head")
SCALES_FILE = "kv_cache_scales.safetensors"
CONFIG_FILE = "config.json"
_GRANULARITY = {"tensor": "per-tensor", "attn_head": "per-head"}  # vLLM's strategy -> kvlab's granularity


def scale_name(layer: int, which: str) -> str:
    """The checkpoint name vLLM loads a scale from (Llama-family layout: SmolLM2, Llama, Qwen, Mistral)."""
    return f"model.layers.{layer}.self_attn.{which}_scale"


def _check_strategy(strategy: str) -> str:
    if strategy not in STRATEGIES:
        raise ValueError(f"strategy must be one of {STRATEGIES}, got {strategy!r}")
    return strategy


def kv_cache_scheme(strategy: str = "tensor") -> dict:
    """compressed-tensors' ``kv_cache_scheme``: static (calibrated), symmetric FP8."""
    return {"num_bits": 8, "type": "float", "strategy": _check_strategy(strategy), "dynamic": False,
            "symmetric": True}


def quantization_config(strategy: str = "tensor") -> dict:
    """A KV-cache-only ``quantization_config``: no weight groups, weights stay dense."""
    return {"quant_method": "compressed-tensors", "format": "dense", "quantization_status": "frozen",
            "config_groups": {}, "ignore": [], "kv_cache_scheme": kv_cache_scheme(strategy)}


def fp8_scales(absmax: torch.Tensor, strategy: str) -> torch.Tensor:
    """The bridge's arithmetic (notebook 06, Task 2): a calibration's abs-max per layer x KV head,
    ``(L, H)``, -> vLLM's FP8 e4m3 scales, ``(L, 1)`` for ``"tensor"`` (one per layer: the largest head)
    or ``(L, H)`` for ``"attn_head"``, each ``absmax / 448`` so the largest value lands on e4m3's largest,
    and 1.0 where the abs-max is below 1e-6 (the zero guard)."""
    amax = absmax.amax(dim=1, keepdim=True) if strategy == "tensor" else absmax  # (L, 1) or (L, H)
    amax = amax.float()
    return torch.where(amax < 1e-6, torch.ones_like(amax), amax / torch.full_like(amax, 448.0))


def vllm_scales(calibration, strategy: str = "tensor", stat: str = "absmax", scales=None) -> dict[str, torch.Tensor]:
    """``{name: float32 scale}`` for every layer's K and V, by the very call kvlab's FP8 cache makes;
    ``scales`` replaces :func:`fp8_scales` (notebook 06 plugs the participant's in)."""
    gran = _GRANULARITY[_check_strategy(strategy)]
    out = {}
    if scales is not None:
        if not callable(scales):
            raise TypeError(f"scales must be a function (or None for kvlab's own), got {type(scales).__name__}")
        if stat != "absmax":
            raise ValueError(f"scales= computes abs-max scales; stat must be 'absmax', got {stat!r}")
        for which in ("k", "v"):
            amax = calibration.stats[which]["per-head"]["absmax"].clone()  # (L, H)
            got = scales(amax, strategy)
            want = (amax.shape[0], 1 if strategy == "tensor" else amax.shape[1])
            if not isinstance(got, torch.Tensor) or tuple(got.shape) != want or not got.is_floating_point():
                found = tuple(got.shape) if isinstance(got, torch.Tensor) else type(got).__name__
                raise ValueError(f"scales returned {found}, expected a float tensor of shape {want} for strategy {strategy!r}")
            for layer in range(want[0]):
                out[scale_name(layer, which)] = got[layer].reshape(-1).float().contiguous()
        return out
    for which in ("k", "v"):
        for layer, s in enumerate(calibration.scales(which, stat, gran, FP8_MAX)):  # (1,1,1) or (1,H,1)
            out[scale_name(layer, which)] = s.reshape(-1).float().contiguous()  # [1] or [H]
    return out


def _model_config(model) -> dict | None:
    """The config.json a model (or its config, or a dict) would be saved with."""
    if model is None:
        return None
    cfg = model.config if hasattr(model, "config") and not isinstance(model, Mapping) else model
    if isinstance(cfg, Mapping):
        return json.loads(json.dumps(dict(cfg)))
    return json.loads(cfg.to_json_string())  # what save_pretrained writes


def export_vllm(out_dir, calibration=None, *, strategy: str = "tensor", stat: str = "absmax", model=None,
                tokenizer=None, model_name: str = "smollm2-135m", scales=None) -> dict:
    """Write ``kv_cache_scales.safetensors`` and ``config.json`` (the model's own, or a fragment to merge)
    atomically; a sharded checkpoint also needs the names in its ``weight_map``."""
    _check_strategy(strategy)
    if calibration is None:
        if model is None or tokenizer is None:
            raise ValueError("export_vllm needs calibration=... or model= and tokenizer= to calibrate the default text")
        calibration = default_calibration(model, tokenizer, model_name, progress=False)
    if not isinstance(calibration, Calibration):
        raise TypeError(f"calibration must be a kvlab Calibration (Calibration.load(path) reads a `kvlab calibrate` "
                        f"file), got {type(calibration).__name__}")
    scales = vllm_scales(calibration, strategy, stat, scales=scales)  # scales=: notebook 06's Task 2, plugged in
    num_layers = calibration.num_layers
    num_kv_heads = calibration.stats["k"]["per-head"]["absmax"].shape[1]
    config = _model_config(model)
    if config is None:
        config = {"quantization_config": quantization_config(strategy)}
    else:
        c = kv_config(model)
        if (c.num_layers, c.num_kv_heads) != (num_layers, num_kv_heads):
            raise ValueError(f"calibration has {num_layers} layers x {num_kv_heads} KV heads but the model has "
                             f"{c.num_layers} x {c.num_kv_heads}: scales from another model?")
        old = config.get("quantization_config")
        if old and old.get("quant_method") != "compressed-tensors":
            raise ValueError(f"model config already has quant_method {old.get('quant_method')!r}; only "
                             "compressed-tensors can carry a kv_cache_scheme")
        config["quantization_config"] = {**quantization_config(strategy), **(old or {}),
                                         "kv_cache_scheme": kv_cache_scheme(strategy)}
    out = Path(out_dir)
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise ValueError(f"out_dir {str(out)!r} is not a folder that can be written: {e.strerror or e}") from None
    final = {"scales": out / SCALES_FILE, "config": out / CONFIG_FILE}
    tmp = {k: p.with_name(f".{p.name}.{os.getpid()}.tmp") for k, p in final.items()}
    meta = {**calibration.meta, "strategy": strategy, "stat": stat, "fp8_max": FP8_MAX}
    try:
        from safetensors.torch import save  # bytes, written with the usual file mode (save_file makes 0600)
        tmp["scales"].write_bytes(save(scales, metadata={"kvlab": json.dumps(meta)}))
        tmp["config"].write_text(json.dumps(config, indent=2) + "\n")
        for key in ("scales", "config"):
            os.replace(tmp[key], final[key])
    except Exception as e:  # OSError, safetensors' own error: one line naming the folder
        raise ValueError(f"cannot write the export into {str(out)!r}: {e}") from e
    finally:
        for p in tmp.values():
            p.unlink(missing_ok=True)
    ks = torch.cat([v for n, v in scales.items() if n.endswith("k_scale")])
    vs = torch.cat([v for n, v in scales.items() if n.endswith("v_scale")])
    return {"out_dir": str(out), "scales_file": str(final["scales"]), "config_file": str(final["config"]),
            "config": "fragment" if model is None else "model", "strategy": strategy, "stat": stat,
            "layers": num_layers, "num_kv_heads": num_kv_heads, "tensors": len(scales),
            "k_scale_min": float(ks.min()), "k_scale_max": float(ks.max()),
            "v_scale_min": float(vs.min()), "v_scale_max": float(vs.max())}


# ---- the export inside a real vLLM (the peer of `make peer`) ----------------------------------------

def servable_folder(out_dir, model_dir, calibration=None, *, strategy: str = "tensor", model=None,
                    tokenizer=None) -> Path:
    """A folder vLLM can open: ``model_dir``'s files, linked or copied, plus :func:`export_vllm`'s two."""
    src, out = Path(model_dir), Path(out_dir)
    if not (src / CONFIG_FILE).is_file():
        raise ValueError(f"model_dir {str(src)!r} has no {CONFIG_FILE}: not a model folder")
    out.mkdir(parents=True, exist_ok=True)
    for f in src.iterdir():
        if f.is_file() and f.name != CONFIG_FILE and not (out / f.name).exists():
            try:
                (out / f.name).symlink_to(f.resolve())
            except OSError:  # no symlinks here (some file systems): a copy does the same
                (out / f.name).write_bytes(f.read_bytes())
    export_vllm(out, calibration, strategy=strategy, model=model, tokenizer=tokenizer)
    return out


def bridge_in_vllm(model, tokenizer, out_dir, *, strategy: str = "tensor", prompts=("The capital of France is",),
                   max_tokens: int = 8, calibration=None) -> dict:
    """Open the exported folder in the peer vLLM and compare what it holds and decodes with kvlab's own
    FP8 cache; raises :class:`kvlab.bench.vllm_peer.PeerError` without the peer."""
    from safetensors.torch import load_file  # the exported scales, as written
    from_dir = getattr(model.config, "_name_or_path", "")
    folder = servable_folder(out_dir, from_dir, calibration, strategy=strategy, model=model, tokenizer=tokenizer)
    exported = {k: v.tolist() for k, v in load_file(str(folder / SCALES_FILE)).items()}
    ids = [list(tokenizer.encode(p)) if isinstance(p, str) else list(p) for p in prompts]
    why_not = vllm_peer.fp8_kv_unsupported()
    theirs = {"skipped": why_not} if why_not else vllm_peer.read_scales(folder, ids, max_tokens=max_tokens)
    llm = LLM(model, tokenizer, num_blocks=64, max_num_seqs=len(ids), calibration=calibration,
              quant_config=named_config("fp8", granularity=_GRANULARITY[strategy]))
    ours = llm.generate(ids, SamplingParams(max_tokens=max_tokens, ignore_eos=True))
    return {"strategy": strategy, "prompts": [p if isinstance(p, str) else None for p in prompts],
            "exported": exported, "vllm": theirs, "kvlab_token_ids": [o.token_ids for o in ours]}


# ---- every kvlab knob, and what vLLM and HF transformers call it ------------------------------------

class Knob(NamedTuple):
    what: str
    kvlab: str  # as named in kvlab.engine.LLM / BlockManager / Scheduler / KVQuantConfig / the kvlab CLI
    vllm: str  # engine argument (LLM(...) keyword) and CLI flag
    hf: str  # transformers 5.24: "CB" = ContinuousBatchingConfig (generate_batch), GenerationConfig, caches
    note: str


KNOBS: tuple[Knob, ...] = (
    Knob("block size", "block_size=16 (LLM, BlockManager); --block-size", "block_size, --block-size (16 on CUDA)",
         "CB page_size=256", "same idea, tokens per page; HF's pages are 16x larger"),
    Knob("pool size", "num_blocks=256 (LLM, BlockManager); --num-blocks",
         "gpu_memory_utilization=0.9 and --gpu-memory-utilization (or num_gpu_blocks_override)",
         "CB num_blocks, max_memory_percent",
         "vLLM sizes the pool from free GPU memory after a profiling run; kvlab takes a count"),
    Knob("prefix caching", "enable_prefix_caching=True (LLM, BlockManager)",
         "enable_prefix_caching, --enable-prefix-caching (on by default in V1)", "CB allow_block_sharing=True",
         "all share full blocks by a chained hash; kvlab hashes with hashlib"),
    Knob("running at once", "max_num_seqs=32 (LLM, Scheduler); --max-num-seqs", "max_num_seqs, --max-num-seqs",
         "CB max_requests_per_batch", "vLLM's default depends on the GPU and entry point (256 or more)"),
    Knob("tokens per step", "max_num_batched_tokens=512 (LLM, Scheduler); --max-num-batched-tokens",
         "max_num_batched_tokens, --max-num-batched-tokens", "CB max_batch_tokens",
         "decodes first, then prefill chunks, in all three"),
    Knob("KV storage dtype", "kv_cache_dtype='auto' (LLM), also fp16, int8, fp8, int4, k8v4; --kv-cache-dtype",
         "kv_cache_dtype, --kv-cache-dtype: auto, fp8, fp8_e4m3, fp8_e5m2",
         "cache_implementation 'quantized' (GenerationConfig) with cache_config backend fp8, quanto or hqq",
         "vLLM: FP8 only; HF's QuantizedCache serves generate(), generate_batch's paged cache is unquantized"),
    Knob("scales from first batch", "KVQuantConfig policy='dynamic': the first write sets the scale",
         "calculate_kv_scales, --calculate-kv-scales", "QuantizedCache backend fp8: scale frozen at first update",
         "vLLM: absmax/200 (K), /100 (V), once; wrong when the first traffic is unrepresentative"),
    Knob("calibrated scales", "kvlab calibrate --out F; --scales-file F; calibration= (LLM)",
         "k_scale, v_scale in the checkpoint + kv_cache_scheme (kvlab export-vllm)",
         "none: HF's quantized caches compute scales on the fly",
         "kvlab's policy='corrected' (widen on overflow) has no equivalent"),
    Knob("chunked prefill", "always on: the Scheduler chunks a prompt past the step's budget",
         "enable_chunked_prefill, --enable-chunked-prefill (on in V1)",
         "always on: the scheduler splits prompts over max_batch_tokens",
         "vLLM can also cap one long prompt's share of a step: long_prefill_token_threshold"),
    Knob("preemption", "recompute: Scheduler.preempt frees the blocks, requeues at the front",
         "recompute only in V1 (V0's --preemption-mode swap is gone)",
         "CB cpu_offload_space=0: offload to CPU if > 0, else restart the request",
         "recompute is cheap while the prefix cache still holds the blocks"),
    Knob("free-block reserve", "watermark=0.01 (LLM, Scheduler)", "internal (V0 block manager watermark 0.01)",
         "CB safety_margin", "keeps admissions from starving running decodes"),
    Knob("batching policy", "policy='continuous' or 'static' (LLM, Scheduler)",
         "continuous only; --scheduling-policy fcfs or priority", "CB scheduler_type='fifo' or 'prefill_first'",
         "'static' is kvlab's baseline to measure against"),
    Knob("attention backend", "attn_backend='torch' (LLM, ModelRunner), also reference, triton; --attn-backend",
         "--attention-backend FLASH_ATTN, FLASHINFER, TRITON_ATTN (was env VLLM_ATTENTION_BACKEND)",
         "attn_implementation sdpa, paged|eager or flash_attention_2/3 (CB auto_switch_to_flash=True picks flash)",
         "per-head FP8 scales need vLLM's FLASH_ATTN on a GPU (its CPU build 0.32 loads them too)"),
)


def knob_table(width: int = 28) -> str:
    """The knobs as a fixed-width text table, each cell wrapped to ``width`` characters (notebook 06)."""
    head = Knob("knob", "kvlab", "vLLM", "HF transformers 5.24", "difference")
    widths = (18, width, width, width, width)
    lines = []
    for i, row in enumerate((head,) + KNOBS):
        cells = [textwrap.wrap(c, w, break_on_hyphens=False) or [""] for c, w in zip(row, widths)]
        for k in range(max(map(len, cells))):
            lines.append("  ".join(f"{(c[k] if k < len(c) else ''):<{w}}" for c, w in zip(cells, widths)).rstrip())
        if i == 0:
            lines.append("  ".join("-" * w for w in widths))
    lines.append("CB = transformers' ContinuousBatchingConfig, passed to model.generate_batch(...)")
    return "\n".join(lines)
