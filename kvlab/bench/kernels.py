"""``kvlab bench kernels``: the decode kernel's bytes and speed by format (notebook 05).

On a GPU: a correctness sweep, then timings per batch x context of the compared formats, INT8 through a
dequantized FP16 copy and torch SDPA, GB/s against a device-to-device copy. On a CPU: the sweep under the
interpreter and the projection per GPU; without triton, the projection only.
"""

from __future__ import annotations

import json
import time
from importlib.resources import files
from itertools import product

import torch

from kvlab import kernels  # kernels.decode imports triton (Linux only) on first use, not here
from kvlab.attention import paged_attention
from kvlab.formats import ELEMENT_FORMATS, KV_CACHE_DTYPES
from kvlab.kernels.convert import CONVERSIONS, NOT_INTERPRETABLE, check_convert
from kvlab.kernels.pool import FLOAT, INT4, INT8, PER_SLOT, STATIC, Operand
from kvlab.kernels.traffic import (COMPARED, FORMATS, GPU_BANDWIDTH, SHAPES, decode_ops, decode_traffic, ops_time,
                                   project, step_bytes)
from kvlab.quant.core import Int4Tensor, dequantize_int4
from kvlab.validate import cdiv

BATCHES = (1, 8, 32)
CONTEXTS = (1024, 4096, 16384)
BLOCK_SIZE = 16


# ---- random pools in each format -----------------------------------------------------------------------

def random_operands(fmt: str, num_blocks: int, h_kv: int, d: int, device, block_size: int = BLOCK_SIZE, seed: int = 0):
    """(K, V) operands of a random pool in kv_cache_dtype ``fmt`` (one the kernels read); values ~ N(0, 1)."""
    if fmt not in FORMATS or fmt not in KV_CACHE_DTYPES:
        raise ValueError(f"fmt must be one of {tuple(f for f in FORMATS if f in KV_CACHE_DTYPES)}, got {fmt!r}")
    g = torch.Generator(device=device).manual_seed(seed)
    shape = (num_blocks, block_size, h_kv, d)

    def operand(spec, el):  # random pages by the kernels' format code; int8 per-head, int4 in groups of 32
        if spec.fmt == FLOAT:
            return Operand(torch.randn(shape, generator=g, device=device, dtype=el.storage), FLOAT, label=el.name)
        if spec.fmt == INT8:
            data = torch.randint(-127, 128, shape, generator=g, device=device, dtype=torch.int8)
            scale = torch.full((h_kv, d), 4.0 / 127, device=device)
            return Operand(data, INT8, STATIC, static_scale=scale, label="int8 per-head")
        data = torch.randint(0, 256, (*shape[:3], d // 2), generator=g, device=device, dtype=torch.uint8)
        scales = torch.full((*shape[:3], d // 32, 1), 3.0 / 7, device=device)
        return Operand(data, INT4, PER_SLOT, slot_scale=scales, group_size=32, label="int4 g32")

    return tuple(operand(spec, ELEMENT_FORMATS[name]) for spec, name in zip(FORMATS[fmt], KV_CACHE_DTYPES[fmt]))


#: how the unfused baseline dequantizes (recorded in each measured row): two PyTorch ops through FP16
UNFUSED_PATH = "int8 -> fp16 copy, then *= scale in place: 1 B read + 2 B written + 2 B read + 2 B written per value"


def dequantize(op: Operand, dtype=torch.float16) -> torch.Tensor:
    """The whole pool of one operand as floats: what an UNFUSED implementation writes before attending."""
    if op.fmt == FLOAT:
        return op.data.to(dtype)
    if op.fmt == INT8:  # the cheapest PyTorch route: widen to the target dtype, scale in place
        return op.data.to(dtype).mul_(op.static_scale.to(dtype)[None, None])
    return dequantize_int4(Int4Tensor(op.data, op.slot_scale, None, op.group_size), dtype)


def _tables(batch: int, context: int, num_blocks: int, device, seed: int = 0):
    per_seq = cdiv(context, BLOCK_SIZE)
    perm = torch.randperm(num_blocks, generator=torch.Generator().manual_seed(seed))[:batch * per_seq]
    return perm.reshape(batch, per_seq).to(device), torch.full((batch,), context, dtype=torch.long, device=device)


# ---- correctness sweep (CPU: interpreter; GPU: compiled) -------------------------------------------------

CHECK_CASES = [  # (h_q, h_kv, d, batch, context, num_splits)
    (9, 3, 64, 3, 37, 1),
    (32, 8, 128, 2, 70, 3),
    (4, 4, 64, 1, 200, 4),
]


def check_sweep(device, converts=CONVERSIONS) -> list[dict]:
    """Kernel vs the float reference per format, case and variant; dot8's bound is 10x (q's rounding)."""
    rows = []
    runnable = [c for c in converts if kernels.triton_mode() == "compiled" or c not in NOT_INTERPRETABLE]
    for h_q, h_kv, d, batch, context, splits in CHECK_CASES:
        n_blocks = batch * cdiv(context, BLOCK_SIZE) + 2
        table, ctx = _tables(batch, context, n_blocks, device, seed=d)
        # seeded like the pages: the sweep checks the same numbers on every run (else the tolerance is a draw)
        q = torch.randn(batch, h_q, d, device=device, dtype=torch.float16,
                        generator=torch.Generator(device=device).manual_seed(1000 * h_q + d))
        for fmt in COMPARED:
            k_op, v_op = random_operands(fmt, n_blocks, h_kv, d, device, seed=h_q)
            kf, vf = dequantize(k_op, torch.float32), dequantize(v_op, torch.float32)
            ref = paged_attention(q.float(), kf, vf, table.tolist(), ctx.tolist(), [1] * batch, d ** -0.5)
            for convert in (["cast"] if fmt == "fp16" else runnable):
                if convert == "dot8" and k_op.fmt != INT8:
                    continue
                out = kernels.decode.paged_decode(q, k_op, v_op, table, ctx, d ** -0.5, num_splits=splits,
                                                  out=torch.full_like(q, float("nan")), convert=convert)
                err = (out.float() - ref).abs().max().item()
                # fp16 matmul operands (q, P, V) carry ~5e-4 relative rounding: the bound scales with |V|
                tol = 2e-3 * max(1.0, vf.abs().max().item()) * (10 if convert == "dot8" else 1)
                rows.append({"h_q": h_q, "h_kv": h_kv, "head_dim": d, "batch": batch, "context": context,
                             "splits": splits, "format": fmt, "convert": convert, "max_abs_err": err,
                             "tolerance": tol, "ok": err < tol})
    return rows


# ---- GPU timings ---------------------------------------------------------------------------------------

def copy_bandwidth(device, nbytes: int = 1 << 30) -> float:
    """Device-to-device copy, bytes read + written per second (the achievable ceiling)."""
    from triton.testing import do_bench  # triton: Linux only, and only a GPU run times anything
    x = torch.empty(nbytes // 2, dtype=torch.float16, device=device)
    y = torch.empty_like(x)
    ms = do_bench(lambda: y.copy_(x))
    return 2 * nbytes / (ms * 1e-3)


#: launch options tried for every format and variant on a GPU (None: Triton's defaults); the best is kept
STAGES = (None, 3)


def time_case(shape: str, batch: int, context: int, device, converts=CONVERSIONS) -> dict:
    """One (shape, batch, context) point: microseconds and GB/s per format (its fastest variant, each the
    best over :data:`STAGES`), beside the operations model's bound (``model_us``)."""
    from triton.testing import do_bench  # triton: Linux only, and only a GPU run times anything
    decode = kernels.decode
    layers, h_q, h_kv, d = SHAPES[shape]
    n_blocks = batch * cdiv(context, BLOCK_SIZE)
    table, ctx = _tables(batch, context, n_blocks, device)
    q = torch.randn(batch, h_q, d, device=device, dtype=torch.float16)
    scale = d ** -0.5
    splits = decode.default_splits(batch * h_kv, table.shape[1], decode.default_pages(BLOCK_SIZE))
    row = {"shape": shape, "batch": batch, "context": context, "us": {}, "GBps": {}, "bytes_per_layer": {},
           "splits": splits, "variants": {}, "best_convert": {}, "stages": {}, "model_us": {}}
    for fmt in COMPARED:
        k_op, v_op = random_operands(fmt, n_blocks, h_kv, d, device)
        nbytes = decode_traffic(ctx.tolist(), h_q, h_kv, d, *FORMATS[fmt], num_splits=splits)["total"]
        timed = {}
        for convert in (["cast"] if fmt == "fp16" else converts):
            if convert == "dot8" and k_op.fmt != INT8:
                continue
            best = None
            for st in STAGES:
                us = do_bench(lambda: decode.paged_decode(q, k_op, v_op, table, ctx, scale, num_splits=splits,
                                                          convert=convert, num_stages=st)) * 1e3
                if best is None or us < best[0]:
                    best = (us, st)
            timed[convert] = best
            ops = decode_ops(ctx.tolist(), h_q, h_kv, d, *FORMATS[fmt], convert=convert)
            row["model_us"][f"{fmt} {convert}"] = ops_time(ops, nbytes, "H200")["bound_us"]
        win = min(timed, key=lambda c: timed[c][0])
        row["variants"][fmt] = {c: t[0] for c, t in timed.items()}
        row["best_convert"][fmt], row["stages"][fmt] = win, timed[win][1]
        row["us"][fmt], row["bytes_per_layer"][fmt] = timed[win][0], nbytes
        row["GBps"][fmt] = nbytes / (timed[win][0] * 1e-6) / 1e9
        if fmt == "int8":  # the unfused path: a dequantized FP16 copy of the pool, then the FP16 kernel
            def unfused():
                k16, v16 = dequantize(k_op), dequantize(v_op)
                return decode.paged_decode(q, Operand(k16, FLOAT), Operand(v16, FLOAT), table, ctx, scale,
                                           num_splits=splits)

            row["us"]["int8_unfused"] = do_bench(unfused) * 1e3  # Triton's default launch
            row["unfused_path"] = UNFUSED_PATH
        del k_op, v_op
    # outside baseline: torch SDPA over a contiguous FP16 cache (B, H_kv, ctx, D), GQA without repeating K/V
    kc = torch.randn(batch, h_kv, context, d, device=device, dtype=torch.float16)
    vc = torch.randn_like(kc)
    q4 = q[:, :, None, :]
    sdpa = torch.nn.functional.scaled_dot_product_attention
    row["us"]["sdpa_fp16_contiguous"] = do_bench(lambda: sdpa(q4, kc, vc, scale=scale, enable_gqa=True)) * 1e3
    row["GBps"]["sdpa_fp16_contiguous"] = row["bytes_per_layer"]["fp16"] / (row["us"]["sdpa_fp16_contiguous"] * 1e-6) / 1e9
    del kc, vc
    row["speedup_vs_fp16"] = {f: row["us"]["fp16"] / row["us"][f] for f in row["us"]}
    return row


# ---- the command -----------------------------------------------------------------------------------------

def run(shapes=None, batches=BATCHES, contexts=CONTEXTS, gpu: str = "H100", progress=print,
        converts=CONVERSIONS) -> dict:
    """``kvlab bench kernels``'s JSON: the sweep, the projection and, on a GPU, timings of ``converts``."""
    shapes = list(shapes or SHAPES)
    converts = [check_convert(c) for c in converts]
    if "cast" not in converts:
        converts.insert(0, "cast")  # the baseline every variant is read against
    t0 = time.perf_counter()
    on_gpu = kernels.available() and torch.cuda.is_available() and kernels.triton_mode() == "compiled"
    device = torch.device("cuda" if on_gpu else "cpu")
    result = {"mode": "gpu" if on_gpu else "interpreter" if kernels.available() else "no triton",
              "triton": kernels.triton_version() if kernels.available() else None, "torch": torch.__version__,
              "device": torch.cuda.get_device_name() if on_gpu else "cpu"}
    if kernels.available():
        progress(f"correctness sweep ({'compiled' if on_gpu else 'interpreter'}) ...")
        result["checks"] = check_sweep(device, converts)
        result["conversions_exact"] = kernels.decode.convert_all_values(device)  # all 256 int8 values
    else:  # macOS, Windows: the projection below needs no kernel
        result["checks"], result["skipped"] = [], f"correctness sweep skipped: {kernels.WHY_NO_TRITON}"
    rows = []
    for shape in shapes:
        layers, h_q, h_kv, d = SHAPES[shape]
        rows += [{"shape": shape, "batch": b, "context": c,
                  "bytes_per_step": {f: step_bytes(f, b, c, layers, h_q, h_kv, d) for f in COMPARED},
                  "bytes_per_step_int8_unfused": step_bytes("int8", b, c, layers, h_q, h_kv, d, fused=False),
                  "projection_ms": {g: {f: v["projected_ms"] for f, v in project(shape, b, c, g).items()}
                                    for g in GPU_BANDWIDTH},
                  "model_us": _model_row(shape, b, c)} for b, c in product(batches, contexts)]
    result["projection"] = {"label": "PROJECTION: bytes per whole-model decode step (attention only) / peak HBM "
                                     "bandwidth; a lower bound on the step time, not a measurement",
                            "rows": rows}
    if on_gpu:
        progress("copy bandwidth ...")
        result["copy_GBps"] = copy_bandwidth(device) / 1e9
        measured = []
        for shape, b, c in product(shapes, batches, contexts):
            progress(f"{shape} batch {b} context {c} ...")
            measured.append(time_case(shape, b, c, device, converts))
            torch.cuda.empty_cache()
        result["measured"] = measured
    result["seconds"] = time.perf_counter() - t0
    return result


def _model_row(shape: str, batch: int, context: int, gpu: str = "H200") -> dict:
    """The operations model's bound (us, one layer) per format and conversion variant, and what limits it."""
    layers, h_q, h_kv, d = SHAPES[shape]
    ctx = [context] * batch
    out = {}
    for fmt in COMPARED:
        nbytes = decode_traffic(ctx, h_q, h_kv, d, *FORMATS[fmt])["total"]
        for convert in (["cast"] if fmt == "fp16" else CONVERSIONS):
            t = ops_time(decode_ops(ctx, h_q, h_kv, d, *FORMATS[fmt], convert=convert), nbytes, gpu)
            out[f"{fmt} {convert}"] = {"bound_us": t["bound_us"], "limit": t["limit"], "us": t["us"]}
    return out


def format_table(result: dict) -> str:
    triton = result["triton"] or "not available"
    lines = [f"kvlab bench kernels: {result['mode']} ({result['device']}, triton {triton}, torch {result['torch']})"]
    bad = [c for c in result["checks"] if not c["ok"]]
    if result["checks"]:
        worst = max(c["max_abs_err"] for c in result["checks"])
        lines.append(f"correctness: {len(result['checks']) - len(bad)}/{len(result['checks'])} cases (formats x "
                     f"conversion variants) within 2e-3 x max|V| (fp16 operands; dot8, whose q is int8: 10x that); "
                     f"worst max |err| {worst:.1e}")
    else:
        lines.append(result.get("skipped", "correctness: no cases"))
    if "conversions_exact" in result:
        ex = result["conversions_exact"]
        lines.append("every int8 value through each conversion: " + ", ".join(
            f"{c} {'exact' if ok else 'WRONG'}" for c, ok in ex.items())
            + ("" if "prmt" in ex else " (prmt: compiled GPUs only)"))
    if "measured" in result:
        lines.append(f"copy bandwidth (read + write): {result['copy_GBps']:.0f} GB/s")
        lines.append(f"{'shape':<13}{'batch':>6}{'ctx':>7}{'splits':>7} | {'fp16 us':>9}{'int8':>9}{'k8v4':>9}"
                     f"{'unfused':>9}{'sdpa':>9} | {'int8 x':>7}{'k8v4 x':>7}{'unf. x':>7} | {'fp16 GB/s':>10}"
                     f"{'int8':>7}{'k8v4':>7}")
        for r in result["measured"]:
            u, s, g = r["us"], r["speedup_vs_fp16"], r["GBps"]
            lines.append(f"{r['shape']:<13}{r['batch']:>6}{r['context']:>7}{r['splits']:>7} | {u['fp16']:>9.1f}"
                         f"{u['int8']:>9.1f}{u['k8v4']:>9.1f}{u['int8_unfused']:>9.1f}{u['sdpa_fp16_contiguous']:>9.1f} | "
                         f"{s['int8']:>7.2f}{s['k8v4']:>7.2f}{s['int8_unfused']:>7.2f} | {g['fp16']:>10.0f}"
                         f"{g['int8']:>7.0f}{g['k8v4']:>7.0f}")
        if any("variants" in r for r in result["measured"]):
            lines.append("conversion variants, us (fastest of Triton's default launch and num_stages=3; "
                         "model = the operations model's bound at H200 peaks):")
            for r in result["measured"]:
                for fmt in COMPARED[1:]:
                    var = r.get("variants", {}).get(fmt, {})
                    lines.append(f"{r['shape']:<13}{r['batch']:>6}{r['context']:>7} {fmt:<5}| " + "".join(
                        f"{c} {t:.1f} (model {r['model_us'][f'{fmt} {c}']:.0f})  " for c, t in var.items()))
    lines.append(result["projection"]["label"])
    lines.append(f"{'shape':<13}{'batch':>6}{'ctx':>7} | {'fp16 MB':>9}{'int8':>9}{'k8v4':>9}{'unfused':>9} | "
                 + "".join(f"{g + ' fp16/int8 ms':>20}" for g in GPU_BANDWIDTH))
    for r in result["projection"]["rows"]:
        b = r["bytes_per_step"]
        lines.append(f"{r['shape']:<13}{r['batch']:>6}{r['context']:>7} | {b['fp16'] / 1e6:>9.1f}{b['int8'] / 1e6:>9.1f}"
                     f"{b['k8v4'] / 1e6:>9.1f}{r['bytes_per_step_int8_unfused'] / 1e6:>9.1f} | "
                     + "".join(f"{p['fp16']:>12.3f} /{p['int8']:>6.3f}" for p in r["projection_ms"].values()))
    model_rows = [r for r in result["projection"]["rows"] if r["shape"] == "llama-3-8b" and "model_us" in r]
    if model_rows:
        lines.append("MODEL: operations by pipe at H200 peak rates (kvlab.kernels.traffic.ops_time): the bound in us "
                     "per layer and what sets it, for the Llama-3-8B shape")
    for r in model_rows:
        m = r["model_us"]
        lines.append(f"{'llama-3-8b':<13}{r['batch']:>6}{r['context']:>7} | " + "  ".join(
            f"{name} {v['bound_us']:.1f} ({v['limit']})" for name, v in m.items()))
    lines.append(f"{result['seconds']:.1f} s")
    return "\n".join(lines)


def recorded_h200() -> dict:
    """One ``kvlab bench kernels`` run on an H200 (triton 3.6.0, torch 2.11.0), for machines without a GPU."""
    return json.loads(files("kvlab.kernels").joinpath("bench_h200.json").read_text())
