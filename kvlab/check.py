"""Exercise checkers for the notebooks (Tensor-Puzzles style).

Each exercise in a notebook is a spec in prose, a stub that raises ``NotImplementedError`` and one
call here. A checker runs the learner's function on fixed cases, compares with kvlab's own answer
and prints ONE stable line: ``[ok]``, ``[todo]`` (stub not written yet: shows the target, so the
notebook still runs top to bottom) or ``[fail]`` (shows yours vs expected for the first mismatch).
It returns True only on ``[ok]``.
"""

from __future__ import annotations

import datetime
import json
import math
import os
from pathlib import Path
from typing import Any, Callable, Sequence

import torch

from kvlab import kernels, sizing
from kvlab.bench.caches import token_forwards as ref_token_forwards
from kvlab.cache import BlockManager
from kvlab.cache.naive import static_tokens_stored
from kvlab.cache.naive import static_utilization as ref_static_utilization
from kvlab.cache.simulate import fork_blocks
from kvlab.engine.dry_run import dry_run
from kvlab.engine.scheduler import admission_rule as ref_admission_rule
from kvlab.files import warn, write_atomic
from kvlab.models import cache_dir
from kvlab.quant.core import int8_roundtrip, quantize_int8
from kvlab.quant.core import pack_int4 as ref_pack_int4
from kvlab.validate import cdiv


def _short(obj) -> str:
    """A one-line picture of an argument or result: tensors as shape, dtype and first values."""
    if isinstance(obj, torch.Tensor):
        head = obj.flatten()[:6].tolist()
        head = [round(v, 4) if isinstance(v, float) else v for v in head]
        return f"tensor{tuple(obj.shape)} {str(obj.dtype).replace('torch.', '')} {head}{'...' if obj.numel() > 6 else ''}"
    if isinstance(obj, tuple):
        return "(" + ", ".join(_short(o) for o in obj) + ")"
    text = repr(obj)
    return text if len(text) <= 120 else text[:117] + "..."


def _first_difference(got, expected) -> str:
    pairs = list(zip(got, expected)) if isinstance(expected, tuple) and isinstance(got, tuple) else [(got, expected)]
    for i, (a, b) in enumerate(pairs):
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and a.shape == b.shape:
            diff = (a.float() - b.float()).abs() > 1e-6 * (1 + b.float().abs())
            if diff.any():
                idx = tuple(int(j) for j in diff.nonzero()[0])
                where = f"item {i}, " if len(pairs) > 1 else ""
                return f" (first difference at {where}index {idx}: yours {a[idx].item()}, expected {b[idx].item()})"
    return ""


def _run(name: str, fn: Callable, cases: Sequence[tuple[tuple, Any]], same=None, exercise: str | None = None,
         learner=None, hint: Callable | None = None, reveal: bool = True) -> bool:
    """``hint(args, got, expected)`` may name a known mistake behind a failure (a string, or None).
    ``reveal=False`` (exercises that need an idea, not a formula): ``[todo]`` does not show an answer."""
    if not callable(fn):
        raise TypeError(f"{name}: pass your function itself, got {type(fn).__name__}")
    exercise = exercise or name
    same = same or (lambda a, b: a == b)
    for args, expected in cases:
        try:
            got = fn(*args)
        except NotImplementedError:
            print(f"[todo] {name}: not written yet - for {_short(args)} the answer is {_short(expected)}" if reveal
                  else f"[todo] {name}: not written yet - the checker will name the usual mistakes")
            return False
        except Exception as e:  # the learner's bug, shown rather than raised
            print(f"[fail] {name}{_short(args)} raised {type(e).__name__}: {e}")
            return False
        if not same(got, expected):
            try:
                why = hint(args, got, expected) if hint else None
            except Exception:  # a hint must never hide the verdict
                why = None
            print(f"[fail] {name}{_short(args)}: yours {_short(got)}, expected {_short(expected)}"
                  f"{_first_difference(got, expected)}" + (f" - {why}" if why else ""))
            return False
    print(f"[ok] {name}: {len(cases)} cases match")
    _record(exercise, learner if learner is not None else fn)
    return True


# ---- notebook 00 -------------------------------------------------------------------------------

def _kv_bytes_cases():
    cases = []
    for name in ("llama-2-7b", "llama-2-70b", "llama-3-8b", "qwen2.5-7b", "smollm2-135m"):
        c = sizing.kv_config(name)
        for dtype, nbytes in (("fp16", 2), ("fp32", 4), ("int8", 1)):
            cases.append(((c.num_layers, c.num_kv_heads, c.head_dim, nbytes), sizing.kv_bytes_per_token(name, dtype)))
    return cases


def kv_bytes_per_token(fn: Callable[[int, int, int, int], int]) -> bool:
    """``fn(num_layers, num_kv_heads, head_dim, bytes_per_element) -> bytes one token adds``."""
    def hint(args, got, expected):
        if got == expected / 2:
            return "a key AND a value are stored per head"
        if got == expected * 2:
            return "the factor 2 is K and V, counted once"
        return None

    return _run("kv_bytes_per_token", fn, _kv_bytes_cases(), hint=hint)


def mla_bytes_per_token(fn: Callable[[int, int, int, int, int], int]) -> bool:
    """``fn(num_layers, num_heads, kv_lora_rank, rope_dim, bytes_per_element)``: bytes one token adds
    to an MLA model's cache (DeepSeek-V2/V3): one latent of ``kv_lora_rank`` plus one RoPE key of
    ``rope_dim`` per layer, shared by all heads and by K and V."""
    shapes = [(2, 3, 8, 4, 4),  # a toy first
              (61, 128, 512, 64, 2),  # DeepSeek-V3 (and R1), fp16
              (27, 16, 512, 64, 2),  # DeepSeek-V2-Lite
              (60, 128, 512, 64, 1)]  # DeepSeek-V2, an 8-bit cache
    cases = [((layers, heads, rank, rope, b), sizing.mla_token_bytes(layers, rank, rope, b))
             for layers, heads, rank, rope, b in shapes]

    def hint(args, got, expected):
        layers, heads, rank, rope, b = args
        if got == 2 * expected:
            return "K and V are not stored separately: both are re-created from the one latent"
        if got in (expected * heads, 2 * expected * heads):
            return "the latent is not per head: one per layer serves all heads"
        if got == layers * (rank + heads * rope) * b:
            return "the RoPE key is shared by all heads, not one per head"
        if got == layers * rank * b:
            return "the decoupled RoPE key is cached too"
        return None

    return _run("mla_bytes_per_token", fn, cases, hint=hint, reveal=False)


# ---- notebook 01 -------------------------------------------------------------------------------

def token_forwards(fn: Callable[[int, int, bool], int]) -> bool:
    """``fn(prompt_len, new_tokens, cached) -> token positions pushed through the model``.

    Without a cache, step i re-runs the whole prefix (prompt_len + i positions); with one, the
    prompt goes through once and each later step feeds one token. The last token is sampled,
    never fed back.
    """
    cases = [((p, n, c), ref_token_forwards(p, n, c)) for p, n in ((1, 1), (4, 3), (16, 16), (128, 16), (512, 64))
             for c in (False, True)]
    return _run("token_forwards", fn, cases)


def static_utilization(fn: Callable[[Sequence[int], int, int], float]) -> bool:
    """``fn(tokens_per_sequence, max_batch, max_seq_len) -> tokens stored / slots reserved``."""
    cases = [((lens, b, t), ref_static_utilization(lens, b, t))
             for lens, b, t in (([10], 1, 10), ([10, 20], 2, 40), ([5, 50, 500], 4, 2048), ([100] * 8, 8, 4096))]
    return _run("static_utilization", fn, cases, same=lambda a, b: isinstance(a, (int, float))
                and math.isclose(a, b, rel_tol=1e-9))


def tokens_stored(fn: Callable[[Sequence[int], Sequence[int]], list]) -> bool:
    """``fn(prompt_lens, answer_lens) -> real tokens per row`` of a static cache after one padded greedy
    batch (answers cut after their end-of-sequence token)."""
    shapes = [([5], [3]), ([37, 38, 40, 46], [8, 64, 64, 64]), ([10, 10], [1, 4]), ([4, 9, 2], [6, 6, 2]),
              ([7, 7, 7], [5, 5, 5])]
    cases = [((p, a), static_tokens_stored(p, a)) for p, a in shapes]

    def hint(args, got, expected):
        p, a = args
        if not isinstance(got, (list, tuple)) or len(got) != len(p):
            return "one number per row"
        longest = [i for i, n in enumerate(a) if n == max(a)]
        early = [i for i, n in enumerate(a) if n < max(a)]
        if any(got[i] == p[i] + a[i] for i in longest):
            return "the longest row's last token is sampled from the final step and never fed back"
        if early and all(got[i] == p[i] + max(a) - 1 for i in early):
            return "after its end-of-sequence token a row only receives pads: written, but not tokens"
        if early and all(got[i] == p[i] + a[i] - 1 for i in early):
            return "a row that ended early did feed back its last token (the loop went on for the others)"
        return None

    return _run("tokens_stored", fn, cases, same=lambda x, y: list(x) == list(y) if isinstance(x, (list, tuple)) else False,
                hint=hint, reveal=False)


# ---- notebook 02 -------------------------------------------------------------------------------

def slot_mapping(fn: Callable[[Sequence[int], int, int, int], list]) -> bool:
    """``fn(block_table, block_size, start, end) -> slots of tokens start..end-1``."""
    cases = []
    for bs, lengths in ((1, (3,)), (4, (10, 3)), (16, (40, 1, 16)), (8, (64,))):
        bm = BlockManager(64, bs)
        for i, n in enumerate(lengths):
            bm.allocate(i, [7] * n)
        for i, n in enumerate(lengths):
            for start, end in ((0, n), (n - 1, n), (n // 2, n)):
                cases.append(((bm.block_table(i), bs, start, end), bm.slot_mapping(i, start, end)))
    return _run("slot_mapping", fn, cases, same=lambda a, b: list(a) == b)


def blocks_after_fork(fn: Callable[[int, int, int, int], int]) -> bool:
    """``fn(prompt_len, block_size, n, steps)``: physical blocks held after a prompt is forked into
    ``n`` samples (the original counts as one) and each sample writes ``steps`` new tokens."""
    shapes = [(37, 16, 4, 20), (10, 4, 3, 1), (8, 4, 2, 5), (5, 16, 6, 11), (5, 16, 6, 12), (32, 16, 3, 1),
              (100, 16, 1, 30), (10, 4, 3, 0)]
    cases = [(a, fork_blocks(*a)) for a in shapes]

    def hint(args, got, expected):
        p, bs, n, steps = args
        if got == n * cdiv(p + steps, bs):
            return "the samples share the prompt's full blocks: count those once"
        if steps and p % bs and got == cdiv(p, bs) + n * (cdiv(p + steps, bs) - cdiv(p, bs)):
            return "the prompt's partial last block: a sample's first write copies it (copy-on-write)"
        if steps == 0 and got > expected:
            return "nobody writes, so nothing is copied: every block is still shared"
        if steps and p % bs and got == expected + 1:
            return "n - 1 copies, not n: the last sample to write finds the block no longer shared and keeps it"
        return None

    return _run("blocks_after_fork", fn, cases, hint=hint, reveal=False)


# ---- notebook 03 -------------------------------------------------------------------------------

def _tensor_same(a, b) -> bool:
    if isinstance(b, tuple):
        return isinstance(a, tuple) and len(a) == len(b) and all(_tensor_same(x, y) for x, y in zip(a, b))
    if not isinstance(a, torch.Tensor) or a.shape != b.shape:
        return False
    if b.dtype.is_floating_point:
        return bool(torch.allclose(a.float(), b.float(), rtol=1e-6, atol=1e-12))
    return a.dtype == b.dtype and bool(torch.equal(a, b))


def quantize_per_head(fn: Callable) -> bool:
    """``fn(x) -> (q, scale)``: x (T, H, D) float; q int8 in -127..127 rounded half to even; scale
    (1, H, 1) = absmax / 127 per head, 1.0 where a head is all (near) zero."""
    g = torch.Generator().manual_seed(0)
    xs = [torch.randn(4, 3, 8, generator=g), torch.randn(16, 2, 4, generator=g) * torch.tensor([5.0, 0.01]).view(1, 2, 1)]
    halves = torch.tensor([0.5, 1.5, 2.5, -0.5, -2.5, 127.0, -127.0, 3.0]).view(1, 1, 8)  # scale exactly 1
    zero_head = torch.randn(3, 2, 8, generator=g)
    zero_head[:, 1] = 0
    cases = [((x,), int8_roundtrip(x, "per-head")) for x in xs + [halves, zero_head]]
    return _run("quantize_per_head", fn, cases, same=_tensor_same)


def quantize_static(fn: Callable) -> bool:
    """``fn(x, scale) -> q``: x (T, H, D) float, scale (1, H, 1) from a calibration run (not from x);
    q int8 = x / scale rounded half to even, clamped to +-127. Here values beyond the calibrated range
    occur, so the clamp fires."""
    g = torch.Generator().manual_seed(2)
    x1 = torch.randn(6, 2, 8, generator=g)
    s1 = torch.tensor([0.02, 0.01]).view(1, 2, 1)  # calibrated on smaller values: many clip
    x2 = torch.tensor([130.0, -130.0, 127.4, -127.6, 200.0, -300.0, 0.5, -2.5]).view(1, 1, 8)  # scale 1
    x3 = torch.randn(4, 3, 4, generator=g) * 0.5
    s3 = torch.tensor([1.0, 0.004, 0.1]).view(1, 3, 1)
    cases = [((x, sc), quantize_int8(x, sc)) for x, sc in ((x1, s1), (x2, torch.ones(1, 1, 1)), (x3, s3))]

    def hint(args, got, expected):
        if not isinstance(got, torch.Tensor) or got.shape != expected.shape:
            return None
        if got.dtype != torch.int8:
            return f"q must be torch.int8, got {got.dtype}"
        outside = (args[0].float() / args[1]).abs() > 128.5  # beyond anything a clamp could give
        if ((got[outside].int() - expected[outside].int()).abs() > 1).any():
            return "values beyond the calibrated range wrapped around: int8 does not saturate, clamp before .to(torch.int8)"
        if (got == -128).any():
            return "-128 appears: clamp to -127..127, a symmetric grid (notebook text, section 2)"
        return None

    return _run("quantize_static", fn, cases, same=_tensor_same, hint=hint, reveal=False)


def pack_int4(fn: Callable) -> bool:
    """``fn(q) -> packed``: q uint8 values 0..15, last dim even; two per byte, the even index in the low nibble."""
    g = torch.Generator().manual_seed(1)
    cases = [((q,), ref_pack_int4(q)) for q in (torch.tensor([[1, 2]], dtype=torch.uint8),
                                       torch.tensor([[15, 0, 0, 15]], dtype=torch.uint8),
                                       torch.randint(0, 16, (3, 4, 8), generator=g, dtype=torch.uint8))]
    return _run("pack_int4", fn, cases, same=_tensor_same)


# ---- notebook 04 -------------------------------------------------------------------------------

def admission_rule(fn: Callable[[int, int, int, int, int, int], "str | None"]) -> bool:
    """``fn(num_running, max_num_seqs, budget_left, blocks_needed, blocks_free, watermark_blocks)`` ->
    the reason the head of the queue waits ("token budget", "seq limit", "no blocks"), or None to admit.

    Checked on single decisions first (shown with argument names), then plugged into a real
    scheduler: the trace of a whole dry run (kvlab.engine.dry_run) must equal the one kvlab's own
    rule produces.
    """
    if not callable(fn):
        raise TypeError(f"admission_rule: pass your function itself, got {type(fn).__name__}")
    names = ("num_running", "max_num_seqs", "budget_left", "blocks_needed", "blocks_free", "watermark_blocks")
    cases = [(0, 4, 16, 3, 10, 1), (4, 4, 16, 1, 10, 1), (2, 4, 0, 1, 10, 1), (2, 4, 5, 9, 10, 1),
             (2, 4, 5, 10, 10, 1), (0, 4, 5, 10, 10, 1), (3, 4, -1, 1, 1, 0), (1, 1, 8, 0, 0, 0), (1, 8, 8, 2, 2, 0),
             (4, 4, 0, 20, 10, 1), (4, 4, 5, 20, 10, 1), (3, 4, 0, 20, 10, 1)]  # the last three: several reasons hold
    for args in cases:
        call = ", ".join(f"{n}={v}" for n, v in zip(names, args))
        try:
            got = fn(*args)
        except NotImplementedError:
            print(f"[todo] admission_rule: not written yet - for ({call}) the answer is {ref_admission_rule(*args)!r}")
            return False
        except Exception as e:  # noqa: BLE001 - the learner's bug, shown rather than raised
            print(f"[fail] admission_rule({call}) raised {type(e).__name__}: {e}")
            return False
        if got != ref_admission_rule(*args):
            print(f"[fail] admission_rule({call}): yours {got!r}, expected {ref_admission_rule(*args)!r}")
            return False
    workload = [(9, 3), (30, 6, 1), (5, 12), (14, 2, 3), (3, 9, 3), (22, 4, 6), (6, 6, 6), (11, 5, 9)]
    kw = dict(num_blocks=11, block_size=4, max_num_seqs=3, max_num_batched_tokens=12, watermark=0.1)  # every kind of event
    expected = [(e.step, e.seq_id, e.action, e.reason) for e in dry_run(workload, **kw)[0].trace]
    try:
        got = [(e.step, e.seq_id, e.action, e.reason) for e in dry_run(workload, rule=fn, **kw)[0].trace]
    except Exception as e:  # noqa: BLE001 - a rule that deadlocks or breaks the pool
        print(f"[fail] admission_rule: the scheduler with your rule failed: {type(e).__name__}: {e}")
        return False
    if got != expected:
        i = next((i for i, (a, b) in enumerate(zip(got, expected)) if a != b), min(len(got), len(expected)))
        print(f"[fail] admission_rule: single decisions match, but the traces differ at event {i}: "
              f"yours {got[i] if i < len(got) else 'nothing'}, expected {expected[i] if i < len(expected) else 'nothing'}")
        return False
    print(f"[ok] admission_rule: {len(cases)} decisions and a {len(expected)}-event scheduler trace match")
    _record("admission_rule", fn)
    return True


# ---- notebook 05 -------------------------------------------------------------------------------

def _softmax_cases():
    """(s, v, v_scale, tile): scores with masked (-inf) tails, a later tile with a larger max (the old
    state must shrink), and scores near 100 (exp without subtracting the max overflows fp32)."""
    g = torch.Generator().manual_seed(5)
    cases = []
    for n, tile, big in ((64, 32, 1.0), (96, 32, 30.0), (128, 64, 100.0)):
        s = torch.randn(16, n, generator=g) * big
        s[:, n // 2:] += big  # the second half holds larger scores: later tiles raise the running max
        s[3, -5:] = float("-inf")  # positions past a context's end
        v = torch.randn(n, 32, generator=g)
        v_scale = torch.rand(n, generator=g) + 0.5
        cases.append((s, v, v_scale, tile))
    return cases


def online_softmax_update(fn) -> bool:
    """``fn`` a ``@triton.jit`` function ``(m, l, acc, s, v, v_scale) -> (m, l, acc)``: fold one tile of
    scores s (G, N) and values v (N, D), each value row scaled by v_scale (N,), into the running max m
    (G,), running sum l (G,) and running output acc (G, D). Run by the decode kernel's loop under the
    interpreter; compared with softmax(s) @ (v * v_scale) over all tiles."""
    if not callable(fn):  # checked here: the wrapper below is always callable
        raise TypeError(f"online_softmax_update: pass your function itself, got {type(fn).__name__}")
    cases = []
    for s, v, v_scale, tile in _softmax_cases():
        expected = torch.softmax(s, dim=-1) @ (v * v_scale[:, None])
        cases.append(((s, v, v_scale, tile), expected))

    def call(s, v, v_scale, tile):
        try:
            return kernels.decode.run_online_softmax(fn, s, v, v_scale, tile)  # decode loads triton on first use
        except Exception as e:  # the interpreter wraps what the function raised
            if "NotImplementedError" in repr(e) + repr(e.__cause__):
                raise NotImplementedError from e
            raise

    def close(a, b):
        return isinstance(a, torch.Tensor) and a.shape == b.shape and bool(torch.allclose(a, b, rtol=1e-4, atol=1e-5))

    return _run("online_softmax_update (whole run over all tiles: s, v, v_scale, tile -> softmax(s) @ (v * v_scale))",
                call, cases, same=close, exercise="online_softmax_update", learner=fn)


# ---- progress across notebooks -----------------------------------------------------------------

# checker -> (notebook, task, what the exercise is about); the order of the workshop
EXERCISES = {
    "kv_bytes_per_token": ("00_memory_wall", "Task 1", "bytes one token adds to a model's KV cache"),
    "mla_bytes_per_token": ("00_memory_wall", "Task 2", "what DeepSeek's MLA caches per token"),
    "token_forwards": ("01_naive_cache", "Task 1", "work with and without a cache"),
    "static_utilization": ("01_naive_cache", "Task 2", "what a static cache really uses"),
    "tokens_stored": ("01_naive_cache", "Task 3", "the tokens each row of a padded batch stores"),
    "slot_mapping": ("02_paged_blocks", "Task 1", "block table -> slots"),
    "blocks_after_fork": ("02_paged_blocks", "Task 2", "blocks held by forked samples (copy-on-write)"),
    "quantize_per_head": ("03_int8_quantization", "Task 1", "INT8 per-head quantizer"),
    "quantize_static": ("03_int8_quantization", "Task 2", "INT8 with calibrated static scales: the clamp fires"),
    "pack_int4": ("03_int8_quantization", "Task 3", "two 4-bit values per byte"),
    "admission_rule": ("04_continuous_batching", "Task 1", "the scheduler's admission rule"),
    "online_softmax_update": ("05_fused_triton_kernel", "Task 1", "online softmax in a Triton kernel"),
}


def progress_file():
    """Where passed exercises are kept: ``$KVLAB_PROGRESS``, else ``progress.json`` in the kvlab cache
    folder (``$KVLAB_CACHE`` or ``~/.cache/kvlab``)."""
    return Path(os.environ.get("KVLAB_PROGRESS") or cache_dir() / "progress.json")


def _load_progress() -> dict:
    path = progress_file()
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as e:  # unreadable or damaged: progress is a convenience, start over
        warn(f"progress file {str(path)!r} is unreadable ({type(e).__name__}); starting a new one")
        return {}
    return data if isinstance(data, dict) else {}


def _is_learners(fn) -> bool:
    """A learner's own function, not kvlab's reference (the notebooks check those too, in CI)."""
    f = getattr(fn, "fn", fn)  # a @triton.jit function wraps the Python one
    module = getattr(f, "__module__", None) or ""
    return not module.startswith("kvlab") and getattr(f, "__name__", "") != "<lambda>"


def _record(exercise: str, fn) -> None:
    if exercise not in EXERCISES or not _is_learners(fn):
        return
    data = _load_progress()
    data[exercise] = {"passed": datetime.datetime.now().isoformat(timespec="minutes"),
                      "function": getattr(getattr(fn, "fn", fn), "__name__", "?")}
    try:
        write_atomic(progress_file(), json.dumps(data, indent=1), "progress file")  # never a half-written file
    except ValueError as e:  # a read-only home must not break an exercise that passed
        print(f"(progress not saved: {e})")


def progress(reset: bool = False) -> dict:
    """Print which exercises across notebooks 00-05 you have passed (with your own function), and
    return ``{exercise: date or None}``. ``reset=True`` forgets them all first."""
    path = progress_file()
    if reset:
        try:
            path.unlink()
        except FileNotFoundError:
            pass
    data = _load_progress()
    done = {name: data[name].get("passed") if isinstance(data.get(name), dict) else None for name in EXERCISES}
    print(f"exercises passed: {sum(v is not None for v in done.values())} of {len(EXERCISES)}  ({path})")
    for name, (notebook, task, what) in EXERCISES.items():
        mark = f"[x] {done[name]}" if done[name] else "[ ] not yet"
        print(f"  {notebook[:2]} {task:<7} {name:<22} {what:<42} {mark}")
    return done
