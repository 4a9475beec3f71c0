"""The parts a participant wrote, kept for them (notebook 06 assembles its engine from them).

When a participant's own function passes its checker, its source is kept beside the progress record,
with the task, the kvlab version and the time; the latest pass wins. ``check.mine()`` lists what is kept,
``check.forget(name)`` drops one. Nothing kept runs at ``import kvlab``: :func:`part` compiles one only when
asked, and refuses it by name, in one line, when its task's parameters changed since (another kvlab) or its
record is damaged.
"""

from __future__ import annotations

import contextlib
import datetime
import dis
import inspect
import json
import linecache
import math
import os
import textwrap
import types
from pathlib import Path

import torch

from kvlab.check.progress import EXERCISES, is_learners, progress_file, read_record, record
from kvlab.files import warn, write_atomic

#: each task's parameters, as its notebook's stub states them; a kept part records the ones it was written for
SIGNATURES = {
    "kv_token_bytes": ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size", "bytes_per_element"),
    "mla_bytes_per_token": ("num_layers", "num_heads", "kv_lora_rank", "rope_dim", "bytes_per_element"),
    "grow": ("cached", "new"), "decode_loop": ("step", "prompt_ids", "new_tokens"),
    "static_write": ("buffer", "new", "start"), "slot_mapping": ("block_table", "block_size", "start", "end"),
    "append_slot": ("block_table", "num_tokens", "block_size", "ref_count", "take_block"),
    "prefix_hits": ("token_ids", "block_size", "cached", "block_hash"),
    "blocks_after_fork": ("prompt_len", "block_size", "n", "steps"), "quantize_per_head": ("x",),
    "quantize_static": ("x", "scale"), "pack_int4": ("q",),
    "admission_rule": ("num_running", "max_num_seqs", "budget_left", "blocks_needed", "blocks_free", "watermark_blocks"),
    "schedule_decodes": ("running", "decoding", "append", "preempt"), "chunk_prefills": ("uncomputed", "budget"),
    "block_walk": ("table_ptr", "seq", "page", "seq_len", "s_table", "s_blk", "s_tok", "head", "s_head", "BLOCK_SIZE"),
    "online_softmax_update": ("m", "l", "acc", "s", "v", "v_scale"), "dequant_int8": ("codes", "scale"),
    "max_held": ("lengths", "shared_tokens", "num_blocks", "block_size"), "fp8_scales": ("absmax", "strategy"),
    "sinks_window_blocks": ("num_tokens", "block_size", "budget", "sinks"),
    "h2o_keep": ("logical", "budget", "recent", "scores"),
    "copy_or_recompute": ("tokens", "cfg", "link_bytes_per_s", "flops_per_s"),
}
_FIELDS = {"name": str, "source": str, "signature": list, "jit": bool, "kvlab": str, "kept": str}
KERNEL_TASKS = ("block_walk", "online_softmax_update", "dequant_int8")  # @triton.jit parts (notebook 05)
#: the parts notebook 06's engine plugs in (kvlab.yours), in the order it lists them
ENGINE_TASKS = ("slot_mapping", "append_slot", "prefix_hits", "quantize_static", "admission_rule", "schedule_decodes",
                "chunk_prefills")


def kept_file() -> Path:
    """``$KVLAB_KEPT``, else ``kept_parts.json`` beside the progress file (:func:`progress_file`)."""
    return Path(os.environ.get("KVLAB_KEPT") or progress_file().with_name("kept_parts.json"))


def _load() -> dict:
    return read_record(kept_file(), "kept parts file", set_aside=True)  # the participant's code is in it


def _save(data: dict, what: str) -> bool:
    try:
        write_atomic(kept_file(), json.dumps(data, indent=1), "kept parts file")  # never a half-written file
    except ValueError as e:  # a read-only home must not break an exercise that passed
        warn(f"{what}: {e}")
        return False
    return True


_UNRECORDED: list[bool] = []  # inside unrecorded(): a pass changes no file


@contextlib.contextmanager
def unrecorded():
    """Checkers run inside record no pass and keep nothing (a kept part run again through today's checker)."""
    _UNRECORDED.append(True)
    try:
        yield
    finally:
        _UNRECORDED.pop()


def passed(exercise: str, fn) -> None:
    """A checker passed ``fn``: the progress record, and the part kept if it is the participant's own."""
    if _UNRECORDED:
        return
    record(exercise, fn)
    keep(exercise, fn)


def keep(exercise: str, fn) -> None:
    """Keep a participant's function that just passed ``exercise``'s checker (kvlab's own are not kept)."""
    if exercise not in SIGNATURES or not is_learners(fn):
        return
    f = getattr(fn, "fn", fn)  # a @triton.jit function keeps the Python one in .fn
    try:  # whatever goes wrong here, the pass stands: one line, never a traceback after [ok]
        source = textwrap.dedent(inspect.getsource(f))
        if not _same_code(source, f):  # its file changed since it was imported: that source is not what passed
            raise ValueError("its file changed since")
        from kvlab import __version__

        data = _load()
        data[exercise] = {"name": f.__name__, "source": source, "signature": list(SIGNATURES[exercise]),
                          "jit": exercise in KERNEL_TASKS, "kvlab": __version__,
                          "kept": datetime.datetime.now().isoformat(timespec="minutes")}
        _save(data, "(your part was not kept")
    except Exception as e:  # no source (a %%time cell, exec, a prompt) or a changed file
        warn(f"(your {exercise} passed but was not kept: Python has no source for it here ({type(e).__name__}: "
             f"{e}); define it in a plain cell)")


def _same_code(source: str, f) -> bool:
    """Whether ``source`` compiles to the instructions of ``f``: line numbers and jump offsets aside, and
    Python 3.11's two ways to call a module's function (LOAD_METHOD alone, or LOAD_ATTR after a LOAD_GLOBAL
    that knows the name came from an import in the same file)."""
    code = compile(source, "<kept>", "exec", dont_inherit=True)  # not this file's __future__ imports
    return any(isinstance(c, types.CodeType) and c.co_name == f.__name__ and _ops(c) == _ops(f.__code__)
               for c in code.co_consts)


def _ops(code) -> list:
    """Each instruction's name and argument, a jump's as the index of the instruction it lands on."""
    jumps = set(dis.hasjrel) | set(dis.hasjabs)
    ins = [i for i in dis.get_instructions(code) if i.opname not in ("CACHE", "NOP", "EXTENDED_ARG")]
    at = {i.offset: k for k, i in enumerate(ins)}
    return [("LOAD_ATTR" if i.opname == "LOAD_METHOD" else i.opname,
             _ops(i.argval) if isinstance(i.argval, types.CodeType) else
             ("->", at.get(i.argval)) if i.opcode in jumps else repr(i.argval)) for i in ins]


def _task(name: str) -> str:
    notebook, task, _ = EXERCISES[name]
    return f"{notebook[:2]} {task}"


def _problem(name: str, rec) -> str | None:
    """Why a kept record cannot run (one line), or None."""
    if (not isinstance(rec, dict) or not all(isinstance(rec.get(k), t) for k, t in _FIELDS.items())
            or not rec["name"].isidentifier() or not all(isinstance(p, str) for p in rec["signature"])
            or rec["jit"] != (name in KERNEL_TASKS)):
        return "its record is damaged"
    if tuple(rec["signature"]) != SIGNATURES[name]:
        return (f"written for another version of the task, ({', '.join(rec['signature'])}); the task now takes "
                f"({', '.join(SIGNATURES[name])})")
    return None


def kept_names() -> set[str]:
    """The tasks with a kept record (refused ones included: :func:`part` says why, as it reads them)."""
    return set(_load()) & set(SIGNATURES)


def part(name: str):
    """The kept function for ``name``, compiled now, or None (nothing kept, or refused with one line)."""
    _name(name)
    rec = _load().get(name)
    if rec is None:
        return None
    problem = _problem(name, rec)
    if problem is None:
        namespace = {"torch": torch, "math": math}
        filename = f"<your {name}, kept {rec['kept']}>"
        # as IPython does for a cell: the source where inspect finds it (@triton.jit reads it back)
        linecache.cache[filename] = (len(rec["source"]), None, rec["source"].splitlines(True), filename)
        try:
            if rec["jit"]:
                import triton  # a kernel part: only where triton is installed
                import triton.language as tl

                namespace.update(triton=triton, tl=tl)
            exec(compile(rec["source"], filename, "exec", dont_inherit=True), namespace)
            fn = namespace[rec["name"]]
        except Exception as e:  # no triton here, or a part that passed once but no longer compiles here
            problem = f"its source does not run here ({type(e).__name__}: {e})"
    if problem is not None:
        print(f"[refused] your {name} ({_task(name)}): {problem}; kvlab's runs in its place")
        return None
    return fn


def _name(name) -> str:
    if not isinstance(name, str) or name not in SIGNATURES:
        raise ValueError(f"name must be one of the build tasks {sorted(SIGNATURES)}, got {name!r}")
    return name


def mine() -> dict:
    """Print and return what is kept: ``{task: (function name, kept when, kvlab version) or None}``."""
    data = _load()
    problems = {name: _problem(name, data[name]) for name in SIGNATURES if name in data}
    out = {}
    print(f"your parts kept: {sum(p is None for p in problems.values())} of {len(SIGNATURES)}  ({kept_file()})")
    for name, (notebook, task, what) in EXERCISES.items():
        rec, problem = data.get(name), problems.get(name)
        out[name] = None if rec is None or problem else (rec["name"], rec["kept"], rec["kvlab"])
        mark = ("-" if rec is None else f"refused: {problem}" if problem else
                f"{rec['name']}() kept {rec['kept']} (kvlab {rec['kvlab']})")
        print(f"  {notebook[:2]} {task:<7} {name:<22} {mark}")
    return out


def forget(name: str) -> bool:
    """Drop your kept part for ``name`` (kvlab's own runs in its place); True if one was kept."""
    data = _load() if _name(name) else {}
    if name not in data:
        print(f"nothing kept for {name}")
        return False
    del data[name]
    if not _save(data, f"could not forget your {name}"):
        return False
    print(f"forgot your {name} ({_task(name)}); kvlab's runs in its place")
    return True
