"""Bytes a decode step moves, predicted and counted (notebook 05).

Decode is memory-bound: the bytes read ARE the step time on a GPU, to first order.
:func:`decode_traffic` predicts every byte one ``paged_decode`` launch loads and stores, by part;
:func:`count_traffic` counts them under Triton's interpreter, so a test holds the prediction to the
kernel; :func:`step_bytes` and :func:`project` scale it to a whole model per format and GPU.
"""

from __future__ import annotations

from contextlib import contextmanager
from dataclasses import dataclass

from kvlab.formats import kernel_names
from kvlab.kernels import require_triton, triton_mode
from kvlab.kernels.convert import check_convert
from kvlab.kernels.pool import FLOAT, INT4, INT8, NO_SCALE, PER_SLOT, STATIC, kernel_kind, scale_code
from kvlab.quant.config import TensorFormat, named_config
from kvlab.sizing import kv_config
from kvlab.validate import cdiv

#: peak HBM bandwidth, bytes/s (vendor datasheets: A100 80GB SXM, H100 SXM, H200 SXM)
GPU_BANDWIDTH = {"A100": 2.039e12, "H100": 3.35e12, "H200": 4.8e12}
#: the formats the benchmark and the widget compare: FP16 against the two the kernels read fused
COMPARED = ("fp16", "int8", "k8v4")


@dataclass(frozen=True)
class Spec:
    """How one of K/V is stored, without the tensors: enough to count bytes."""

    fmt: int = FLOAT  # FLOAT, INT8, INT4
    elem: int = 2  # bytes per stored value (FLOAT: 2 or 4; INT8: 1; INT4: half a byte, see value_bytes)
    scale_kind: int = NO_SCALE
    scale_width: int = 1  # INT8 PER_SLOT: 1 scale per token-head (per-token pages are read per head too)
    group_size: int = 32  # INT4

    def value_bytes(self, d: int) -> int:
        """Bytes of one token-head's data."""
        return d // 2 if self.fmt == INT4 else d * self.elem

    def scale_bytes(self, d: int) -> int:
        """Bytes of per-slot scales read with one token-head."""
        if self.scale_kind != PER_SLOT:
            return 0
        return 4 * (d // self.group_size if self.fmt == INT4 else 1)


def spec_of_format(fmt: TensorFormat) -> Spec:
    """The :class:`Spec` of a :class:`~kvlab.quant.TensorFormat` the kernels read, from its registry entry."""
    el = fmt.element
    return Spec(kernel_kind(el.name).code, el.storage.itemsize, scale_code(fmt), group_size=fmt.group_size)


def format_specs() -> dict[str, tuple[Spec, Spec]]:
    """(K, V) specs of every kv_cache_dtype the kernels read, plus int8 with per-token-head scales."""
    specs = {name: tuple(spec_of_format(f) for f in named_config(name).formats(0)) for name in kernel_names()}
    specs["int8-per-token-head"] = tuple(spec_of_format(f) for f in
                                         named_config("int8", granularity="per-token-head").formats(0))
    return specs


#: the formats the lab compares, as the kernels' byte model sees them (:func:`format_specs`)
FORMATS = format_specs()


def spec_of(op) -> Spec:
    """The :class:`Spec` of a :class:`~kvlab.kernels.pool.Operand`."""
    return Spec(op.fmt, op.data.element_size(), op.scale_kind, 1, op.group_size or 32)


def decode_traffic(seq_lens, h_q: int, h_kv: int, d: int, k: Spec, v: Spec, *, block_size: int = 16,
                   num_splits: int = 1, group_heads: bool = True, has_own: bool = False,
                   q_bytes: int = 2, own_bytes: int | None = None, table_bytes: int = 8, ctx_bytes: int = 8) -> dict:
    """``{"read": {part: bytes}, "write": {part: bytes}, "total": n}`` of one ``paged_decode`` launch (masked
    lanes move nothing); seq_lens include the new token, ``*_bytes`` are element sizes."""
    g = h_q // h_kv
    qpp = g if group_heads else 1
    programs_per_seq = h_q // qpp  # head groups per sequence
    copies = g // qpp  # how many programs read each KV head's pages
    read = dict.fromkeys(["k", "v", "k_scales", "v_scales", "block_tables", "q", "seq_lens", "own",
                          "partials"], 0)
    write = {"partials": 0, "out": 0}
    for ctx in seq_lens:
        n_pool = ctx - (1 if has_own else 0)
        tokens = n_pool * h_kv * copies  # token-heads read from the pool
        read["k"] += tokens * k.value_bytes(d)
        read["v"] += tokens * v.value_bytes(d)
        read["k_scales"] += tokens * k.scale_bytes(d)
        read["v_scales"] += tokens * v.scale_bytes(d)
        read["block_tables"] += cdiv(n_pool, block_size) * table_bytes * programs_per_seq
        programs = programs_per_seq * num_splits
        read["q"] += programs * qpp * d * q_bytes
        read["seq_lens"] += programs * ctx_bytes
        # static scales: K's folded into q before the loop, V's into the output after it, in every program
        read["k_scales"] += programs * d * 4 * (k.scale_kind == STATIC)
        read["v_scales"] += programs * d * 4 * (v.scale_kind == STATIC)
        if has_own:
            read["own"] += programs_per_seq * 2 * d * (q_bytes if own_bytes is None else own_bytes)
        if num_splits > 1:
            write["partials"] += programs * qpp * (d + 1) * 4  # fp32 partial output + log-sum-exp
            read["partials"] += h_q * num_splits * (d + 1) * 4  # the merge reads them back
        write["out"] += h_q * d * q_bytes
    total = sum(read.values()) + sum(write.values())
    return {"read": read, "write": write, "total": total}


def step_bytes(fmt: str, batch: int, context: int, num_layers: int, h_q: int, h_kv: int, d: int,
               block_size: int = 16, fused: bool = True) -> int:
    """Bytes the attention of one whole-model decode step moves (fp16 q/out). ``fused=False``: dequantize
    the cache to an fp16 copy first, then attend over it (the copy costs more than quantizing saves)."""
    specs = format_specs()
    if fmt not in specs:
        raise ValueError(f"fmt must be one of {sorted(specs)}, got {fmt!r}")
    k, v = specs[fmt]
    ctx = [context] * batch
    t = decode_traffic(ctx, h_q, h_kv, d, k, v, block_size=block_size)["total"]
    if not fused and fmt != "fp16":
        cache_read = sum(decode_traffic(ctx, h_q, h_kv, d, k, v, block_size=block_size)["read"][p]
                         for p in ("k", "v", "k_scales", "v_scales"))
        copy = 2 * batch * context * h_kv * d * 2  # the fp16 copy of K and V, written once
        t = cache_read + copy + decode_traffic(ctx, h_q, h_kv, d, *specs["fp16"], block_size=block_size)["total"]
    return t * num_layers


def _shape(name: str) -> tuple[int, int, int, int]:
    c = kv_config(name)
    return c.num_layers, c.num_heads, c.num_kv_heads, c.head_dim


#: shapes the benchmark and the widget use, from kvlab.sizing's presets: (layers, query heads, KV heads, head_dim)
SHAPES = {name: _shape(name) for name in ("smollm2-135m", "llama-3-8b")}


def project(shape: str, batch: int, context: int, gpu: str = "H100", fused: bool = True) -> dict:
    """Bytes per decode step by format and the step time they imply at the GPU's peak bandwidth (a lower bound)."""
    if shape not in SHAPES:
        raise ValueError(f"shape must be one of {sorted(SHAPES)}, got {shape!r}")
    if gpu not in GPU_BANDWIDTH:
        raise ValueError(f"gpu must be one of {sorted(GPU_BANDWIDTH)}, got {gpu!r}")
    layers, h_q, h_kv, d = SHAPES[shape]
    out = {}
    for fmt in COMPARED:
        b = step_bytes(fmt, batch, context, layers, h_q, h_kv, d, fused=fused)
        out[fmt] = {"bytes_per_step": b, "projected_ms": 1e3 * b / GPU_BANDWIDTH[gpu]}
    return out


# ---- counting under the interpreter -----------------------------------------------------------------

@contextmanager
def count_traffic():
    """Yield running "read"/"write" byte totals of every ``tl.load``/``tl.store`` under the interpreter."""
    require_triton("count_traffic")
    if triton_mode() != "interpreter":
        raise RuntimeError("count_traffic counts through Triton's interpreter; run with TRITON_INTERPRET=1")
    from triton.runtime import interpreter as I  # triton is Linux-only: imported where it is needed
    b = I.interpreter_builder
    counts = {"read": 0, "write": 0}
    load, store = b.create_masked_load, b.create_masked_store

    def counted_load(ptrs, mask, *args):
        counts["read"] += int(mask.data.sum()) * ptrs.get_element_ty().primitive_bitwidth // 8
        return load(ptrs, mask, *args)

    def counted_store(ptrs, value, mask, *args):
        counts["write"] += int(mask.data.sum()) * ptrs.get_element_ty().primitive_bitwidth // 8
        return store(ptrs, value, mask, *args)

    b.create_masked_load, b.create_masked_store = counted_load, counted_store
    try:
        yield counts
    finally:
        del b.create_masked_load, b.create_masked_store  # back to the class's methods


# ---- the operations model: what converting the bytes costs (per value: kvlab.kernels.pool.KERNEL_KINDS) ----

#: results per clock per SM (CUDA C++ Programming Guide, arithmetic instruction throughput: compute
#: capability 8.0 for the A100, 9.0 for the H100/H200; "cvt" is the guide's "all other type
#: conversions", "sfu" its exp2/rsqrt row; prmt is counted on the integer pipe, which the guide omits)
PIPE_RATE = {
    "A100": {"cvt": 16, "int": 64, "fp16": 256, "fp32": 64, "sfu": 16},
    "H100": {"cvt": 16, "int": 64, "fp16": 256, "fp32": 128, "sfu": 16},
    "H200": {"cvt": 16, "int": 64, "fp16": 256, "fp32": 128, "sfu": 16},
}
#: compute capability (major, minor) of the GPUs rooms get (NVIDIA's CUDA GPU list): Colab's free T4 is
#: sm_75; FP8 (e4m3/e5m2) tensor cores and conversions need 8.9 (Ada, Hopper and later)
COMPUTE_CAPABILITY = {"T4": (7, 5), "A100": (8, 0), "L4": (8, 9), "H100": (9, 0), "H200": (9, 0)}
FP8_MIN_CAPABILITY = (8, 9)
#: shared memory (SRAM) bytes per clock per SM: 32 banks x 4 bytes (CUDA guide, compute capability 8.x/9.x)
SMEM_BYTES_PER_CLOCK = 128
#: (SMs, boost clock Hz, dense fp16 and int8 tensor-core ops/s) from the vendors' datasheets
GPU_CORES = {"A100": (108, 1.41e9, 312e12, 624e12), "H100": (132, 1.98e9, 989e12, 1979e12),
             "H200": (132, 1.98e9, 989e12, 1979e12)}


def decode_ops(seq_lens, h_q: int, h_kv: int, d: int, k: Spec, v: Spec, *, convert: str = "cast",
               block_size: int = 16, pages: int | None = None, group_heads: bool = True) -> dict:
    """Operations of one ``paged_decode`` launch per pipe (cvt, int, fp16, fp32, sfu) and MMA flops, counted
    as the kernel is written: whole tiles, masked lanes included, query heads padded to 16 rows, the
    rescaling exps left out."""
    check_convert(convert)
    pages = pages or max(1, 128 // block_size)
    pages = max(pages, 16 // block_size)
    n = pages * block_size
    g = h_q // h_kv
    qpp = g if group_heads else 1
    rows = max(16, 1 << max(0, (qpp - 1).bit_length()))  # QPP_PAD
    programs_per_seq = h_q // qpp
    pipes = dict.fromkeys(("cvt", "int", "fp16", "fp32", "sfu"), 0.0)
    mma = {"fp16": 0, "int8": 0}
    tiles = 0
    modelled = True
    k_cost = kernel_kind(k.fmt).cost[convert]
    v_cost = kernel_kind(v.fmt).cost["magic" if convert == "dot8" and v.fmt == INT8 else convert]
    for ctx in seq_lens:
        t = cdiv(max(ctx, 0), n) * programs_per_seq
        tiles += t
        for cost in (k_cost, v_cost):
            if cost is None:
                modelled = False
                continue
            for pipe, per_value in cost.items():
                pipes[pipe] += per_value * t * n * d
        slots = t * rows * n  # padded score entries
        pipes["fp32"] += slots * ((k.scale_kind == PER_SLOT and k.fmt == INT8) + (v.scale_kind == PER_SLOT and v.fmt == INT8))
        pipes["sfu"] += slots
        if convert == "dot8":
            pipes["cvt"] += slots  # int32 scores -> fp32
            pipes["fp32"] += slots  # x q's row scale
            mma["int8"] += 2 * slots * d
        else:
            mma["fp16"] += 2 * slots * d
        mma["fp16"] += 2 * slots * d  # P.V
    return {"tiles": tiles, "values": 2 * tiles * n * d, "pipes": pipes, "mma_flops": mma, "modelled": modelled}


def ops_time(ops: dict, nbytes: int, gpu: str = "H200") -> dict:
    """Microseconds each pipe of :func:`decode_ops` needs at ``gpu``'s peak rates, beside the bytes' time at
    its peak bandwidth; ``bound_us`` is the largest (a MODEL: pipes overlap at best, no kernel reaches peak)."""
    if gpu not in PIPE_RATE:
        raise ValueError(f"gpu must be one of {sorted(PIPE_RATE)}, got {gpu!r}")
    sms, clock, tc16, tc8 = GPU_CORES[gpu]
    us = {pipe: 1e6 * count / (PIPE_RATE[gpu][pipe] * sms * clock) for pipe, count in ops["pipes"].items()}
    us["tensor"] = 1e6 * (ops["mma_flops"]["fp16"] / tc16 + ops["mma_flops"]["int8"] / tc8)
    us["bytes"] = 1e6 * nbytes / GPU_BANDWIDTH[gpu]
    limit = max(us, key=us.get)
    return {"us": us, "bound_us": us[limit], "limit": limit, "modelled": ops["modelled"]}
