"""The ``kvlab`` parser: every subcommand, option, default and help text, and nothing that runs. It imports
no model code, so ``kvlab --help`` stays fast; shared options are parent parsers made by small functions.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from kvlab.cache import CACHE_KINDS
from kvlab.attention import BACKEND_NAMES
from kvlab.formats import GRANULARITIES, KV_CACHE_DTYPES, engine_kv_cache_dtypes
from kvlab.gpu_check import DEFAULT_JOBS, STEP_NAMES, check_only
from kvlab.sizing import dtypes

#: the subcommand -> the module of kvlab.cli that holds its handler ``cmd_<name>`` (imported when it runs)
COMMAND_MODULES = {"info": "info", "size": "info", "generate": "generate", "bench": "bench",
                   "calibrate": "quant", "ppl": "quant", "export-vllm": "export", "claims": "claims",
                   "convert": "info", "gpu-check": "gpu_check", "grade": "grade"}

DEFAULT_MODEL = "smollm2-135m"
# KV formats, granularities and dtypes come from kvlab.formats when the parser is built: a format
# registered there is a choice here too ("auto": the engine's pool takes its model's dtype)
#: calibration statistics a static scale is read from
CALIB_STATS = ("absmax", "p99", "p99.9", "p99.99")
ATTN_BACKENDS = BACKEND_NAMES
BENCH_WHAT = ("recompute", "static", "memory", "quant", "engine", "kernels")
BENCH_SYSTEMS = ("kvlab_continuous", "kvlab_static", "hf_generate", "hf_generate_batch", "vllm", "vllm_eager")


def positive_int(name: str):
    """An argparse ``type`` for counts: the error names the option (``--tokens must be >= 1, got 0``)."""
    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{name} must be an integer, got {text!r}") from None
        if value < 1:
            raise argparse.ArgumentTypeError(f"{name} must be >= 1, got {value}")
        return value
    return parse


def step_names(text: str) -> list[str]:
    """An argparse ``type`` for ``--only``: comma-separated names of gpu-check's steps."""
    try:
        return list(check_only(text))
    except ValueError as e:  # "only must name steps of ..." -> "--only must ..."
        raise argparse.ArgumentTypeError(f"--{e}") from None


# ---- parent parsers: the options several subcommands share -------------------------------------------

def model_options(help: str | None = None) -> argparse.ArgumentParser:
    """``--model``: which model a subcommand loads (every subcommand that runs or sizes one)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--model", default=DEFAULT_MODEL, help=help)
    return p


def calibration_options(calib_help: str) -> argparse.ArgumentParser:
    """``--calib`` and ``--scales-file``: where static scales come from (``ppl``, ``export-vllm``)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--calib", default="absmax", choices=CALIB_STATS, help=calib_help)
    p.add_argument("--scales-file", default=None, help="a kvlab calibrate file (default: calibrate once, cached)")
    return p


def quant_format_options() -> argparse.ArgumentParser:
    """A quantized KV format: element type, scale granularity, policy, rotation (``quant.quant_config``)."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--kv-cache-dtype", default="int8", choices=tuple(KV_CACHE_DTYPES))
    p.add_argument("--scales", default="per-head", choices=GRANULARITIES)
    p.add_argument("--policy", default=None, choices=["static", "dynamic", "corrected"])
    p.add_argument("--rotate", action="store_true", help="Hadamard-rotate K (and Q) before quantizing")
    return p


def json_option() -> argparse.ArgumentParser:
    """``--json``: every subcommand can print one JSON object instead of its table."""
    p = argparse.ArgumentParser(add_help=False)
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    return p


# ---- each subcommand's own options ----------------------------------------------------------------------------------

def _size_options() -> argparse.ArgumentParser:
    s = argparse.ArgumentParser(add_help=False)
    s.add_argument("--dtype", default="fp16", choices=dtypes())
    s.add_argument("--tokens", type=positive_int("--tokens"), default=4096)
    s.add_argument("--batch", type=positive_int("--batch"), default=1)
    s.add_argument("--scales", default=None, help="none, per-tensor, per-head, per-channel, per-token, "
                                                   "per-token-head, group-<g> (default depends on dtype)")
    return s


def _generate_options() -> argparse.ArgumentParser:
    s = argparse.ArgumentParser(add_help=False)
    s.add_argument("--cache", default="dynamic", choices=CACHE_KINDS)
    s.add_argument("--prompt", required=True, action="append",
                   help="a prompt; give it several times to serve several prompts (concurrently with --engine)")
    s.add_argument("--max-tokens", type=positive_int("--max-tokens"), default=32)
    s.add_argument("--max-seq-len", type=positive_int("--max-seq-len"), default=None,
                   help="static cache slots per sequence (default: prompt + max tokens)")
    s.add_argument("--block-size", type=positive_int("--block-size"), default=None,
                   help="paged cache / engine: tokens per block, a power of two 1..256 (default 16)")
    s.add_argument("--num-blocks", type=positive_int("--num-blocks"), default=None,
                   help="paged cache / engine: blocks in the pool (default: enough for prompt + max tokens)")
    s.add_argument("--engine", action="store_true", help="serve through kvlab.engine.LLM (continuous batching)")
    # engine options: default None here, so that kvlab.cli.generate can refuse them without --engine
    s.add_argument("--attn-backend", default=None, choices=ATTN_BACKENDS,
                   help="engine: attention path (default torch; triton: the notebook 05 kernels, interpreted on a CPU)")
    s.add_argument("--kv-cache-dtype", default=None, choices=engine_kv_cache_dtypes(),
                   help="engine: storage of the block pool (default auto; quantized ones use the cached default "
                        "calibration)")
    s.add_argument("--max-num-seqs", type=positive_int("--max-num-seqs"), default=None,
                   help="engine: requests running at once (default: all prompts)")
    s.add_argument("--max-num-batched-tokens", type=positive_int("--max-num-batched-tokens"), default=None,
                   help="engine: tokens per step, decodes + prefill chunks (default 512, at least --max-num-seqs)")
    s.add_argument("--temperature", type=float, default=None, help="engine: 0 = greedy (the default)")
    s.add_argument("--top-p", type=float, default=None, help="engine: nucleus sampling (default 1.0)")
    s.add_argument("--seed", type=int, default=None, help="engine: sampling seed")
    return s


def _bench_options() -> argparse.ArgumentParser:
    s = argparse.ArgumentParser(add_help=False)
    s.add_argument("what", choices=BENCH_WHAT)
    s.add_argument("--prompt-lens", type=positive_int("--prompt-lens"), nargs="+", default=[16, 128, 512])
    s.add_argument("--new-tokens", type=positive_int("--new-tokens"), default=None)  # 16 for recompute, else 64
    s.add_argument("--block-size", type=positive_int("--block-size"), default=16)
    s.add_argument("--workload", default="sharegpt", choices=["sharegpt", "alpaca"])
    s.add_argument("--requests", type=positive_int("--requests"), default=64)
    s.add_argument("--seed", type=int, default=0)
    s.add_argument("--tokens", type=positive_int("--tokens"), default=1024, help="quant: held-out tokens scored")
    s.add_argument("--chunk", type=positive_int("--chunk"), default=32, help="quant: tokens per forward")
    s.add_argument("--no-mixed", action="store_true", help="quant: skip the mixed-precision search")
    s.add_argument("--num-requests", type=positive_int("--num-requests"), default=32, help="engine: requests")
    s.add_argument("--arrival", default="all", choices=["all", "poisson"], help="engine: all at once or Poisson")
    s.add_argument("--rate", type=float, default=4.0, help="engine: Poisson arrival rate (requests/s)")
    s.add_argument("--max-num-seqs", type=positive_int("--max-num-seqs"), default=32,
                   help="engine: running at once (and HF generate()'s batch size)")
    s.add_argument("--max-num-batched-tokens", type=positive_int("--max-num-batched-tokens"), default=None,
                   help="engine: tokens per step (default 512, at least --max-num-seqs)")
    s.add_argument("--scale", type=float, default=0.25, help="engine: lengths x scale (ShareGPT means 161/338)")
    s.add_argument("--attn-backend", default="torch", choices=ATTN_BACKENDS)
    s.add_argument("--systems", nargs="+", default=None, choices=BENCH_SYSTEMS,
                   help="engine: default all (vllm, vllm_eager: the peer of `make peer`, skipped without it)")
    s.add_argument("--repeat", type=positive_int("--repeat"), default=1,
                   help="engine: serve the workload this many times, the systems taking turns (medians; paired ratios)")
    s.add_argument("--profile", action="store_true",
                   help="engine: also profile kvlab continuous's steps (where a step's milliseconds go)")
    s.add_argument("--no-shared-prefix", action="store_true", help="engine: no shared system prompt")
    s.add_argument("--shapes", nargs="+", default=None, choices=["llama-3-8b", "smollm2-135m"],
                   help="kernels: attention shapes to sweep")
    s.add_argument("--batches", type=positive_int("--batches"), nargs="+", default=[1, 8, 32], help="kernels")
    s.add_argument("--contexts", type=positive_int("--contexts"), nargs="+", default=[1024, 4096, 16384],
                   help="kernels")
    s.add_argument("--converts", nargs="+", default=None,
                   choices=["cast", "magic", "prmt", "bf16", "dot8"],
                   help="kernels: conversion variants to check and time (default: all; cast always runs)")
    s.add_argument("--out", default=None, help="kernels: also write the JSON result to this file")
    return s


def _calibrate_options() -> argparse.ArgumentParser:
    s = argparse.ArgumentParser(add_help=False)
    s.add_argument("--out", required=True, help="output .safetensors file")
    s.add_argument("--file", default=None, help="calibration text file (default: the lab's calibration play)")
    s.add_argument("--tokens", type=positive_int("--tokens"), default=2048)
    s.add_argument("--chunk", type=positive_int("--chunk"), default=512)
    return s


def _ppl_options() -> argparse.ArgumentParser:
    s = argparse.ArgumentParser(add_help=False)
    s.add_argument("--file", default=None, help="text to score (default: held-out Hamlet)")
    s.add_argument("--tokens", type=positive_int("--tokens"), default=1024)
    s.add_argument("--window", type=positive_int("--window"), default=512)
    s.add_argument("--stride", type=positive_int("--stride"), default=None, help="default: half the window")
    s.add_argument("--chunk", type=positive_int("--chunk"), default=32)
    return s


def _export_vllm_options() -> argparse.ArgumentParser:
    s = argparse.ArgumentParser(add_help=False)
    s.add_argument("--out", required=True, help="output folder (kv_cache_scales.safetensors, config.json)")
    s.add_argument("--strategy", default="tensor", choices=["tensor", "attn_head"],
                   help="one scale per layer, or one per KV head (vLLM's FlashAttention backend only)")
    return s


def _claims_options() -> argparse.ArgumentParser:
    s = argparse.ArgumentParser(add_help=False)
    s.add_argument("--only", default=None, metavar="ID,ID", help="measure only these claims (ids as in the table)")
    return s


def _grade_options() -> argparse.ArgumentParser:
    s = argparse.ArgumentParser(add_help=False)
    s.add_argument("submissions", nargs="+", help="submitted notebooks, or folders of them (one folder per participant)")
    s.add_argument("--out", required=True, help="grades CSV: one row per submission")
    s.add_argument("--nbgrader", default=None, metavar="CSV", help="also write the grades in nbgrader export's columns")
    s.add_argument("--notebook", default=None, help="the lab notebook they answer (default: from each file's name)")
    s.add_argument("--points", default=None, metavar="JSON", help='points per task, e.g. {"slot_mapping": 2} (default 1)')
    s.add_argument("--timeout", type=positive_int("--timeout"), default=900, help="seconds per notebook (default 900)")
    s.add_argument("--jobs", type=positive_int("--jobs"), default=1, help="submissions graded at once (default 1)")
    s.add_argument("--memory-gb", type=float, default=8.0, help="memory per submission, Linux only (default 8)")
    return s


def _convert_options() -> argparse.ArgumentParser:
    s = argparse.ArgumentParser(add_help=False)
    s.add_argument("--force", action="store_true")
    return s


def _gpu_check_options() -> argparse.ArgumentParser:
    s = argparse.ArgumentParser(add_help=False)
    s.add_argument("--out", required=True, metavar="DIR", type=Path,
                   help="folder for the logs, bench_kernels.json, gpu_check.json and summary.md")
    s.add_argument("--dry-run", action="store_true",
                   help="run the same commands on a CPU at their smallest settings, the notebooks collected only")
    s.add_argument("--jobs", type=positive_int("--jobs"), default=DEFAULT_JOBS, help="notebooks run at once")
    s.add_argument("--only", type=step_names, default=None, metavar="STEP,STEP",
                   help=f"run only these steps ({', '.join(STEP_NAMES)}), e.g. to redo a failed one")
    return s


def build_parser() -> argparse.ArgumentParser:
    """The whole ``kvlab`` command line: each subcommand is its own options plus the shared parents."""
    p = argparse.ArgumentParser(prog="kvlab", description="The KV-cache lab's command line.")
    sub = p.add_subparsers(dest="command", required=True)
    model, out = model_options(), json_option()
    add = sub.add_parser
    add("info", help="versions, device, triton mode, model cache status", parents=[out])
    add("size", help="KV-cache size calculator",
        parents=[model_options("preset name, local folder or HF id"), _size_options(), out])
    add("generate", help="greedy generation through a chosen KV cache", parents=[model, _generate_options(), out])
    add("bench", help="measurements: recompute vs cache, static vs paged, memory breakdown, quant formats, the "
                      "engine, the Triton kernels", parents=[model, _bench_options(), out])
    add("calibrate", help="collect K/V abs-max and percentiles per layer x head; save scales",
        parents=[model, _calibrate_options(), out])
    add("ppl", help="perplexity, KL and top-1 of a KV format vs the full-precision cache",
        parents=[model, quant_format_options(), calibration_options("calibration statistic for static scales"),
                 _ppl_options(), out])
    add("export-vllm", help="write calibrated FP8 KV scales as vLLM checkpoint tensors + config.json",
        parents=[model, _export_vllm_options(),
                 calibration_options("calibration statistic; FP8 scale = statistic / 448"), out])
    add("claims", help="every numeric claim of the three source articles, measured now, with a verdict",
        parents=[_claims_options(), out])
    add("convert", help="convert the bundled SmolLM2 GGUF to safetensors (once)", parents=[_convert_options(), out])
    add("gpu-check", help="the lab's commands on one CUDA GPU, each under a time limit: the kernel and engine benchmarks, "
                          "the notebooks, a summary (--dry-run: on a CPU)", parents=[_gpu_check_options(), out])
    add("grade", help="execute submitted notebooks and grade every task with kvlab's checkers (CSV, nbgrader CSV)",
        parents=[_grade_options(), out])
    assert set(sub.choices) == set(COMMAND_MODULES), "every subcommand needs a module in COMMAND_MODULES"
    return p
