"""Where an engine step's milliseconds go (``kvlab bench engine --profile``, notebook 04).

Each operator's own time under ``torch.profiler`` goes to one part (GEMMs, norms, attention ...); packing,
scheduling and sampling come from the engine's step clock. The profiler slows every operator: the
shares, not the absolute times, are the finding.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn

from kvlab.attention import AttentionBackend
from kvlab.engine import LLM, SamplingParams

PARTS = ("model GEMMs", "norms", "other model ops", "attention: write", "attention: gather/copy",
         "attention: compute", "packing", "scheduling", "sampling")
#: the model's own math; the rest is what the engine adds around it
MODEL_MATH = ("model GEMMs", "norms")
_COPY_OPS = {"aten::index_select", "aten::index", "aten::cat", "aten::copy_", "aten::clone", "aten::contiguous",
             "aten::stack", "aten::_to_copy", "aten::to", "aten::gather", "aten::take"}
_GEMM_OPS = {"mkldnn::_linear_pointwise", "aten::linear"}
_MARK = "kvlab::"
_RANGE_PARTS = {_MARK + "norm": "norms", _MARK + "write": "attention: write"}  # a range of ours -> its part


class _Profiled(AttentionBackend):
    """Another backend's write / decode / prefill, each inside a profiler range (only while profiling)."""

    def __init__(self, base: AttentionBackend):
        self.base, self.name, self.batched_decode = base, base.name, base.batched_decode

    def check(self, pool):
        self.base.check(pool)

    def write(self, *a, **kw):
        with torch.profiler.record_function(_MARK + "write"):
            return self.base.write(*a, **kw)

    def decode(self, *a, **kw):
        with torch.profiler.record_function(_MARK + "attention"):
            return self.base.decode(*a, **kw)

    def prefill(self, *a, **kw):
        with torch.profiler.record_function(_MARK + "attention"):
            return self.base.prefill(*a, **kw)


def _is_norm(module: nn.Module) -> bool:
    name = type(module).__name__
    return name.endswith("RMSNorm") or isinstance(module, nn.LayerNorm)


@contextmanager
def _norm_ranges(model):
    """Profiler ranges around every norm module's forward (hooks, removed afterwards)."""
    handles, open_ = [], {}
    def enter(module, args):
        open_[id(module)] = torch.ops.profiler._record_function_enter_new(_MARK + "norm", None)
    def leave(module, args, out):
        torch.ops.profiler._record_function_exit._RecordFunction(open_.pop(id(module)))
    for m in model.modules():
        if _is_norm(m):
            handles += [m.register_forward_pre_hook(enter), m.register_forward_hook(leave)]
    try:
        yield
    finally:
        for h in handles:
            h.remove()


def _part(evt) -> str | None:
    """The part an operator's own time belongs to, from it and its enclosing ranges; None outside the forward."""
    names, e = [], evt
    while e is not None:
        names.append(e.name)
        e = e.cpu_parent
    if not any(n == _MARK + "forward" for n in names):
        return None
    for n in names:  # innermost first
        if n in _GEMM_OPS:
            return "model GEMMs"
        if n in _RANGE_PARTS:
            return _RANGE_PARTS[n]
        if n == _MARK + "attention":
            return "attention: gather/copy" if evt.name in _COPY_OPS else "attention: compute"
    return "other model ops"


def profile_steps(llm, steps: int = 40, skip: int = 10) -> dict:
    """Profile ``steps`` steps after ``skip``: ms per step and share per part; ``engine_share`` is everything
    but the unmodified model (attention, packing, scheduling, sampling)."""
    for _ in range(skip):
        if not llm.has_unfinished():
            break
        llm.step()
    runner = llm.runner
    base, forward = runner.backend, runner.model.forward
    first = len(llm.step_stats)
    op_time = {p: 0.0 for p in PARTS}
    runner.backend = _Profiled(base)
    def marked_forward(*a, **kw):
        with torch.profiler.record_function(_MARK + "forward"):
            return forward(*a, **kw)
    runner.model.forward = marked_forward
    try:
        with _norm_ranges(runner.model), torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
            for _ in range(steps):
                if not llm.has_unfinished():
                    break
                llm.step()
    finally:
        runner.backend = base
        runner.model.__dict__.pop("forward", None)
    for evt in prof.events():
        part = _part(evt)
        if part is not None:
            op_time[part] += evt.self_cpu_time_total
    stats = llm.step_stats[first:]
    n = len(stats)
    if not n:
        raise ValueError("no step ran: queue requests before profiling")
    forward_ms = 1e3 * sum(s.forward_s for s in stats) / n
    ops = sum(op_time.values()) or 1.0
    ms = {p: forward_ms * op_time[p] / ops for p in PARTS}
    for part, clock in (("packing", "packing_s"), ("scheduling", "schedule_s"), ("sampling", "sample_s")):
        ms[part] = 1e3 * sum(getattr(s, clock) for s in stats) / n
    total = sum(ms.values())
    share = {p: ms[p] / total for p in PARTS}
    return {"steps": n, "step_ms": total, "ms_per_step": ms, "share": share,
            "outside_model_math_share": 1 - sum(share[p] for p in MODEL_MATH),
            "engine_share": sum(share[p] for p in PARTS if p.startswith("attention") or p in
                                ("packing", "scheduling", "sampling")),
            "decodes_per_step": sum(s.decode_tokens for s in stats) / n,
            "prefill_tokens_per_step": sum(s.prefill_tokens for s in stats) / n}


def profile_engine(model, tokenizer, wl, max_num_seqs: int = 16, steps: int = 40, skip: int | None = None,
                   **engine_kw) -> dict:
    """Profile a fresh continuous engine on ``wl``, after ``skip`` steps (default: until the seats fill)."""
    # the engine's sizing rule of run_kvlab: room for the max_num_seqs longest requests at once
    bs = engine_kw.pop("block_size", 16)
    need = sorted((-(-(len(p) + o) // bs) for p, o in zip(wl.prompts, wl.output_lens)), reverse=True)
    budget = max(engine_kw.pop("max_num_batched_tokens", None) or 512, max_num_seqs)
    llm = LLM(model, tokenizer, num_blocks=sum(need[:max_num_seqs]), block_size=bs, max_num_seqs=max_num_seqs,
              max_num_batched_tokens=budget, **engine_kw)
    for p, o in zip(wl.prompts, wl.output_lens):
        llm.add_request(p, SamplingParams(max_tokens=o, ignore_eos=True))
    if skip is None:
        skip = -(-sum(map(len, wl.prompts[:max_num_seqs])) // budget) + 2
    return profile_steps(llm, steps, skip)


def format_profile(p: dict) -> list[str]:
    lines = [f"where a step's {p['step_ms']:.1f} ms go ({p['steps']} steps, {p['decodes_per_step']:.1f} decodes and "
             f"{p['prefill_tokens_per_step']:.1f} prefill tokens a step on average; torch.profiler):"]
    for part in PARTS:
        lines.append(f"  {part:<24}{p['ms_per_step'][part]:>8.2f} ms {p['share'][part]:>7.1%}")
    lines.append(f"  outside the model's GEMMs and norms: {p['outside_model_math_share']:.1%}; kvlab's part (attention, "
                 f"packing, scheduling, sampling): {p['engine_share']:.1%}")
    return lines
