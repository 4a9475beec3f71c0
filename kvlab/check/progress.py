"""Which exercises a learner has passed, across notebooks 00-06, kept in one small JSON file."""

from __future__ import annotations

import datetime
import json
import os
from pathlib import Path

from kvlab.files import warn, write_atomic
from kvlab.models import cache_dir

# checker -> (notebook, task, what the exercise is about); the order of the workshop
EXERCISES = {
    "kv_token_bytes": ("00_memory_wall", "Task 1", "bytes one token adds to a model's KV cache"),
    "mla_bytes_per_token": ("00_memory_wall", "Task 2", "what DeepSeek's MLA caches per token"),
    "grow": ("01_naive_cache", "Task 1", "the growing cache's append, plugged into HF generate()"),
    "decode_loop": ("01_naive_cache", "Task 2", "the decode loop: prefill once, then one token a step"),
    "static_write": ("01_naive_cache", "Task 3", "the static cache's in-place write and the view attention reads"),
    "slot_mapping": ("02_paged_blocks", "Task 1", "block table -> slots"),
    "append_slot": ("02_paged_blocks", "Task 2", "a block table's growth, with copy-on-write"),
    "prefix_hits": ("02_paged_blocks", "Task 3", "the prefix hash chain finds the cached blocks"),
    "blocks_after_fork": ("02_paged_blocks", "Task 4", "blocks held by forked samples (copy-on-write)"),
    "quantize_per_head": ("03_int8_quantization", "Task 1", "INT8 per-head quantizer"),
    "quantize_static": ("03_int8_quantization", "Task 2", "INT8 with calibrated static scales, beyond their range"),
    "pack_int4": ("03_int8_quantization", "Task 3", "two 4-bit values per byte"),
    "admission_rule": ("04_continuous_batching", "Task 1", "the scheduler's admission rule"),
    "schedule_decodes": ("04_continuous_batching", "Task 2", "decodes first, preempting from the tail"),
    "chunk_prefills": ("04_continuous_batching", "Task 3", "chunked prefill under the step's token budget"),
    "block_walk": ("05_fused_triton_kernel", "Task 1", "the decode kernel's block-table walk, in Triton"),
    "online_softmax_update": ("05_fused_triton_kernel", "Task 2", "online softmax in a Triton kernel"),
    "dequant_int8": ("05_fused_triton_kernel", "Task 3", "INT8 dequantization in registers, in Triton"),
    "max_held": ("06_putting_it_together", "Task 1", "requests a pool can hold to completion at once"),
    "fp8_scales": ("06_putting_it_together", "Task 2", "the calibrated scales in vLLM's FP8 layout"),
    "sinks_window_blocks": ("07_beyond_one_engine", "Task 1", "the blocks sinks + window keeps after n tokens"),
    "h2o_keep": ("07_beyond_one_engine", "Task 2", "H2O's choice of the blocks a sequence keeps"),
    "copy_or_recompute": ("07_beyond_one_engine", "Task 3", "copy a block back from the host, or recompute it"),
}


def progress_file():
    """``$KVLAB_PROGRESS``, else ``progress.json`` in ``$KVLAB_CACHE`` or ``~/.cache/kvlab``."""
    return Path(os.environ.get("KVLAB_PROGRESS") or cache_dir() / "progress.json")


def read_record(path: Path, what: str, set_aside: bool = False) -> dict:
    """A JSON dict kept for the learner, or {} when missing; unreadable or damaged: a warning, start over
    (``set_aside``: the damaged file kept as ``<name>.bad``)."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:
        aside = ""
        if set_aside:
            try:
                os.replace(path, path.with_name(path.name + ".bad"))
                aside = "set aside as .bad, "
            except OSError:
                pass
        warn(f"{what} {str(path)!r} is unreadable ({type(e).__name__}); {aside}starting a new one")
        return {}
    return data if isinstance(data, dict) else {}


def _load_progress() -> dict:
    return read_record(progress_file(), "progress file")  # a convenience: a damaged one starts over


def is_learners(fn) -> bool:
    """A learner's own function, not kvlab's reference (the notebooks check those too, in CI)."""
    f = getattr(fn, "fn", fn)  # a @triton.jit function wraps the Python one
    module = getattr(f, "__module__", None) or ""
    return not module.startswith("kvlab") and getattr(f, "__name__", "") != "<lambda>"


def record(exercise: str, fn) -> None:
    if exercise not in EXERCISES or not is_learners(fn):
        return
    data = _load_progress()
    data[exercise] = {"passed": datetime.datetime.now().isoformat(timespec="minutes"),
                      "function": getattr(getattr(fn, "fn", fn), "__name__", "?")}
    try:
        write_atomic(progress_file(), json.dumps(data, indent=1), "progress file")  # never a half-written file
    except ValueError as e:  # a read-only home must not break an exercise that passed
        print(f"(progress not saved: {e})")


def progress(reset: bool = False) -> dict:
    """Print and return ``{exercise: date or None}`` of what you passed with your own function."""
    path = progress_file()
    if reset:
        path.unlink(missing_ok=True)
    data = _load_progress()
    done = {name: data[name].get("passed") if isinstance(data.get(name), dict) else None for name in EXERCISES}
    print(f"exercises passed: {sum(v is not None for v in done.values())} of {len(EXERCISES)}  ({path})")
    for name, (notebook, task, what) in EXERCISES.items():
        mark = f"[x] {done[name]}" if done[name] else "[ ] not yet"
        print(f"  {notebook[:2]} {task:<7} {name:<22} {what:<42} {mark}")
    return done
