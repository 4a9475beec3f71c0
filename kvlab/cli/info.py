"""``kvlab info``, ``size``, ``convert``: none of them runs a model (notebook 00 shows the same in Python)."""

from __future__ import annotations

from pathlib import Path

from kvlab import models  # through the module: tests swap its functions
from kvlab.env import lab_info
from kvlab.kernels import triton_mode
from kvlab.sizing import PRESETS, fmt_bytes, kv_config, kv_size
from kvlab.cli.common import CLIError, emit


def cmd_info(args) -> int:
    info = lab_info()
    obj = {**info.__dict__, "triton_mode": triton_mode(), "cache_dir": str(models.cache_dir()),
           "models": models.model_status()}
    lines = [info.line(), f"cache dir: {obj['cache_dir']}"]
    for name, st in obj["models"].items():
        lines.append(f"model {name}: {'converted' if st['converted'] else 'not converted yet'} ({st['folder']})")
    emit(obj, args.json, lines)
    return 0


def _model_config(model: str):
    """A preset name as it is, else the model's HF config (a local folder or an HF id): what kv_config reads."""
    if model.lower() in PRESETS:
        return model
    name = models.resolve_name(model)
    if not Path(name).is_dir() and "/" not in name:
        raise CLIError(f"unknown model {model!r}: use a preset ({', '.join(sorted(PRESETS))}), "
                       "a local model folder or an HF id (org/name)")
    if Path(name).is_dir():
        models.check_model_folder(name)  # a one-line reason when the folder is not a model
    try:
        from transformers import AutoConfig  # heavy: only when the model is no preset
        return AutoConfig.from_pretrained(name)
    except (OSError, ValueError):
        raise CLIError(f"unknown model {model!r}: use a preset ({', '.join(sorted(PRESETS))}), "
                       "a local model folder or a reachable HF id") from None


def cmd_size(args) -> int:
    cfg = kv_config(_model_config(args.model))
    size = kv_size(cfg, args.dtype, tokens=args.tokens, batch=args.batch, scales=args.scales)
    obj = {**size.as_dict(), "attention": cfg.attention, "num_layers": cfg.num_layers,
           "num_kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim}
    lines = [
        f"{cfg.name}: {cfg.num_layers} layers, {cfg.attention}, {cfg.num_kv_heads} KV heads x {cfg.head_dim} dims",
        f"{args.dtype} ({'no' if size.scales == 'none' else size.scales} scales): "
        f"{fmt_bytes(size.bytes_per_token)} per token",
        f"{args.tokens} tokens x batch {args.batch}: {fmt_bytes(size.total_bytes)} ({size.total_bytes:,} bytes)",
    ]
    emit(obj, args.json, lines)
    return 0


def cmd_convert(args) -> int:
    folder = models.convert_smollm2(force=args.force)
    emit({"folder": str(folder)}, args.json, [f"smollm2-135m ready in {folder}"])
    return 0
