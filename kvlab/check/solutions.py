"""The reference answers to every build task, and the switch that plugs a participant's function into the
real system once it passes (Triton-Puzzles style: the notebook runs top to bottom whether or not a task is
done); :func:`solution` prints kvlab's own, for instructors and for a participant who is stuck.
"""

from __future__ import annotations

import contextlib
import importlib
import inspect
import io
from typing import Callable

from kvlab.check import capstone, engine, evict, kernels, naive, paged, quant, sizing

_CHECKERS = (sizing, naive, paged, quant, engine, kernels, capstone, evict)  # one module per notebook

# exercise -> "module:function", kvlab's own implementation with the task's signature
REFERENCES = {
    "grow": "kvlab.cache.naive:grow", "decode_loop": "kvlab.generate:cached_generate",
    "static_write": "kvlab.cache.naive:static_write", "slot_mapping": "kvlab.cache.paged:BlockManager.slot_mapping_of",
    "append_slot": "kvlab.cache.paged:append_slot", "prefix_hits": "kvlab.cache.paged:prefix_hits",
    "blocks_after_fork": "kvlab.cache.simulate:fork_blocks", "quantize_per_head": "kvlab.quant.core:quantize_per_head",
    "quantize_static": "kvlab.quant.core:quantize_int8", "pack_int4": "kvlab.quant.core:pack_int4",
    "admission_rule": "kvlab.engine.scheduler:admission_rule",
    "schedule_decodes": "kvlab.engine.scheduler:schedule_decodes",
    "chunk_prefills": "kvlab.engine.scheduler:chunk_prefills", "block_walk": "kvlab.kernels.answers:block_walk",
    "online_softmax_update": "kvlab.kernels.decode:online_softmax_update",
    "dequant_int8": "kvlab.kernels.answers:dequant_int8",
    "sinks_window_blocks": "kvlab.cache.evict:sinks_window_blocks", "h2o_keep": "kvlab.cache.evict:h2o_keep",
    "copy_or_recompute": "kvlab.check.evict:copy_and_recompute", "max_held": "kvlab.capstone:max_held",
    "fp8_scales": "kvlab.export:fp8_scales", "kv_token_bytes": "kvlab.check.answers:kv_token_bytes",
    "mla_bytes_per_token": "kvlab.check.answers:mla_bytes_per_token",
}


def _name(name: str) -> str:
    if not isinstance(name, str) or name not in REFERENCES:
        raise ValueError(f"name must be one of the build tasks {sorted(REFERENCES)}, got {name!r}")
    return name


def reference(name: str) -> Callable:
    """kvlab's own function for the build task ``name``."""
    module, attr = REFERENCES[_name(name)].split(":")
    obj = importlib.import_module(module)
    for part in attr.split("."):  # "Class.method" too
        obj = getattr(obj, part)
    return obj


def solution(name: str) -> None:
    """Print kvlab's own answer to the build task ``name`` (``check.solution("grow")``)."""
    fn = reference(name)
    module, attr = REFERENCES[name].split(":")
    source = inspect.getsource(getattr(fn, "fn", fn))  # a @triton.jit function keeps the Python one in .fn
    # the file in the repository: kvlab.kernels lives in the top-level kernels/ folder
    where = module.replace("kvlab.kernels", "kernels", 1).replace(".", "/") + ".py"
    print(f"# kvlab's answer to {name!r}: {module}.{attr} ({where})")
    print(source)


def use(name: str, fn: Callable) -> Callable:
    """``fn`` if it passes its checker, else kvlab's reference; prints one line saying which runs."""
    checker = next(getattr(m, name) for m in _CHECKERS if hasattr(m, _name(name)))
    with contextlib.redirect_stdout(io.StringIO()):  # the checker's own line was printed by the task's cell
        ok = callable(fn) and checker(fn)
    if ok:
        print(f"[yours] {name} runs below")
        return fn
    print(f"[kvlab's] {name} (until yours passes check.{name})")
    return reference(name)
