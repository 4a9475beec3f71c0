"""The vLLM side of ``kvlab bench engine --systems vllm ...`` and of the bridge test: a script run by
the PEER environment's Python (``make peer``: ``.venv-vllm``); it imports nothing from kvlab (the
peer has vLLM's own transformers) and talks through JSON files::

    .venv-vllm/bin/python kvlab/bench/vllm_worker.py session job.json out_dir   # serves on "serve" lines
    .venv-vllm/bin/python kvlab/bench/vllm_worker.py scales  job.json result.json
    .venv-vllm/bin/python kvlab/bench/vllm_worker.py options job.json result.json  # --kv-cache-dtype etc.

:mod:`kvlab.bench.vllm_peer` is kvlab's half.
"""

import dataclasses
import json
import os
import sys
import time
import typing

# Python put this file's folder (kvlab/bench) first on sys.path: its kernels.py would shadow the
# `kernels` package transformers probes for. The peer needs nothing from this folder.
if sys.path and os.path.abspath(sys.path[0] or ".") == os.path.dirname(os.path.abspath(__file__)):
    sys.path.pop(0)

import torch  # noqa: E402  (the peer's own torch: 2.13.0+cpu, as kvlab's)


# What each attention layer holds, read inside vLLM's worker process (LLM.apply_model pickles the
# function by reference, so it must live in a module that process can import: written next to the job)
PROBE_MODULE = "kvlab_vllm_probe"
PROBE_SOURCE = """
def layer_scales(model):
    out = []
    for name, mod in model.named_modules():
        if hasattr(mod, "kv_cache_dtype") and hasattr(mod, "_k_scale"):
            out.append({"name": name, "kv_cache_dtype": str(mod.kv_cache_dtype),
                        "k_scale": mod._k_scale.detach().float().flatten().tolist(),
                        "v_scale": mod._v_scale.detach().float().flatten().tolist()})
    return out
"""


def _probe():
    here = os.getcwd()
    with open(os.path.join(here, PROBE_MODULE + ".py"), "w") as f:
        f.write(PROBE_SOURCE)
    os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (here, os.environ.get("PYTHONPATH")) if p)
    sys.path.insert(0, here)
    return __import__(PROBE_MODULE).layer_scales


def _llm(job):
    from vllm import LLM  # the peer environment's vLLM: only this script imports it
    kw = dict(model=job["model"], dtype=job.get("dtype", "float32"), seed=0,
              max_num_seqs=job.get("max_num_seqs", 16), enable_prefix_caching=job.get("enable_prefix_caching", True),
              block_size=job.get("block_size", 32), enforce_eager=job.get("enforce_eager", False),
              kv_cache_dtype=job.get("kv_cache_dtype", "auto"), max_model_len=job.get("max_model_len", 2048))
    for key in ("max_num_batched_tokens", "kv_cache_memory_bytes"):  # else vLLM's default
        if job.get(key):
            kw[key] = job[key]
    return LLM(**kw)


def _params(max_tokens, ignore_eos=True):
    from vllm import SamplingParams  # the peer environment's vLLM
    return SamplingParams(max_tokens=max_tokens, min_tokens=max_tokens if ignore_eos else 0, ignore_eos=ignore_eos,
                          temperature=0.0, detokenize=False)


def _warm(engine, prompts, n=2):
    """A tiny run first, so no first-call set-up lands in the timing."""
    for i in range(min(n, len(prompts))):
        engine.add_request(f"warm{i}", {"prompt_token_ids": prompts[i]}, _params(2))
    while engine.has_unfinished_requests():
        engine.step()


def _serve_once(engine, job, tag=""):
    """job["prompts"] with job["output_lens"] at job["arrivals"] through ``engine``, stepped by hand."""
    prompts, outs, arrivals = job["prompts"], job["output_lens"], job["arrivals"]
    order = sorted(range(len(prompts)), key=lambda i: arrivals[i])
    reqs = {}
    t0 = time.perf_counter()
    while order or engine.has_unfinished_requests():
        while order and t0 + arrivals[order[0]] <= time.perf_counter():
            i = order.pop(0)
            reqs[i] = {"arrival": t0 + arrivals[i], "first_token": None, "finish": None, "token_ids": []}
            engine.add_request(f"{tag}r{i}", {"prompt_token_ids": prompts[i]}, _params(outs[i]))
        if engine.has_unfinished_requests():
            for out in engine.step():
                now = time.perf_counter()
                r = reqs[int(out.request_id.rsplit("r", 1)[1])]
                if out.outputs and out.outputs[0].token_ids:
                    if r["first_token"] is None:
                        r["first_token"] = now
                    r["token_ids"] = list(out.outputs[0].token_ids)
                if out.finished:
                    r["finish"] = now
        elif order:
            time.sleep(max(0.0, t0 + arrivals[order[0]] - time.perf_counter()))
    return {"requests": [dict(reqs[i], t0=t0) for i in sorted(reqs)], "vllm": _versions()}


def session(job, out_dir):
    """Start vLLM once; each "serve" line on stdin writes out_dir/result-N.json, then "KVLAB-DONE N"."""
    engine = _llm(job).llm_engine
    _warm(engine, job["prompts"], job.get("warm_up", 2))
    print("KVLAB-READY", flush=True)
    for n, line in enumerate(sys.stdin):
        if line.strip() != "serve":
            break
        result = _serve_once(engine, job, tag=f"s{n}")
        path = os.path.join(out_dir, f"result-{n}.json")
        with open(path + ".tmp", "w") as f:
            json.dump(result, f)
        os.replace(path + ".tmp", path)
        print(f"KVLAB-DONE {n}", flush=True)


def scales(job):
    """What job["model"]'s attention layers hold in vLLM, and greedy tokens of job["prompts"]."""
    layer_scales = _probe()  # before the engine starts its worker, which inherits PYTHONPATH
    try:
        llm = _llm(job)
    except Exception as e:  # vLLM's own refusal is a result: the bridge test asserts it
        return {"refused": f"{type(e).__name__}: {e}", "vllm": _versions()}
    layers = llm.apply_model(layer_scales)
    layers = layers[0] if layers and isinstance(layers[0], list) else layers
    outs = llm.generate([{"prompt_token_ids": p} for p in job.get("prompts", [])],
                        _params(job.get("max_tokens", 8), ignore_eos=True), use_tqdm=False)
    return {"layers": layers, "token_ids": [list(o.outputs[0].token_ids) for o in outs], "vllm": _versions()}


def options(job):
    """vLLM's KV-cache options as its own config declares them: the --kv-cache-dtype choices, whether
    listed layers can be left unquantized (--kv-cache-dtype-skip-layers), the default --block-size."""
    import vllm  # the peer environment's vLLM, imported only by the command that needs it
    from vllm.config import cache  # its CacheConfig declares the KV-cache options
    fields = {f.name: f for f in dataclasses.fields(cache.CacheConfig)}
    kind = fields["cache_dtype"].type  # a Literal of names: one choice for the engine; a dict or list: per layer
    per_layer = any(w in str(kind).lower() for w in ("dict[", "list["))  # also inside Optional[...] / X | None
    return {"vllm": vllm.__version__, "kv_cache_dtypes": list(typing.get_args(cache.CacheDType)),
            "skip_layers": "kv_cache_dtype_skip_layers" in fields, "dtype_scope": "layer" if per_layer else "engine",
            "default_block_size": getattr(cache.CacheConfig, "DEFAULT_BLOCK_SIZE", None) or fields["block_size"].default}


def _versions():
    import vllm  # the peer environment's vLLM
    return {"vllm": vllm.__version__, "torch": torch.__version__, "threads": torch.get_num_threads()}


def main(argv):
    if len(argv) != 3 or argv[0] not in ("scales", "session", "options"):
        raise SystemExit("usage: vllm_worker.py scales|options JOB.json RESULT.json, or session JOB.json OUT_DIR")
    with open(argv[1]) as f:
        job = json.load(f)
    if argv[0] == "session":
        session(job, argv[2])
        return
    result = scales(job) if argv[0] == "scales" else options(job)
    with open(argv[2] + ".tmp", "w") as f:
        json.dump(result, f)
    os.replace(argv[2] + ".tmp", argv[2])


if __name__ == "__main__":  # vLLM's engine spawns worker processes: they re-import this file
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    os.environ.setdefault("VLLM_ALLOW_INSECURE_SERIALIZATION", "1")  # LLM.apply_model sends a function
    os.environ.setdefault("VLLM_CONFIGURE_LOGGING", "0")
    main(sys.argv[1:])
