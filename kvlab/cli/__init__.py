"""The ``kvlab`` command line: the lab's measurements from a terminal, each also a notebook cell.

Subcommands (``kvlab X --help`` shows each one's options; every one takes ``--json`` and then prints
one JSON object on stdout instead of a table):

- ``info``: versions, device, Triton mode, which models are converted and where they are cached.
- ``size``: the KV-cache size of a model (preset, local folder or HF id) for a dtype, tokens and batch.
- ``generate``: greedy tokens through a chosen cache (none, dynamic, static, paged), or several
  prompts served concurrently by the engine (``--engine``).
- ``bench WHAT``: one measurement, WHAT being
    - ``recompute``: recomputing the prefix vs reading the KV cache, per prompt length;
    - ``static``: slots a static cache reserves vs a paged one, and how many hold tokens;
    - ``memory``: the PagedAttention memory breakdown per allocation policy, on a synthetic workload;
    - ``quant``: every KV format's bytes, perplexity, KL and top-1 on held-out text;
    - ``engine``: kvlab's engine (continuous and static batching) vs HF ``generate()`` on a workload;
    - ``kernels``: the Triton kernels (timed on a GPU; checked and projected on a CPU).
- ``calibrate``: collect K/V abs-max and percentiles per layer x head and save them (``--out``).
- ``ppl``: perplexity, KL and top-1 of one KV format against the full-precision cache.
- ``export-vllm``: calibrated FP8 KV scales as vLLM checkpoint tensors and config.json.
- ``claims``: every numeric claim of the three source articles, measured now, with a verdict.
- ``convert``: convert the bundled SmolLM2 GGUF to safetensors (once).
- ``grade``: submitted notebooks executed headless, each task graded by kvlab's own checker on the
  participant's function; a CSV and, with ``--nbgrader``, nbgrader export's columns (:mod:`kvlab.grade`).
- ``gpu-check``: on a CUDA GPU, ``bench kernels``, ``bench engine`` on both backends and the notebooks
  under nbval, each under a time limit, and a summary (:mod:`kvlab.gpu_check`); ``--dry-run``: on a CPU.

Each subcommand's handler ``cmd_<name>(args) -> int`` lives in the module ``parser.COMMAND_MODULES``
names. Bad input is one ``kvlab: error: ...`` line on stderr with exit status 2 (so scripts can tell it
from a crash); a failing vLLM peer exits with 1 and the tail of its output; Ctrl-C exits with 130.
"""

from __future__ import annotations

import importlib
import sys

from kvlab.bench.vllm_peer import PeerError
from kvlab.cache import OutOfBlocksError
from kvlab.env import silence_known_warnings
from kvlab.cli.common import CLIError
from kvlab.cli.parser import COMMAND_MODULES, build_parser

__all__ = ["main", "build_parser", "CLIError"]


def main(argv: list[str] | None = None) -> int:
    """``kvlab [argv]``: parse, run one subcommand, return its exit status (0, 2 for bad input, 130)."""
    args = build_parser().parse_args(argv)
    silence_known_warnings()  # after parsing: it imports transformers, which --help and a typo do not need
    try:
        # the command's module is imported only now: kvlab --help must not load transformers (start-up time)
        module = importlib.import_module(f"kvlab.cli.{COMMAND_MODULES[args.command]}")
        return getattr(module, "cmd_" + args.command.replace("-", "_"))(args)
    except (CLIError, ValueError, TypeError, OSError, OutOfBlocksError) as e:
        print(f"kvlab: error: {_one_line(e)}", file=sys.stderr)
        return 2
    except PeerError as e:  # the vLLM peer ran and failed: not bad input; its output's tail says why
        print(f"kvlab: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:  # Ctrl-C: what kvlab writes is atomic, so nothing is left half-done
        print("kvlab: interrupted", file=sys.stderr)
        return 130


def _one_line(e: BaseException) -> str:
    if isinstance(e, OSError) and e.strerror:  # e.g. "No space left on device: '/path'"
        return f"{e.strerror}: {e.filename!r}" if e.filename else e.strerror
    return " ".join(str(e).split()) or type(e).__name__
