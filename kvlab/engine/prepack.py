"""Prepacked weights for the model's linear layers on the CPU (notebook 04: where a step's time goes).

A decode step multiplies a few rows (one per running sequence) by every weight matrix of the model.
``F.linear`` hands that to a general GEMM that re-reads the weight in its stored row-major layout on
every call; oneDNN can reorder a weight ONCE into the blocked layout its small-row kernels read
(``torch.ops.mkldnn._reorder_linear_weight``), and then multiply straight from it
(``torch.ops.mkldnn._linear_pointwise``). vLLM's CPU build does the same (its ``onednn_mm``). At
SmolLM2's shapes on 2 cores this makes the model's GEMMs 2-3x faster at 16 rows, for one extra copy of
the weights (the packed one).

The model stays unmodified: :meth:`PrepackedLinears.active` points each ``nn.Linear``'s ``forward``
at its packed weight for the duration of one engine forward and restores it afterwards, so the same
model object keeps serving HF ``generate()`` as before. A weight changed in place after packing
(its tensor ``_version`` moves) or replaced is packed again at its next call.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
from torch import nn


def prepack_available(model) -> bool:
    """True where oneDNN can pack this model's weights: a CPU build with mkldnn and fp32 weights on the CPU."""
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

    def forward(self, x: torch.Tensor, batch_hint: int) -> torch.Tensor:
        w = self.module.weight
        if w is not self.weight or w._version != self.version:  # changed since it was packed
            self.pack(batch_hint)
        if x.dtype != torch.float32 or x.device.type != "cpu":
            return nn.functional.linear(x, w, self.module.bias)
        return torch.ops.mkldnn._linear_pointwise(x, self.packed, self.module.bias, "none", [], "")


class PrepackedLinears:
    """Every ``nn.Linear`` of ``model`` with its weight packed for oneDNN's small-row GEMM.

    ``batch_hint``: the row count the layout is tuned for (the engine's ``max_num_seqs``); any row
    count works. Where :func:`prepack_available` is False this holds nothing and :meth:`active` does
    nothing. A module that already carries its own ``forward`` (a hook library's) is left alone."""

    def __init__(self, model, batch_hint: int = 16):
        self.batch_hint = max(1, int(batch_hint))
        self.entries: list[_Packed] = []
        if model is not None and prepack_available(model):
            self.entries = [_Packed(m, self.batch_hint) for m in model.modules()
                            if isinstance(m, nn.Linear) and "forward" not in m.__dict__]

    @classmethod
    def empty(cls) -> "PrepackedLinears":
        """Nothing packed: :meth:`active` does nothing."""
        return cls(None)

    @property
    def nbytes(self) -> int:
        """Bytes of the packed copies (the extra memory this costs)."""
        return sum(e.packed.numel() * e.packed.element_size() for e in self.entries)

    def __len__(self) -> int:
        return len(self.entries)

    @contextmanager
    def active(self):
        """Within: each packed module's forward multiplies by its packed weight; after: as it was."""
        hint = self.batch_hint
        for e in self.entries:
            e.module.forward = lambda x, e=e: e.forward(x, hint)
        try:
            yield
        finally:
            for e in self.entries:
                e.module.__dict__.pop("forward", None)
