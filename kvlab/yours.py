"""Your engine (notebook 06): ``kvlab.engine.LLM`` assembled from the parts you wrote and passed, as kept by
``kvlab.check`` (``check.mine()``), with kvlab's own wherever you did not; served beside kvlab's engine on the
same workload and held to its tokens, request by request.

A part that passed its checker can still change what the engine does (a boundary the checker never tried):
then :meth:`YourEngine.compare` names the first request and step whose tokens differ and which of your parts
ran in that step. A part that raises stops your engine's run with one line saying where, never a traceback.
"""

from __future__ import annotations

from kvlab import capstone, kernels
from kvlab.attention.backends import SkeletonBackend
from kvlab.cache.paged import BlockManager
from kvlab.cache.quantized import QuantizedPagedKVCache
from kvlab.check.kept import kept_names, part
from kvlab.check.progress import EXERCISES
from kvlab.check.solutions import reference
from kvlab.engine import LLM, SamplingParams
from kvlab.quant import named_config

#: the engine's parts a participant writes (notebooks 02-04), each with the place it runs
ENGINE_PARTS = {
    "slot_mapping": "block manager: the pool slot of every new token",
    "append_slot": "block manager: room for each decode's token",
    "prefix_hits": "block manager: the system prompt's cached blocks",
    "quantize_static": "INT8 pool: the codes of every K/V write",
    "admission_rule": "scheduler: who is admitted, who waits",
    "schedule_decodes": "scheduler: decodes first, preempting from the tail",
    "chunk_prefills": "scheduler: each step's prefill chunks",
}
#: notebook 05's parts: the skeleton decode kernel runs them (interpreted on a CPU: a few requests only)
KERNEL_PARTS = {
    "block_walk": "decode kernel: the block table's walk",
    "online_softmax_update": "decode kernel: the online softmax",
    "dequant_int8": "decode kernel: INT8 codes back to values",
}
_HOOKS = {"slot_mapping": "slot_mapping", "append_slot": "append", "prefix_hits": "prefix_match"}  # BlockManager's names


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
        kept, fns = kept_names(), {}
        self.parts = {}
        for name in names:
            fn = part(name) if name in kept else None  # a refused one prints its one line here
            self.parts[name] = "yours" if fn else "refused" if name in kept else "kvlab's"
            if fn is not None:
                fns[name] = fn if name in KERNEL_PARTS else self._traced(name, fn)
        self.ran: dict[int, set[str]] = {}  # step -> your parts that ran in it
        self.failure: tuple[int, str, Exception] | None = None
        self.error: str | None = None
        self.token_steps: list[list[int]] = []  # per request, the step that produced each token
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
            print(f"your engine: {len(self.mine)} of {len(self.parts)} parts yours: "
                  f"{', '.join(_label(n) for n in self.mine)}; kvlab's: {', '.join(kv) or 'none'}")
        else:
            print(f"your engine is kvlab's: none of its {len(self.parts)} parts is yours yet (a part is kept when it "
                  f"passes its checker; check.mine() lists them)")

    def _traced(self, name: str, fn):
        def run(*args, **kwargs):
            step = self.llm.scheduler.step_count
            self.ran.setdefault(step, set()).add(name)
            try:
                return fn(*args, **kwargs)
            except Exception as e:
                if self.failure is None:  # the innermost part that raised (append_slot inside schedule_decodes)
                    self.failure = (step, name, e)
                raise
        run.__name__ = getattr(fn, "__name__", name)
        return run

    def serve(self, prompts, output_lens, max_len: int = 512) -> dict | None:
        """:func:`kvlab.capstone.serve` on your engine: the run's measurements (and ``decisions``), or None,
        with ``error`` saying in one line where it stopped, if one of your parts raised or it stalled."""
        llm, limit = self.llm, 20 * (sum(output_lens) + len(prompts)) + 100  # far more steps than any fair run
        reads = capstone.DecodeReads(llm)
        ids = llm.add_requests(prompts, [SamplingParams(max_tokens=o, ignore_eos=True) for o in output_lens])
        self.token_steps = [[] for _ in ids]
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
            return None
        finally:
            llm.on_step = previous
        return capstone.measure(llm, ids, reads, self.plan, max_len)

    def compare(self, theirs: dict, yours: dict | None) -> dict:
        """Your run against kvlab's on the same requests: equal answers, the first difference (request, token,
        step, your parts in that step), the scheduler's first different decision, held, steps and time."""
        out = dict(requests=len(theirs["tokens"]), equal=None, first=None, decision=None)
        if yours is None:
            print(f"your engine: not compared ({self.error})")
            return out
        mine, ref = yours["tokens"], theirs["tokens"]
        out["equal"] = sum(a == b for a, b in zip(mine, ref))
        firsts = []
        for i, (a, b) in enumerate(zip(mine, ref)):
            j = next((j for j, (x, y) in enumerate(zip(a, b)) if x != y), None if len(a) == len(b) else min(len(a), len(b)))
            if j is not None:
                steps = self.token_steps[i]
                firsts.append((steps[min(j, len(steps) - 1)] if steps else 0, i, j))
        d = next(((x, y) for x, y in zip(yours["decisions"], theirs["decisions"]) if x != y), None)
        out["decision"] = d
        print(f"answers equal to kvlab's, token for token: {out['equal']}/{out['requests']}; held at the limit "
              f"{yours['held_at_limit']:.1f} (kvlab's {theirs['held_at_limit']:.1f}); {yours['steps']} steps "
              f"({theirs['steps']}); {yours['wall_s']:.0f} s ({theirs['wall_s']:.0f} s), "
              f"{yours['output_tok_s']:.0f} tok/s ({theirs['output_tok_s']:.0f})")
        if firsts:
            step, i, j = min(firsts)
            ran = sorted(self.ran.get(step, ()))
            out["first"] = dict(request=i, token=j, step=step, parts=ran)
            print(f"first difference: request {i}, its token {j} (step {step}); your parts in that step: "
                  f"{', '.join(ran) or 'none'} (one of them, or one in an earlier step, wrote what this step read)")
        if d is not None:
            (s, i, act, why), (_, k, act2, why2) = d
            print(f"the scheduler first decided otherwise in step {s}: yours {act} request {i}{f' ({why})' * bool(why)}, "
                  f"kvlab's {act2} request {k}{f' ({why2})' * bool(why2)}; your parts in that step: "
                  f"{', '.join(sorted(self.ran.get(s, ()))) or 'none'}")
        return out


__all__ = ["YourEngine", "ENGINE_PARTS", "KERNEL_PARTS"]
