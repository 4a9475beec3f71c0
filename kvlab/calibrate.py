"""Calibration runs (notebook 03): a model over calibration text, its post-RoPE K and V (and K after the
Hadamard rotation) summarised as a Calibration. What needs no model is :mod:`kvlab.quant.calibration`.
"""

from __future__ import annotations

import torch

from kvlab.cache import ContiguousCache
from kvlab.data import CALIBRATION_PLAY, calibration_chunks
from kvlab.files import check_writable_target, warn
from kvlab.hf import CACHE_KWARG, KVLabCache
from kvlab.models import cache_dir
from kvlab.quant.calibration import PERCENTILES, Calibration, summarize
from kvlab.quant.rotation import rotate
from kvlab.sizing import kv_config


@torch.inference_mode()
def collect_kv(model, chunks: list[list[int]], progress: bool = True) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    """Post-RoPE K and V of every layer over all chunks, concatenated: lists of (T_total, H, D)."""
    keys, values = None, None
    device = next(model.parameters()).device
    it = chunks
    if progress:
        from tqdm.auto import tqdm  # optional: only for the progress bar
        it = tqdm(chunks, desc="calibrating", unit="chunk")
    for ids in it:
        store = ContiguousCache.from_model(model)
        model(input_ids=torch.tensor([ids], device=device), use_cache=True, **{CACHE_KWARG: KVLabCache(store)})
        ks = [k[0].transpose(0, 1).float().cpu() for k in store.keys]  # (T, H, D) per layer
        vs = [v[0].transpose(0, 1).float().cpu() for v in store.values]
        keys = ks if keys is None else [torch.cat([a, b]) for a, b in zip(keys, ks)]
        values = vs if values is None else [torch.cat([a, b]) for a, b in zip(values, vs)]
    return keys, values


def calibrate(model, chunks: list[list[int]], percentiles=PERCENTILES, progress: bool = True,
              meta: dict | None = None) -> Calibration:
    """Calibrate on token chunks (each run as its own sequence from position 0)."""
    if not chunks or any(not c for c in chunks):
        raise ValueError("chunks must be a non-empty list of non-empty token lists")
    keys, values = collect_kv(model, chunks, progress)
    stats = {"k": summarize(keys, percentiles), "v": summarize(values, percentiles),
             "k_rot": summarize([rotate(k) for k in keys], percentiles)}
    info = {"tokens": sum(len(c) for c in chunks), "chunks": len(chunks), "percentiles": list(percentiles)}
    return Calibration(stats, {**info, **(meta or {})})


def default_calibration(model, tokenizer, model_name: str, tokens: int = 2048, progress: bool = True) -> Calibration:
    """Calibrate on the lab's default set once per model and size; later calls load the cached file."""
    path = cache_dir() / "calibration" / f"{model_name}-{CALIBRATION_PLAY}-{tokens}.safetensors"
    if path.exists():
        c = kv_config(model)
        try:
            cal = Calibration.load(path)
            cal.check_model(c.num_layers, c.num_kv_heads, c.head_dim, f"cached calibration {str(path)!r}")
            return cal
        except ValueError as e:  # a cache we own: rebuild it rather than fail on every run from now on
            warn(f"{e}; recalibrating")
    check_writable_target(path, "calibration file")  # before the work, not after it
    cal = calibrate(model, calibration_chunks(tokenizer, tokens), progress=progress,
                    meta={"model": model_name, "text": CALIBRATION_PLAY})
    cal.save(path)
    return cal
