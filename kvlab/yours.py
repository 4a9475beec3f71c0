"""Your engine (notebook 06): ``kvlab.engine.LLM`` assembled from the parts you wrote and passed, as kept by
``kvlab.check`` (``check.mine()``), with kvlab's own wherever you did not; served beside kvlab's engine on the
same workload and held to its tokens, request by request.

A part that passed its checker can still change what the engine does (a boundary the checker never tried):
then :meth:`YourEngine.compare` names the first request and step whose tokens differ and which of your parts
ran in that step. A part that raises stops your engine's run with one line saying where, never a traceback.
"""

from __future__ import annotations

import io
import itertools
import json
import os
import sys
import tempfile
from collections.abc import Iterator, Mapping
from contextlib import redirect_stdout
from pathlib import Path

import torch

from kvlab import capstone, check, kernels
from kvlab.bench.engine import make_workload
from kvlab.calibrate import default_calibration
from kvlab.attention.backends import SkeletonBackend
from kvlab.cache.paged import BlockManager
from kvlab.cache.quantized import QuantizedPagedKVCache
from kvlab.check.kept import ENGINE_TASKS, SIGNATURES, kept_names, part, unrecorded
from kvlab.check.progress import EXERCISES
from kvlab.check.solutions import reference
from kvlab.engine import LLM, SamplingParams
from kvlab.env import limit_memory
from kvlab.models import load_model
from kvlab.quant import named_config

#: the engine's parts a participant writes (notebooks 02-04), each with the place it runs
ENGINE_PARTS = dict(zip(ENGINE_TASKS, (
    "block manager: the pool slot of every new token",
    "block manager: room for each decode's token",
    "block manager: the system prompt's cached blocks",
    "INT8 pool: the codes of every K/V write",
    "scheduler: who is admitted, who waits",
    "scheduler: decodes first, preempting from the tail",
    "scheduler: each step's prefill chunks",
)))
#: notebook 05's parts: the skeleton decode kernel runs them (interpreted on a CPU: a few requests only)
KERNEL_PARTS = {
    "block_walk": "decode kernel: the block table's walk",
    "online_softmax_update": "decode kernel: the online softmax",
    "dequant_int8": "decode kernel: INT8 codes back to values",
}
_HOOKS = {"slot_mapping": "slot_mapping", "append_slot": "append", "prefix_hits": "prefix_match"}  # BlockManager's names


def kept_kernel_parts() -> list[str]:
    """Notebook 05's parts you have kept (the skeleton kernel runs them in your engine)."""
    return sorted(set(KERNEL_PARTS) & kept_names())


def _quiet(ref, *args):
    """kvlab's answer as ``(value,)``, or None where kvlab's own refuses the input (then nothing is compared)."""
    try:
        return (ref(*args),)
    except Exception:  # noqa: BLE001 - only a comparison is lost
        return None


def _plain(x):
    """Lists of Python values: a tuple, a tensor, a numpy array compare as the list they hold."""
    if hasattr(x, "tolist") and not isinstance(x, (list, tuple)):
        return x.tolist()
    if isinstance(x, (list, tuple)):
        return [_plain(v) for v in x]
    return x


def _same(a, b) -> bool:
    """Your part's answer and kvlab's: tensors exactly (dtype too), anything else as plain lists of values."""
    try:
        if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
            return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        return bool(_plain(a) == _plain(b))
    except Exception:  # noqa: BLE001 - values that do not compare are not the same
        return False


def _short(x, width: int = 90) -> str:
    """A call's value in a few words: a tensor by its shape, a long list by its ends."""
    if isinstance(x, torch.Tensor):
        return f"tensor{tuple(x.shape)}"
    if isinstance(x, Mapping):
        return f"{{{len(x)} cached blocks}}"
    if callable(x):
        return getattr(x, "__name__", "a function")
    if isinstance(x, (list, tuple)) and len(x) > 12 and not any(isinstance(v, (list, tuple)) for v in x):
        return f"[{', '.join(map(str, x[:4]))}, ... {len(x) - 8} more ..., {', '.join(map(str, x[-4:]))}]"
    if isinstance(x, tuple):
        return ", ".join(_short(v, width) for v in x) if len(x) != 1 else _short(x[0], width)
    if isinstance(x, list):
        return "[" + ", ".join(_short(v, width) for v in x) + "]"
    text = repr(x)
    return text if len(text) <= width else text[:width - 3] + "..."


def _named(name: str, args) -> str:
    return ", ".join(f"{n}={_short(a)}" for n, a in zip(SIGNATURES[name], args))


def recheck(name: str, fn) -> str | None:
    """Your kept ``fn`` against today's checker of its task, quietly (nothing recorded or kept again): None
    when it passes, else the checker's reason. A checker gains a case when a part that passed it was found
    changing the engine, so a part kept before may fail it now."""
    said = io.StringIO()
    try:
        with redirect_stdout(said), unrecorded():
            ok = getattr(check, name)(fn)
    except Exception as e:  # noqa: BLE001 - a checker that cannot run it says nothing against it
        return f"its checker could not run it ({type(e).__name__})"
    lines = said.getvalue().strip().splitlines()
    return None if ok else (lines[-1].split(": ", 1)[-1] if lines else "it fails")


def _label(name: str) -> str:
    return f"{name} ({EXERCISES[name][0][:2]})"


class YourEngine:
    """``LLM`` on plan ``p`` (:func:`kvlab.capstone.plan`) with your kept parts plugged in, kvlab's for the rest.

    ``kernel=True`` also decodes through the skeleton kernel with your walk, update and dequantization
    (needs triton). ``parts`` says, per part, "yours", "kvlab's" or "refused" (a stale or damaged record,
    refused by name as it is read)."""

    def __init__(self, model, tokenizer, p: capstone.Plan, calibration=None, kernel: bool = False,
                 max_num_batched_tokens: int = 256):
        if not isinstance(p, capstone.Plan) or p.seats is not None:
            raise ValueError(f"p must be a paged plan from kvlab.capstone.plan, got {p!r}")
        if kernel and not kernels.available():
            raise ValueError(f"kernel=True runs the skeleton decode kernel: {kernels.WHY_NO_TRITON}")
        names = list(ENGINE_PARTS) + (list(KERNEL_PARTS) if kernel else [])
        kept, fns, raw = kept_names(), {}, {}
        self.parts = {}
        for name in names:
            fn = part(name) if name in kept else None  # a refused one prints its one line here
            self.parts[name] = "yours" if fn else "refused" if name in kept else "kvlab's"
            if fn is not None:
                raw[name] = fn
                fns[name] = fn if name in KERNEL_PARTS else self._traced(name, fn)
        self.ran: dict[int, set[str]] = {}  # step -> your parts that ran in it
        self.disagreed: dict[str, tuple[int, str]] = {}  # part -> (first step it returned other than kvlab's, what)
        self.failure: tuple[int, str, Exception] | None = None
        self.error: str | None = None
        self.token_steps: list[list[int]] = []  # per request, the step that produced each token
        self._request: dict[int, int] = {}
        bm = BlockManager(p.num_blocks, p.block_size, enable_prefix_caching=p.prefix_caching,
                          **{_HOOKS[n]: fns[n] for n in _HOOKS if n in fns})
        cache = None
        if p.kv_cache_dtype == "int8":
            cache = QuantizedPagedKVCache.from_model(model, p.num_blocks, p.block_size, named_config("int8"),
                                                     calibration, quantize_static=fns.get("quantize_static"))
        elif "quantize_static" in self.parts:
            self.parts["quantize_static"] = "not in this pool"
        backend = p.attn_backend if not kernel else SkeletonBackend(
            *(fns.get(n) or reference(n) for n in KERNEL_PARTS))
        self.llm = LLM(model, tokenizer, block_manager=bm, cache=cache, max_num_seqs=p.max_num_seqs,
                       max_num_batched_tokens=max_num_batched_tokens, attn_backend=backend,
                       kv_cache_dtype=p.kv_cache_dtype, calibration=calibration,
                       **{n: fns[n] for n in ("admission_rule", "schedule_decodes", "chunk_prefills") if n in fns})
        self.plan, self.kernel = p, kernel
        self.mine = [n for n, s in self.parts.items() if s == "yours"]
        self.title = ("your engine (" + ", ".join(self.mine) + " yours; the rest kvlab's)" if self.mine
                      else "your engine is kvlab's")
        if self.mine:
            kv = [_label(n) for n, s in self.parts.items() if s != "yours"]
            print(f"your engine: {len(self.mine)} of {len(self.parts)} parts yours"
                  + (" (notebook 05's three kernel parts included)" if kernel else "")
                  + f": {', '.join(_label(n) for n in self.mine)}; kvlab's: {', '.join(kv) or 'none'}")
        else:
            print(f"your engine is kvlab's: none of its {len(self.parts)} parts is yours yet (a part is kept when it "
                  f"passes its checker; check.mine() lists them)")
        for name in (n for n in self.mine if n in ENGINE_PARTS):  # kept before its checker gained a case?
            why = recheck(name, raw[name])
            if why is not None:
                print(f"your {name} fails today's check.{name}: {why}. It runs below as kept; fix it in notebook "
                      f"{EXERCISES[name][0][:2]} (a pass keeps the new one) or check.forget({name!r})")

    def _traced(self, name: str, fn):
        """``fn`` as the engine calls it: which step ran it, the first step it raised, and (but for
        schedule_decodes, whose calls act on the pool) whether it returns what kvlab's returns on the same input."""
        ref = reference(name) if name != "schedule_decodes" else None

        def run(*args):
            step = self.llm.scheduler.step_count
            self.ran.setdefault(step, set()).add(name)
            shadow = ref is not None and name not in self.disagreed
            if shadow and name == "append_slot":
                return self._shadow_append(step, fn, ref, *args)
            copies = [list(a) if isinstance(a, list) else a for a in args]  # the input, before yours can change it
            want = _quiet(ref, *copies) if shadow else None  # kvlab's, on the same input (None: it refused it)
            got = self._call(step, name, fn, *args)
            if isinstance(got, Iterator):  # a generator: read once, here, and handed on as a list
                got = list(got)
            if shadow and want is not None and not _same(got, want[0]):
                self._disagree(name, step, copies, got, want[0], self._whose(args[0]))
            return got
        run.__name__ = getattr(fn, "__name__", name)
        return run

    def _call(self, step, name, fn, *args):
        """Your part; if it raises, the step and the part are noted, but only where the error is its own (the
        innermost frame in your code), not kvlab's answering something it handed back."""
        try:
            return fn(*args)
        except Exception as e:
            tb = e.__traceback__
            while tb.tb_next is not None:
                tb = tb.tb_next
            if self.failure is None and tb.tb_frame.f_code.co_filename.startswith("<your "):
                self.failure = (step, name, e)
            raise

    def _shadow_append(self, step, fn, ref, table, num_tokens, block_size, ref_count, take_block):
        """kvlab's append on a copy of the table (new blocks as placeholders -1, -2, ...), then yours on the real
        one; the same once the placeholders are read as the blocks yours took, in order."""
        before, placeholders, taken = list(table), [], []
        theirs_table = list(table)
        want = _quiet(ref, theirs_table, num_tokens, block_size, ref_count,
                      lambda: placeholders.append(-1 - len(placeholders)) or placeholders[-1])
        got = self._call(step, "append_slot", fn, table, num_tokens, block_size, ref_count,
                         lambda: taken.append(take_block()) or taken[-1])
        args = (before, num_tokens, block_size)
        if want is None:
            return got
        if len(taken) != len(placeholders):
            self.disagreed["append_slot"] = (step, f"for ({_named('append_slot', args)}): kvlab's takes "
                                                   f"{len(placeholders)} new block(s) here, yours took {len(taken)}")
            return got
        real = dict(zip(placeholders, taken))
        slot, copy = want[0]
        theirs_table = [real.get(b, b) for b in theirs_table]
        want = (theirs_table[-1] * block_size + num_tokens % block_size,
                None if copy is None else (copy[0], real.get(copy[1], copy[1])))
        if not (isinstance(got, (tuple, list)) and _same(got, want) and table == theirs_table):
            self._disagree("append_slot", step, args, (got, table), (want, theirs_table), self._whose(table))
        return got

    def _whose(self, table) -> str:
        """ "request i " when ``table`` is the block table of one of this run's requests (compared by identity)."""
        sid = next((sid for sid, s in self.llm.block_manager.seqs.items() if s.block_table is table), None)
        return f"request {self._request[sid]} " if sid in self._request else ""

    def _disagree(self, name, step, args, got, want, whose: str = "") -> None:
        if isinstance(got, torch.Tensor) and isinstance(want, torch.Tensor) and got.shape == want.shape:
            diff = (got != want).nonzero()
            at = tuple(diff[0].tolist()) if len(diff) else None
            what = (f"{len(diff):,} of {got.numel():,} values differ, first at {at}: yours {got[at].item()}, "
                    f"kvlab's {want[at].item()}" if at is not None else f"yours {got.dtype}, kvlab's {want.dtype}")
        else:
            what = f"yours {_short(got)}, kvlab's {_short(want)}"
        self.disagreed[name] = (step, f"for {whose}({_named(name, args)}): {what}")

    def _print_disagreements(self) -> None:
        for name, (step, what) in sorted(self.disagreed.items(), key=lambda kv: kv[1][0]):
            print(f"your {name} first returned other than kvlab's in step {step}, {what}")

    def serve(self, prompts, output_lens, max_len: int = 512) -> dict | None:
        """:func:`kvlab.capstone.serve` on your engine: the run's measurements (and ``decisions``), or None,
        with ``error`` saying in one line where it stopped, if one of your parts raised or it stalled."""
        llm, limit = self.llm, 20 * (sum(output_lens) + len(prompts)) + 100  # far more steps than any fair run
        reads = capstone.DecodeReads(llm)
        ids = llm.add_requests(prompts, [SamplingParams(max_tokens=o, ignore_eos=True) for o in output_lens])
        self.token_steps = [[] for _ in ids]
        self._request = {sid: i for i, sid in enumerate(ids)}  # engine id -> request, for the lines that name one
        self.ran, self.disagreed, self.failure, self.error = {}, {}, None, None  # this run's only
        previous = llm.on_step

        def on_step(stats):
            if previous is not None:
                previous(stats)
            for steps, i in zip(self.token_steps, ids):
                steps.extend([stats.step] * (len(llm.seqs[i].output_token_ids) - len(steps)))
            if self.kernel and stats.decode_tokens:
                self.ran.setdefault(stats.step, set()).update(n for n in KERNEL_PARTS if n in self.mine)
            if stats.step > limit:
                raise RuntimeError(f"still unfinished after {limit} steps (kvlab's engine needs far fewer)")
        llm.on_step = on_step
        try:
            while llm.has_unfinished():
                llm.step()
        except Exception as e:  # noqa: BLE001 - a part of yours: reported in one line, not a traceback
            step = llm.scheduler.step_count
            if self.failure is not None:
                step, name, e = self.failure
                self.error = f"your {name} raised {type(e).__name__} in step {step}: {e}" + (
                    " (a kept part runs on its own: define what it uses inside it)" * isinstance(e, NameError))
            else:
                self.error = f"your engine stopped in step {step}: {type(e).__name__}: {e}"
            ran = sorted(self.ran.get(step, ()))
            print(f"[stopped] {self.error}" + (f"; your parts in that step: {', '.join(ran)}" if ran else ""))
            self._print_disagreements()
            return None
        finally:
            llm.on_step = previous
        return capstone.measure(llm, ids, reads, self.plan, max_len)

    def compare(self, theirs: dict, yours: dict | None) -> dict:
        """Your run against kvlab's on the same requests: equal answers, the first difference (request, token,
        step, your parts in that step), the scheduler's first different decision, held, steps and time."""
        out = dict(requests=len(theirs["tokens"]), equal=None, first=None, decision=None, disagreed=dict(self.disagreed))
        if yours is theirs:  # nothing of yours: one run was both
            print("your engine is kvlab's, so its run above is kvlab's too; pass a task of notebooks 02-04 and "
                  "run this again to see yours beside it")
            return out
        if yours is None:
            print("your engine: not compared, it stopped (above)")
            return out
        mine, ref = yours["tokens"], theirs["tokens"]
        out["equal"] = sum(a == b for a, b in zip(mine, ref))
        firsts = []
        for i, (a, b) in enumerate(zip(mine, ref)):
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
            if j is not None:
                steps = self.token_steps[i]
                firsts.append((steps[min(j, len(steps) - 1)] if steps else 0, i, j))
        pairs = itertools.zip_longest(yours["decisions"], theirs["decisions"], fillvalue=(None, None, "nothing", ""))
        d = next(((x, y) for x, y in pairs if x != y), None)
        out["decision"] = d
        held = (f"; held at the limit {yours['held_at_limit']:.1f} (kvlab's {theirs['held_at_limit']:.1f})"
                if yours["limit_steps"] or theirs["limit_steps"] else "")  # nothing to say where nothing was turned away
        where = " (yours in Triton's interpreter, kvlab's on PyTorch)" if self.kernel and kernels.triton_mode() == "interpreter" else ""
        print(f"your engine against kvlab's on the same {out['requests']} requests: answers equal {out['equal']}/"
              f"{out['requests']}{held}; {yours['steps']} steps ({theirs['steps']}); "
              f"{yours['wall_s']:.0f} s ({theirs['wall_s']:.0f} s){where}")
        self._print_disagreements()  # the most telling line first: a part of yours, its input, both answers
        if firsts:
            step, i, j = min(firsts)
            ran = sorted(self.ran.get(step, ()))
            out["first"] = dict(request=i, token=j, step=step, parts=ran)
            since = min((s for s, _ in self.disagreed.values()), default=None)
            print(f"the answers first differ at request {i}, token {j} of its answer, step {step}"
                  + (f" ({step - since} steps after that)" if since is not None and since < step else "")
                  + f"; parts of yours that ran in that step: {', '.join(ran) or 'none'}")
        if d is not None:
            (s, i, act, why), (s2, k, act2, why2) = d
            s = s if s is not None else s2
            print(f"the scheduler first decided otherwise in step {s}: yours {act} request {i}{f' ({why})' * bool(why)}, "
                  f"kvlab's {act2} request {k}{f' ({why2})' * bool(why2)}")
        if (firsts or d) and not self.disagreed:
            print("none of your parts returned other than kvlab's on the same input; schedule_decodes and the "
                  "kernel's parts are not compared call by call")
        return out


#: the lines of ours a grade's detail keeps (a participant's part may print too)
_REPORT = ("[refused]", "[stopped]", "your ", "the answers", "the scheduler", "none of your", "the engine could")
#: kvlab grade's engine column serves the capstone's longest requests, all at once: tables past 8 blocks,
#: deferrals and a preemption in notebook 06's INT8 budget, in a few seconds a participant
GRADE_REQUESTS = 16


def grade_engines(kept_by_who: dict, model_name: str = "smollm2-135m") -> dict:
    """``kvlab grade``'s engine column: for each participant, the engine assembled from the parts their
    submissions passed (``{who: {task: kept record}}``, as the grader's workers kept them) against kvlab's on
    notebook 06's plan and its :data:`GRADE_REQUESTS` longest requests. Returns ``{who: {"engine": "yes" |
    "no", "detail": one line}}``: yes when every answer equals kvlab's, token for token."""
    model, tok = load_model(model_name)
    cal = default_calibration(model, tok, model_name, tokens=1024, progress=False)
    wl = make_workload(tok, **capstone.WORKLOAD)
    longest = sorted(range(len(wl.prompts)), key=lambda i: -len(wl.prompts[i]) - wl.output_lens[i])[:GRADE_REQUESTS]
    prompts, outs = [wl.prompts[i] for i in longest], [wl.output_lens[i] for i in longest]
    p = capstone.plan(model, "paged INT8", 4 * 16 * capstone.block_bytes(model, "fp16")[0], 256, calibration=cal)
    theirs = capstone.serve(capstone.make_engine(model, tok, p, cal), prompts, outs, p, 256)
    out, before = {}, os.environ.get("KVLAB_KEPT")
    with tempfile.TemporaryDirectory() as tmp:
        for n, (who, records) in enumerate(kept_by_who.items()):
            path = Path(tmp) / f"kept-{n}.json"
            path.write_text(json.dumps(records))
            os.environ["KVLAB_KEPT"] = str(path)  # theirs, never the grader's own
            lines = io.StringIO()
            try:
                with redirect_stdout(lines):
                    mine = YourEngine(model, tok, p, cal)
                    got = mine.compare(theirs, mine.serve(prompts, outs, 256)) if mine.mine else None
            except Exception as e:  # noqa: BLE001 - one participant's trouble stays in their row
                got, mine = {"equal": None, "first": None}, None
                lines.write(f"the engine could not be built: {type(e).__name__}: {e}")
            finally:
                os.environ.pop("KVLAB_KEPT") if before is None else os.environ.update(KVLAB_KEPT=before)
            said = [line for line in lines.getvalue().splitlines() if line.strip()]
            if got is None:  # every kept record refused: nothing of theirs to run
                out[who] = {"engine": "-", "detail": "; ".join(x for x in said if x.startswith("[refused]"))[:600]}
                continue
            ok = got["equal"] == len(prompts) and got["first"] is None
            head = f"{len(mine.mine)} of {len(mine.parts)} parts theirs" if mine is not None else ""
            said = [x for x in said if x.startswith(_REPORT) and not x.startswith("your engine:")]  # not their prints
            out[who] = {"engine": "yes" if ok else "no", "detail": "; ".join(x for x in [head] + said if x)[:600]}
    return out


def _grade_main(argv) -> int:
    """``python -m kvlab.yours IN OUT``: :func:`grade_engines` in a process of its own (kvlab grade's worker)."""
    src, dst = argv
    job = json.loads(Path(src).read_text())
    if job.get("memory_gb"):
        limit_memory(job["memory_gb"])  # the grader's cap, as its notebook workers have it
    Path(dst).write_text(json.dumps(grade_engines(job["kept"], job.get("model", "smollm2-135m"))))
    return 0


__all__ = ["YourEngine", "ENGINE_PARTS", "KERNEL_PARTS", "kept_kernel_parts", "grade_engines", "GRADE_REQUESTS"]


if __name__ == "__main__":
    sys.exit(_grade_main(sys.argv[1:]))
