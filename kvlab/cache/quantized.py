"""A paged KV cache of INT8 / INT4 / FP8 (or float) blocks with SEPARATE scales (notebook 03).

The pool interface of :class:`~kvlab.cache.PagedKVCache`. Pages: int8/fp8 ``[N, bs, H, D]``, int4
``[N, bs, H, D/2]``; static scales ``[1,1,1]``, ``[1,H,1]`` or ``[1,H,D]`` per layer, per-token
scales in their own ``[N, bs, H or 1, 1]`` pages. Writes count saturation per layer x head.
"""

from __future__ import annotations

import torch

from kvlab.cache.paged import check_block_size
from kvlab.kernels.pool import INT8, KERNEL_KINDS, PER_SLOT, STATIC, Operand, check_kernel_format, scale_code
from kvlab.quant import core
from kvlab.quant.calibration import Calibration
from kvlab.quant.config import CORRECTION_FACTOR, KVQuantConfig, TensorFormat
from kvlab.quant.rotation import rotate
from kvlab.sizing import kv_config

COUNTERS = ("values", "clipped", "at_qmax", "corrections")


class _Store:
    """Data + scales for K or V of one layer, laid out as its :mod:`kvlab.formats` entry says."""

    def __init__(self, fmt: TensorFormat, num_blocks: int, block_size: int, h: int, d: int, device,
                 static_scale: torch.Tensor | None, hooks: dict | None = None):
        self.fmt, self.h, self.d = fmt, h, d
        self.hooks = hooks or {}  # notebook 03's tasks: quantize_per_head, quantize_static, pack_int4
        self.element = el = fmt.element
        shape = (num_blocks, block_size, h, d)
        self.scale = None  # static scale (broadcasts over (T, H, D)) or None
        self.token_scale = self.token_zero = None  # per-slot scales, own pages
        if el.kind == "float":
            self.data = torch.zeros(shape, dtype=el.storage, device=device)
        elif el.kind == "packed":
            if d % fmt.group_size:
                raise ValueError(f"{fmt.dtype} group_size {fmt.group_size} must divide head_dim {d}")
            self.data = torch.zeros((num_blocks, block_size, h, d // el.codes_per_storage_element), dtype=el.storage,
                                    device=device)
            gshape = (num_blocks, block_size, h, d // fmt.group_size, 1)
            self.token_scale = torch.ones(gshape, dtype=torch.float32, device=device)
            if not fmt.symmetric:
                self.token_zero = torch.zeros(gshape, dtype=torch.float32, device=device)
        else:  # scaled codes (int8, fp8)
            self.data = torch.zeros(shape, dtype=el.storage, device=device)
            if fmt.static_scales:
                self.scale = None if static_scale is None else static_scale.to(device).float().clone()
            else:
                width = h if fmt.granularity == "per-token-head" else 1
                self.token_scale = torch.ones((num_blocks, block_size, width, 1), dtype=torch.float32, device=device)
        self.counts = {c: torch.zeros(h, dtype=torch.long) for c in COUNTERS}

    @property
    def qmax(self) -> float:
        return self.element.qmax

    def _count(self, x: torch.Tensor, scale: torch.Tensor, q: torch.Tensor) -> None:
        r = (x.float() / scale).abs()  # (T, H, D) in units of one quantization step
        # beyond what rounding would do anyway: half a step past the largest code (int8: 127.5; e4m3:
        # 448 + 16, the step there being 32; the abs-max itself lands at 448.00003 and is not clipped)
        limit = self.element.clip_limit
        self.counts["clipped"] += (r > limit).sum(dim=(0, 2)).cpu()
        self.counts["at_qmax"] += (q.float().abs() >= self.qmax).sum(dim=(0, 2)).cpu()

    def write(self, x: torch.Tensor, slots: torch.Tensor, policy: str) -> None:
        """x: (T, H, D) new values for ``slots``."""
        flat = self.data.view(-1, *self.data.shape[2:])
        if self.fmt.quantized:
            self.counts["values"] += torch.full((self.h,), x.shape[0] * self.d, dtype=torch.long)
        if self.element.kind == "float":
            flat[slots] = x.to(self.data.dtype)
            return
        if self.element.kind == "packed":
            t = core.quantize_int4(x, self.fmt.group_size, self.fmt.symmetric, pack=self.hooks.get("pack_int4", core.pack_int4))
            flat[slots] = t.packed
            self.token_scale.view(-1, *self.token_scale.shape[2:])[slots] = t.scale
            if t.zero is not None:
                self.token_zero.view(-1, *self.token_zero.shape[2:])[slots] = t.zero
            return
        if not self.fmt.static_scales:  # per-token(-head): exact absmax of each token on write
            scale = core.scale_from_absmax(core.absmax(x, self.fmt.granularity), self.qmax)
            q = core.quantize_scaled(x, scale, self.element)
            self.token_scale.view(-1, *self.token_scale.shape[2:])[slots] = scale
        elif self.scale is None and "quantize_per_head" in self.hooks:  # the first write sets the scale for good
            q, scale = self._hooked("quantize_per_head", x)
            self.scale = scale.float()
        else:
            scale = self.settle_scale(x, policy)
            q = (self._hooked("quantize_static", x, scale) if "quantize_static" in self.hooks
                 else core.quantize_scaled(x, scale, self.element))
        self._count(x, scale, q)
        flat[slots] = q

    def _hooked(self, name: str, x: torch.Tensor, *scale):
        """A plugged-in quantizer's result, held to the shapes and dtype the pool stores."""
        out = self.hooks[name](x, *scale)
        q, got_scale = (out if isinstance(out, tuple) and len(out) == 2 else (out, None)) if not scale else (out, scale[0])
        want = (1, self.h, 1)
        if (not isinstance(q, torch.Tensor) or q.dtype != torch.int8 or q.shape != x.shape
                or not isinstance(got_scale, torch.Tensor) or tuple(got_scale.shape) != want):
            found = f"{q.dtype} {tuple(q.shape)}" if isinstance(q, torch.Tensor) else type(q).__name__
            raise ValueError(f"{name} returned {found}" + ("" if scale else f" and scale {getattr(got_scale, 'shape', got_scale)}")
                             + f"; the pool stores torch.int8 codes of shape {tuple(x.shape)}"
                             + ("" if scale else f" and a scale of shape {want}"))
        return q if scale else (q, got_scale)

    def settle_scale(self, x: torch.Tensor, policy: str) -> torch.Tensor:
        """The static scale for ``x`` once the policy saw it (shared with the Triton write): the first
        dynamic write sets it for good; ``corrected`` widens the scales ``x`` exceeds."""
        amax = core.absmax(x, self.fmt.granularity)
        if self.scale is None:
            self.scale = core.scale_from_absmax(amax, self.qmax)
        elif policy == "corrected":
            self._correct(amax)
        return self.scale

    def _correct(self, amax: torch.Tensor) -> None:
        """Widen every scale whose group just saw a value beyond 1.2x its range; re-quantize only
        the stored data under those scales (all slots of that head / channel / tensor)."""
        limit = CORRECTION_FACTOR * self.qmax * self.scale
        grow = amax > limit  # same shape as the scale
        if not grow.any():
            return
        new = torch.where(grow, amax.float() / self.qmax, self.scale)
        n = self.data.shape[0] * self.data.shape[1]
        flat = self.data.view(n, self.h, self.d)
        mask = grow.expand(1, self.h, self.d)[0]  # (H, D): which stored values sit under a widened scale
        old_vals = core.dequantize_scaled(flat[:, mask], self.scale.expand(1, self.h, self.d)[0][mask])
        flat[:, mask] = core.quantize_scaled(old_vals, new.expand(1, self.h, self.d)[0][mask], self.element)
        per_head = grow.expand(1, self.h, self.d)[0].any(dim=1)
        self.counts["corrections"] += per_head.long().cpu()
        self.scale = new

    def read(self, block_ids: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
        """Dequantized values of some blocks: (n_blocks, block_size, H, D) float32; ``out``, a float32 tensor of
        that shape, takes them where the format allows (cast and scaled in place: no tensor allocated per read)."""
        block_ids = torch.as_tensor(block_ids, dtype=torch.long, device=self.data.device).flatten()
        data = self.data.index_select(0, block_ids)  # = self.data[block_ids], faster on the CPU
        if self.element.kind == "float":
            return data.float() if out is None else out.copy_(data)
        if self.element.kind == "packed":
            t = core.Int4Tensor(data, self.token_scale[block_ids],
                                None if self.token_zero is None else self.token_zero[block_ids], self.fmt.group_size)
            return core.dequantize_int4(t)
        scale = self.scale if self.fmt.static_scales else self.token_scale[block_ids]
        return core.dequantize_scaled(data, scale) if out is None else out.copy_(data).mul_(scale)  # = q.float() * scale

    def operand(self, what: str) -> Operand:
        """These pages and scales as one kernel :class:`~kvlab.kernels.pool.Operand` (views, no copy)."""
        fmt, static = self.fmt, None
        check_kernel_format(fmt, what)
        scales = scale_code(fmt)
        if scales == STATIC:
            if self.scale is None:
                raise ValueError(f"{what}: this quantized layer has no scale yet (a dynamic policy sets it on "
                                 "the first write); write to the cache before attending")
            static = self.scale.float().expand(1, self.h, self.d)[0].contiguous()  # (1,1,1)|(1,H,1)|(1,H,D) -> (H, D)
        return Operand(self.data, KERNEL_KINDS[self.element.kind].code, scales, static_scale=static,
                       slot_scale=self.token_scale if scales == PER_SLOT else None,
                       group_size=fmt.group_size if self.element.kind == "packed" else 0, label=fmt.label())

    @property
    def nbytes(self) -> int:
        return self.page_nbytes + self.fixed_nbytes

    @property
    def page_nbytes(self) -> int:
        """Bytes that grow with the blocks: the pages and their per-slot scales (and zero points)."""
        return sum(t.nbytes for t in (self.data, self.token_scale, self.token_zero) if t is not None)

    @property
    def fixed_nbytes(self) -> int:
        """The static scale table (one per head, channel or tensor): the same for any number of blocks."""
        return self.scale.nbytes if self.scale is not None else 0


class QuantizedPagedKVCache:
    """The block pool in quantized formats; pair it with a BlockManager of the same geometry."""

    is_quantized = True

    def __init__(self, num_layers: int, num_blocks: int, block_size: int, num_kv_heads: int, head_dim: int,
                 config: KVQuantConfig, calibration=None, device="cpu", quantize_per_head=None, quantize_static=None,
                 pack_int4=None):
        """The hooks replace kvlab's own (notebook 03 plugs the participant's in): ``quantize_per_head(x) ->
        (q, scale)`` sets a dynamic INT8 per-head pool's scales on its first write, ``quantize_static(x,
        scale) -> q`` quantizes every later write, ``pack_int4(codes) -> bytes`` packs INT4 writes."""
        self.block_size = check_block_size(block_size)
        hooks = {n: f for n, f in (("quantize_per_head", quantize_per_head), ("quantize_static", quantize_static),
                                   ("pack_int4", pack_int4)) if f is not None}
        for n, f in hooks.items():
            if not callable(f):
                raise TypeError(f"{n} must be a function (or None for kvlab's own), got {type(f).__name__}")
        int8_head = [fmt.dtype == "int8" and fmt.granularity == "per-head" for fmt in (config.k, config.v)]
        if ({"quantize_per_head", "quantize_static"} & set(hooks) and not (all(int8_head) and not config.layers)) or (
                "pack_int4" in hooks and "int4" not in (config.k.dtype, config.v.dtype)):
            raise ValueError(f"{sorted(hooks)} plug into INT8 per-head (quantizers) or INT4 (pack_int4) pools; "
                             f"config is {config.label()}")
        self.num_layers, self.num_blocks = num_layers, num_blocks
        self.num_kv_heads, self.head_dim = num_kv_heads, head_dim
        self.config = config
        if config.needs_calibration(num_layers) and calibration is None:
            raise ValueError(f"policy {config.policy!r} with static scales needs a calibration "
                             "(kvlab.calibrate), or use policy='dynamic'")
        if calibration is not None:
            if not isinstance(calibration, Calibration):
                raise TypeError(f"calibration must be a kvlab Calibration (kvlab.calibrate), got "
                                f"{type(calibration).__name__}")
            if config.policy != "dynamic":
                calibration.check_model(num_layers, num_kv_heads, head_dim)
        self.k, self.v = [], []
        for layer in range(num_layers):
            kf, vf = config.formats(layer)
            ks = vs = None
            if calibration is not None and config.policy != "dynamic":
                if kf.static_scales:
                    ks = calibration.scales("k_rot" if config.rotate_k else "k", config.stat, kf.granularity,
                                            kf.element.qmax)[layer]
                if vf.static_scales:
                    vs = calibration.scales("v", config.stat, vf.granularity, vf.element.qmax)[layer]
            self.k.append(_Store(kf, num_blocks, block_size, num_kv_heads, head_dim, device, ks, hooks))
            self.v.append(_Store(vf, num_blocks, block_size, num_kv_heads, head_dim, device, vs, hooks))

    @classmethod
    def from_model(cls, model, num_blocks: int, block_size: int, config: KVQuantConfig, calibration=None, **hooks):
        c = kv_config(model)
        return cls(c.num_layers, num_blocks, block_size, c.num_kv_heads, c.head_dim, config, calibration,
                   device=next(model.parameters()).device, **hooks)

    def write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """k, v: (T, H, D) post-RoPE values of new tokens. Rejects NaN/Inf before touching anything."""
        k = self._finite_keys(layer, k, v)
        self.k[layer].write(k, slot_mapping, self.config.policy)
        self.v[layer].write(v, slot_mapping, self.config.policy)

    def _finite_keys(self, layer: int, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """The keys as stored (rotated if ``rotate_k``), after a ValueError if k or v holds NaN/Inf."""
        core.check_finite(k, f"keys (layer {layer})")
        core.check_finite(v, f"values (layer {layer})")
        return rotate(k) if self.config.rotate_k else k

    @property
    def rotate_k(self) -> bool:
        """Keys are stored Hadamard-rotated (queries must be rotated the same way to attend)."""
        return self.config.rotate_k

    def kernel_write(self, layer: int, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor,
                     launch) -> None:
        """:meth:`write` with the scatter and quantization done by ``launch`` (the Triton kernel); scale
        policy, rotation and counters stay here. Slots of -1 are padding. Checked before anything changes."""
        for which, stores in (("K", self.k), ("V", self.v)):
            check_kernel_format(stores[layer].fmt, f"layer {layer}'s {which}")
        k = self._finite_keys(layer, k, v)  # before anything is touched, as write() does
        stores = (self.k[layer], self.v[layer])
        keep = slot_mapping >= 0
        for st, x in zip(stores, (k, v)):
            if st.fmt.static_scales:  # the policy (first write, correction) sees only real tokens
                st.settle_scale(x[keep] if not bool(keep.all()) else x, self.config.policy)
        k_op, v_op = self.kernel_operands(layer)
        stats = launch(k, v, slot_mapping, k_op, v_op)
        n_real = int(keep.sum())
        for st, op, stat in zip(stores, (k_op, v_op), stats or (None, None)):
            if st.fmt.quantized:
                st.counts["values"] += n_real * st.d
            if op.fmt == INT8 and stat is not None:
                per_head = stat.sum(dim=0).cpu().long()  # (H, 2)
                st.counts["clipped"] += per_head[:, 0]
                st.counts["at_qmax"] += per_head[:, 1]

    def formats(self, layer: int) -> tuple[TensorFormat, TensorFormat]:
        return self.config.formats(layer)

    def kernel_operands(self, layer: int) -> tuple[Operand, Operand]:
        """(K, V) of one layer as the kernels read them: views of the pages and scales, nothing copied."""
        return (self.k[layer].operand(f"layer {layer}'s K"), self.v[layer].operand(f"layer {layer}'s V"))

    def copy_blocks(self, blocks_to_copy) -> None:
        for src, dst in blocks_to_copy:
            for st in self.k + self.v:
                for t in (st.data, st.token_scale, st.token_zero):
                    if t is not None:
                        t[dst] = t[src]

    def read(self, layer: int, block_ids: torch.Tensor, out: tuple | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Dequantized K (still rotated if ``rotate_k``) and V of some blocks, (n, bs, H, D) each; ``out``: two
        float32 tensors of that shape to write them into where the format allows (the returned ones hold them)."""
        k_out, v_out = out if out is not None else (None, None)
        return self.k[layer].read(block_ids, k_out), self.v[layer].read(block_ids, v_out)

    def read_k(self, layer: int, block_ids: torch.Tensor) -> torch.Tensor:
        """K alone, as :meth:`read` (what an eviction policy's attention scores read)."""
        return self.k[layer].read(block_ids)

    @property
    def bytes_reserved(self) -> int:
        return sum(s.nbytes for s in self.k + self.v)

    @property
    def fixed_bytes(self) -> int:
        """Static scale tables: part of ``bytes_reserved``, but not of any block."""
        return sum(s.fixed_nbytes for s in self.k + self.v)

    @property
    def bytes_per_block(self) -> int:
        return (self.bytes_reserved - self.fixed_bytes) // self.num_blocks

    def saturation(self) -> dict:
        """Counters as (L, H) tensors for K and V: values written, clipped, at +-qmax, corrections."""
        return {which: {c: torch.stack([s.counts[c] for s in stores]) for c in COUNTERS}
                for which, stores in (("k", self.k), ("v", self.v))}

    def counters_snapshot(self) -> list[dict]:
        """The write counters, to put back if a step is cut short (:meth:`restore_counters`)."""
        return [{c: s.counts[c].clone() for c in COUNTERS} for s in self.k + self.v]

    def restore_counters(self, snapshot: list[dict]) -> None:
        """After an aborted step, count only completed steps' writes again; ``corrections`` stay, since a
        widened scale stays widened (its data was re-quantized under it)."""
        for s, saved in zip(self.k + self.v, snapshot):
            for c in ("values", "clipped", "at_qmax"):
                s.counts[c] = saved[c].clone()

    def stats(self) -> dict:
        return {"bytes_reserved": self.bytes_reserved, "config": self.config.label(),
                **saturation_summary(self.saturation())}


def saturation_summary(sat: dict) -> dict:
    """Whole-model rates from :meth:`QuantizedPagedKVCache.saturation` counters (or sums of them)."""
    out = {}
    for which in ("k", "v"):
        n = max(int(sat[which]["values"].sum()), 1)
        out[f"{which}_clip_rate"] = int(sat[which]["clipped"].sum()) / n
        out[f"{which}_at_qmax_rate"] = int(sat[which]["at_qmax"].sum()) / n
        out[f"{which}_corrections"] = int(sat[which]["corrections"].sum())
    return out
