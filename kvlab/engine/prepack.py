"""Linear weights packed once for oneDNN's small-row GEMM on the CPU (notebook 04: where a step's time goes).

A decode multiplies a few rows by every weight; packed (as vLLM's CPU ``onednn_mm`` does), SmolLM2's
GEMMs run 2-3x faster at 16 rows on 2 cores, for one extra copy of the weights. Siblings that read one
input (q/k/v, gate/up) share one stacked GEMM: seven a layer become four. The model stays unmodified.
"""

from __future__ import annotations

import weakref
from contextlib import contextmanager

import torch
from torch import nn


def prepack_available(model) -> bool:
    """Whether oneDNN can pack: a CPU build with mkldnn and fp32 weights on the CPU."""
    p = next(model.parameters(), None)
    return (p is not None and p.device.type == "cpu" and p.dtype == torch.float32
            and torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight"))


class _Packed:
    __slots__ = ("module", "weight", "version", "packed")

    def __init__(self, module: nn.Linear, batch_hint: int):
        self.module = module
        self.pack(batch_hint)

    def pack(self, batch_hint: int) -> None:
        w = self.module.weight
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(w.detach(), batch_hint)
        self.weight, self.version = w, w._version

    def refresh(self, batch_hint: int) -> None:
        """Pack again if the weight was replaced or changed in place since it was packed."""
        w = self.module.weight
        if w is not self.weight or w._version != self.version:
            self.pack(batch_hint)

    def forward(self, x: torch.Tensor, batch_hint: int) -> torch.Tensor:
        w = self.module.weight
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return nn.functional.linear(x, w, self.module.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.module.bias, "none", [], "")


#: sibling linear layers that read one input, packed and multiplied together (:class:`_Fused`)
FUSED_GROUPS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))


class _Fused:
    """Siblings that read one input, packed as ONE weight: the first call runs the GEMM, and a sibling
    called with the same unchanged tensor gets its slice; any other input reruns it, so stays correct."""

    __slots__ = ("modules", "state", "packed", "bias", "sizes", "x", "x_version", "outs")

    def __init__(self, modules: list[nn.Linear], batch_hint: int):
        self.modules = modules
        self.sizes = [m.out_features for m in modules]
        self.pack(batch_hint)

    def pack(self, batch_hint: int) -> None:
        ms = self.modules
        with torch.no_grad():
            self.packed = torch.ops.mkldnn._reorder_linear_weight(torch.cat([m.weight.detach() for m in ms]), batch_hint)
            self.bias = None if ms[0].bias is None else torch.cat([m.bias.detach() for m in ms])
        self.state = self._state()
        self.forget()

    def _state(self) -> list:
        return [(m.weight, m.weight._version, m.bias, None if m.bias is None else m.bias._version) for m in self.modules]

    def refresh(self, batch_hint: int) -> None:
        """Pack again if a weight or bias was replaced or changed in place since it was packed."""
        if any(a is not b or va != vb or c is not d or vc != vd
               for (a, va, c, vc), (b, vb, d, vd) in zip(self._state(), self.state)):
            self.pack(batch_hint)

    def forget(self) -> None:
        self.x, self.x_version, self.outs = None, None, None

    def forward(self, i: int, x: torch.Tensor, batch_hint: int) -> torch.Tensor:
        m = self.modules[i]
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return nn.functional.linear(x, m.weight, m.bias)
        if self.outs is not None and x is self.x and _version(x) == self.x_version and self.outs[i] is not None:
            out, self.outs[i] = self.outs[i], None  # each sibling takes its slice once
            return out
        y = torch.ops.mkldnn._linear_pointwise(x, self.packed, self.bias, "none", [], "")
        outs = list(y.split(self.sizes, dim=-1))
        out, outs[i] = outs[i], None
        self.x, self.x_version, self.outs = x, _version(x), outs
        return out


def _version(x: torch.Tensor) -> int | None:
    """In-place changes seen so far (None for an inference-mode tensor, which keeps no count)."""
    return None if x.is_inference() else x._version


def _fused_groups(model) -> list[list[nn.Linear]]:
    """:data:`FUSED_GROUPS` of plain ``nn.Linear`` with one input width and bias on all or none."""
    groups = []
    for parent in model.modules():
        for names in FUSED_GROUPS:
            ms = [getattr(parent, n, None) for n in names]
            if not all(isinstance(m, nn.Linear) and "forward" not in m.__dict__ for m in ms):
                continue
            if len({m.in_features for m in ms}) == 1 and len({m.bias is None for m in ms}) == 1:
                groups.append(ms)
    return groups


class PrepackedLinears:
    """Every ``nn.Linear`` of ``model`` packed; ``batch_hint`` tunes the layout, any row count works.
    A module that carries its own ``forward`` (a hook library's) is left alone."""

    def __init__(self, model, batch_hint: int = 16):
        self.batch_hint = max(1, int(batch_hint))
        self.entries: list[_Packed] = []
        self.fused: list[_Fused] = []
        if model is not None and prepack_available(model):
            self.fused = [_Fused(ms, self.batch_hint) for ms in _fused_groups(model)]
            in_group = {id(m) for f in self.fused for m in f.modules}
            self.entries = [_Packed(m, self.batch_hint) for m in model.modules()
                            if isinstance(m, nn.Linear) and "forward" not in m.__dict__ and id(m) not in in_group]

    @classmethod
    def shared(cls, model) -> "PrepackedLinears":
        """The one packing of ``model``'s weights that the engines on it share: a notebook keeps a dozen
        engines on one model, and each packing would be another copy of the weights (513 MiB for SmolLM2).
        One layout serves every batch: packed for 16 rows, SmolLM2's decode steps at 1, 4 and 16 rows ran
        as fast as (or faster than) packed for their own row count (2 cores). It lives while an engine
        holds it (packing again takes a fraction of a second); a weight changed since is packed again on
        the next forward (:meth:`active`)."""
        ref = _SHARED.get(model)
        packed = ref() if ref is not None else None
        if packed is None:
            packed = cls(model, SHARED_BATCH_HINT)
            _SHARED[model] = weakref.ref(packed)
        return packed

    @classmethod
    def empty(cls) -> "PrepackedLinears":
        """Nothing packed: :meth:`active` does nothing."""
        return cls(None)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed copies (the extra memory this costs)."""
        return sum(e.packed.numel() * e.packed.element_size() for e in [*self.entries, *self.fused])

    @property
    def modules(self) -> list[nn.Linear]:
        return [e.module for e in self.entries] + [m for f in self.fused for m in f.modules]

    def __len__(self) -> int:
        """Linear layers packed (alone or in a fused group)."""
        return len(self.entries) + sum(len(f.modules) for f in self.fused)

    @contextmanager
    def active(self):
        """Points each packed module's ``forward`` at its packed weight for one forward, then restores it."""
        hint = self.batch_hint
        for e in [*self.entries, *self.fused]:  # weights do not change inside a forward: checked once here
            e.refresh(hint)
        for e in self.entries:
            e.module.forward = lambda x, e=e: e.forward(x, hint)
        for f in self.fused:
            for i, m in enumerate(f.modules):
                m.forward = lambda x, f=f, i=i: f.forward(i, x, hint)
        try:
            yield
        finally:
            for m in self.modules:
                m.__dict__.pop("forward", None)
            for f in self.fused:
                f.forget()  # no activation kept past the forward


#: the row count the shared packing is laid out for (:meth:`PrepackedLinears.shared`)
SHARED_BATCH_HINT = 16
#: model -> its shared packing, held by the engines that use it (a weak reference here); an entry goes with its model
_SHARED: "weakref.WeakKeyDictionary[nn.Module, weakref.ref[PrepackedLinears]]" = weakref.WeakKeyDictionary()
