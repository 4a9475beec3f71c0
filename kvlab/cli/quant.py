"""``kvlab calibrate`` and ``kvlab ppl`` (notebook 03): the scales of a model's K and V, and what a quantized
KV format costs in perplexity, KL and top-1; the calibration helpers also serve ``kvlab export-vllm``."""

from __future__ import annotations

from kvlab import models  # through the module: tests swap models.load_model
from kvlab.data import EVAL_PLAY, calibration_chunks, text_tokens, text_tokens_from_file
from kvlab.eval import check_scoring, evaluate, kv_bytes_per_token
from kvlab.files import check_writable_target, read_text
from kvlab.calibrate import calibrate, default_calibration
from kvlab.quant.calibration import Calibration
from kvlab.quant.config import named_config
from kvlab.sizing import kv_config
from kvlab.cli.common import emit


def quant_config(args):
    """The KVQuantConfig that ``kvlab ppl``'s format options (parser.quant_format_options) describe."""
    gran = args.scales if args.kv_cache_dtype in ("int8", "fp8", "k8v4") else None
    if args.kv_cache_dtype == "fp8" and args.scales == "per-head":
        gran = "per-tensor"  # fp8's default: one scale per tensor
    policy = args.policy or ("dynamic" if gran in ("per-token", "per-token-head") else "static")
    return named_config(args.kv_cache_dtype, granularity=gran, policy=policy, stat=args.calib, rotate_k=args.rotate)


def read_files_first(args):
    """Check the files read before the model loads (a wrong path fails in a second); the ``--scales-file``."""
    if getattr(args, "file", None):
        read_text(args.file, "--file")
    if getattr(args, "scales_file", None):
        return Calibration.load(args.scales_file)
    return None


def calibration(args, model, tokenizer, cal=None):
    """The ``--scales-file`` calibration checked against the model, else the cached default one."""
    if cal is not None:
        c = kv_config(model)
        cal.check_model(c.num_layers, c.num_kv_heads, c.head_dim, f"--scales-file {args.scales_file!r}")
        return cal
    return default_calibration(model, tokenizer, args.model, progress=not args.json)


def cmd_calibrate(args) -> int:
    check_writable_target(args.out, "--out file")  # before the model loads and the calibration runs
    read_files_first(args)
    model, tokenizer = models.load_model(args.model)
    if args.file:
        ids = text_tokens_from_file(tokenizer, args.file, args.tokens)
        chunks = [ids[i:i + args.chunk] for i in range(0, len(ids), args.chunk)]
    else:
        chunks = calibration_chunks(tokenizer, args.tokens, args.chunk)
    cal = calibrate(model, chunks, progress=not args.json, meta={"model": args.model, "text": args.file or "default"})
    path = cal.save(args.out)
    k = cal.stats["k"]["per-head"]
    obj = {"out": str(path), **cal.meta, "k_absmax_max": float(k["absmax"].max()),
           "v_absmax_max": float(cal.stats["v"]["per-head"]["absmax"].max())}
    emit(obj, args.json, [f"calibration of {cal.meta['tokens']} tokens saved to {path}",
                          f"largest |K| {obj['k_absmax_max']:.2f}, largest |V| {obj['v_absmax_max']:.2f}"])
    return 0


def _eval_tokens(args, tokenizer):
    if args.file:
        return text_tokens_from_file(tokenizer, args.file, args.tokens)
    return text_tokens(tokenizer, args.tokens, play=EVAL_PLAY)


def cmd_ppl(args) -> int:
    if args.stride is None:
        args.stride = max(1, args.window // 2)
    check_scoring(args.tokens, args.window, args.stride, args.chunk)  # before the model loads
    config = quant_config(args)
    cal = read_files_first(args)
    model, tokenizer = models.load_model(args.model)
    cal = calibration(args, model, tokenizer, cal) if config.needs_calibration(model.config.num_hidden_layers) \
        else None
    tokens = _eval_tokens(args, tokenizer)
    res = evaluate(model, tokens, {"q": config}, cal, window=args.window, stride=args.stride, chunk=args.chunk)
    c = res["configs"]["q"]
    obj = {"ppl": c["ppl"], "ppl_fp": res["ppl_fp"], "delta_ppl_pct": c["delta_ppl_pct"], "kl": c["kl"],
           "top1": c["top1"], "config": c["label"], "bytes_per_token": kv_bytes_per_token(model, config),
           "k_clip_rate": c["k_clip_rate"], "v_clip_rate": c["v_clip_rate"], "corrections":
           c["k_corrections"] + c["v_corrections"], "tokens": res["tokens"], "scored": res["scored"],
           "window": args.window, "stride": args.stride, "chunk": args.chunk}
    emit(obj, args.json, [f"{c['label']}: ppl {c['ppl']:.3f} vs FP {res['ppl_fp']:.3f} ({c['delta_ppl_pct']:+.2f} %), "
                          f"KL {c['kl']:.4f}, top-1 {c['top1']:.1%}, {obj['bytes_per_token']:.0f} B/token"])
    return 0
