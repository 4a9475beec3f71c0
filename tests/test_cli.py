"""The kvlab command: JSON on stdout, clear errors with exit status 2."""

import importlib
import json
import subprocess
import sys

import pytest

import kvlab.cli
from kvlab.cli import build_parser, main
from kvlab.cli.parser import BENCH_WHAT, COMMAND_MODULES


def run(*args):
    return subprocess.run([sys.executable, "-m", "kvlab", *args], capture_output=True, text=True)


def _subcommands() -> dict:
    return next(a for a in build_parser()._actions if a.dest == "command").choices


def test_docstring_lists_every_subcommand_and_every_bench_measurement():
    doc = kvlab.cli.__doc__
    assert all(f"- ``{name}" in doc for name in _subcommands()), doc
    assert all(f"- ``{what}``: " in doc for what in BENCH_WHAT), doc


def test_every_subcommand_has_a_handler_in_its_module():
    assert set(COMMAND_MODULES) == set(_subcommands())
    for name, module in COMMAND_MODULES.items():
        assert callable(getattr(importlib.import_module(f"kvlab.cli.{module}"), "cmd_" + name.replace("-", "_")))


HELP_THEN_LIST_MODULES = """
import sys
from kvlab.cli import main
try:
    main(["bench", "--help"])
except SystemExit as e:
    assert e.code == 0
print([m for m in ("transformers", "kvlab.hf", "kvlab.cli.bench") if m in sys.modules], file=sys.stderr)
"""


def test_help_loads_no_model_code():
    """A command's module is imported only when the command runs: ``kvlab --help`` stays fast."""
    r = subprocess.run([sys.executable, "-c", HELP_THEN_LIST_MODULES], capture_output=True, text=True)
    assert r.returncode == 0 and r.stdout.startswith("usage: kvlab bench"), r.stderr
    assert r.stderr.strip().splitlines()[-1] == "[]"


def test_size_acceptance_figures(capsys):
    assert main(["size", "--model", "llama-2-7b", "--dtype", "fp16", "--tokens", "4096", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["total_bytes"] == 2 * 2**30 and out["bytes_per_token"] == 512 * 1024
    assert main(["size", "--model", "llama-2-70b", "--dtype", "fp16", "--tokens", "4096", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["total_bytes"] == 1.25 * 2**30


def test_info_json(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert {"device", "triton_interpret", "torch", "transformers", "models"} <= info.keys()


def test_generate_tiny_json_matches_hf(capsys, tiny):
    from kvlab.generate import hf_generate

    assert main(["generate", "--model", "tiny", "--cache", "static", "--prompt", "hello", "--max-tokens", "7",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    model, tok = tiny
    assert out["token_ids"] == hf_generate(model, [tok.encode("hello")], 7, eos_token_id=tok.eos_token_id)[0]
    assert out["cache_stats"]["kind"] == "static" and "text" in out


def test_generate_paged_json_reports_block_stats(capsys, tiny):
    outs = {}
    for cache, extra in (("static", []), ("paged", ["--block-size", "4"])):
        assert main(["generate", "--model", "tiny", "--cache", cache, *extra, "--prompt", "hello world",
                     "--max-tokens", "9", "--json"]) == 0
        outs[cache] = json.loads(capsys.readouterr().out)
    paged = outs["paged"]
    assert paged["token_ids"] == outs["static"]["token_ids"]
    assert {"blocks_used", "empty_slot_share", "prefix_hits"} <= paged.keys()
    assert paged["cache_stats"]["block_size"] == 4


@pytest.mark.slow
def test_generate_acceptance_command_matches_hf_default_cache(smollm2):
    from kvlab.generate import hf_generate

    r = run("generate", "--model", "smollm2-135m", "--cache", "static", "--prompt", "Once upon a time",
            "--max-tokens", "24", "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    model, tok = smollm2
    ids = tok.encode("Once upon a time")
    ref = model.generate(__import__("torch").tensor([ids]), max_new_tokens=24, do_sample=False)[0, len(ids):]
    assert out["token_ids"] == ref.tolist()
    assert out["token_ids"] == hf_generate(model, [ids], 24, eos_token_id=tok.eos_token_id)[0]


@pytest.mark.parametrize("args,message", [
    (["generate", "--model", "no-such-model", "--prompt", "hi"], "unknown model"),
    (["generate", "--model", "tiny", "--cache", "ring", "--prompt", "hi"], "invalid choice"),
    (["generate", "--model", "tiny", "--max-tokens", "0", "--prompt", "hi"], "must be >= 1"),
    (["generate", "--model", "tiny", "--max-tokens", "-4", "--prompt", "hi"], "must be >= 1"),
    (["generate", "--model", "tiny", "--prompt", ""], "non-empty"),
    (["generate", "--model", "tiny", "--prompt", "   "], "non-empty"),
    (["generate", "--model", "tiny", "--cache", "static", "--max-seq-len", "3", "--prompt", "a long prompt"],
     "longer than the static cache's max_seq_len=3"),
    (["size", "--model", "gpt-9000"], "unknown model"),
    (["size", "--model", "llama-2-7b", "--dtype", "int8", "--scales", "per-row"], "scales must be one of"),
    (["size", "--tokens", "0"], "must be >= 1"),
    (["generate", "--model", "tiny", "--cache", "paged", "--block-size", "12", "--prompt", "hi"],
     "block_size must be a power of two"),
    (["generate", "--model", "tiny", "--cache", "paged", "--num-blocks", "1", "--prompt", "a prompt over 16 bytes"],
     "the whole pool has 1"),
])
def test_bad_input_exits_2_with_a_clear_message(args, message, capsys):
    try:
        code = main(args)
    except SystemExit as e:  # argparse's own errors
        code = e.code
    assert code == 2
    assert message in capsys.readouterr().err


def test_module_entry_point_reports_errors_without_a_traceback():
    r = run("generate", "--model", "no-such-model", "--prompt", "hi")
    assert r.returncode == 2
    assert r.stderr.startswith("kvlab: error: unknown model") and "Traceback" not in r.stderr


def test_bench_memory_and_recompute(capsys):
    assert main(["bench", "memory", "--workload", "alpaca", "--requests", "16", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["policy"] for r in out["policies"]] == ["max", "pow2", "oracle", "paged"]
    assert out["block_size_sweep"][0]["block_size"] == 1
    assert main(["bench", "recompute", "--model", "tiny", "--prompt-lens", "4", "32", "--new-tokens", "3",
                 "--json"]) == 0
    rows = json.loads(capsys.readouterr().out)["rows"]
    assert [r["prompt_tokens"] for r in rows] == [4, 32] and all(r["same_tokens"] for r in rows)


@pytest.mark.slow
def test_bench_static_vs_paged(capsys, smollm2):
    assert main(["bench", "static", "--new-tokens", "8", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    loose, tight, paged = res.values()
    assert loose["utilization"] < tight["utilization"] <= 1 and paged["utilization"] <= 1


def test_generate_engine_serves_several_prompts_concurrently(capsys, tiny):
    from kvlab.generate import hf_generate

    model, tok = tiny
    assert main(["generate", "--model", "tiny", "--engine", "--attn-backend", "reference", "--prompt", "hello",
                 "--prompt", "a longer prompt", "--max-tokens", "6", "--max-num-seqs", "1", "--block-size", "4",
                 "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert [r["prompt"] for r in out["requests"]] == ["hello", "a longer prompt"]
    for r in out["requests"]:
        ref = hf_generate(model, [tok.encode(r["prompt"])], 6, eos_token_id=tok.eos_token_id)[0]
        assert r["token_ids"] == ref
        assert {"ttft_s", "tpot_s", "e2e_s", "queue_s", "preemptions"} <= r["metrics"].keys()
    assert out["engine"]["max_num_seqs"] == 1 and out["engine"]["requests"] == 2
    assert out["requests"][1]["metrics"]["queue_s"] > out["requests"][0]["metrics"]["queue_s"]  # it waited
    assert main(["generate", "--model", "tiny", "--engine", "--prompt", "hello", "--max-tokens", "3", "--json"]) == 0
    single = json.loads(capsys.readouterr().out)
    assert {"text", "token_ids", "metrics", "engine", "cache_stats"} <= single.keys()


@pytest.mark.parametrize("args,message", [
    (["--temperature", "-1"], "temperature must be a finite number >= 0"),
    (["--top-p", "0"], "top_p must be in (0, 1]"),
    (["--cache", "static"], "--engine serves from a paged pool"),
    (["--num-blocks", "1"], "the whole pool has 1"),
])
def test_generate_engine_bad_input(args, message, capsys):
    assert main(["generate", "--model", "tiny", "--engine", "--prompt", "a prompt over sixteen bytes", *args]) == 2
    assert message in capsys.readouterr().err


def test_bench_engine_on_tiny(capsys):
    assert main(["bench", "engine", "--model", "tiny", "--num-requests", "6", "--max-num-seqs", "3", "--scale", "0.1",
                 "--systems", "kvlab_continuous", "kvlab_static", "hf_generate", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res["systems"]) == {"kvlab_continuous", "kvlab_static", "hf_generate"}
    c = res["systems"]["kvlab_continuous"]
    assert c["throughput_vs_kvlab"] == 1.0 and c["output_tokens"] == res["workload"]["output_tokens_total"]
    assert 0 <= res["scheduler_overhead_share"] < 1
    assert res["systems"]["hf_generate"]["useful_share"] <= 1


def test_bench_engine_poisson_arrivals(capsys):
    assert main(["bench", "engine", "--model", "tiny", "--num-requests", "6", "--max-num-seqs", "2", "--scale", "0.05",
                 "--arrival", "poisson", "--rate", "200", "--systems", "kvlab_continuous", "hf_generate",
                 "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["workload"]["arrival"] == "poisson" and res["workload"]["rate"] == 200
    for row in res["systems"].values():
        assert row["output_tokens"] == res["workload"]["output_tokens_total"] and row["ttft_p50_s"] >= 0


def test_make_workload_rejects_bad_arguments(tiny):
    from kvlab.bench.engine import make_workload

    _, tok = tiny
    with pytest.raises(ValueError, match="arrival must be 'all' or 'poisson'"):
        make_workload(tok, 4, arrival="burst")
    with pytest.raises(ValueError, match="rate must be > 0"):
        make_workload(tok, 4, arrival="poisson", rate=0)
    with pytest.raises(ValueError, match=r"scale must be in \(0, 1\]"):
        make_workload(tok, 4, scale=2)
    wl = make_workload(tok, 5, arrival="poisson", rate=10, seed=3)
    assert wl.arrivals == sorted(wl.arrivals) and wl.arrivals[0] == 0.0 and len(set(wl.arrivals)) == 5


@pytest.mark.triton  # the correctness sweep runs the kernels; without triton: tests/test_platform.py
def test_bench_kernels_on_the_cpu_prints_the_projection(capsys):
    assert main(["bench", "kernels", "--batches", "1", "8", "--contexts", "1024", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["mode"] == "interpreter" and "measured" not in res  # no GPU here: no timings pretended
    # 3 cases x (fp16 + int8 and k8v4 by the variants the interpreter runs: cast, magic, dot8)
    assert all(c["ok"] for c in res["checks"]) and len(res["checks"]) == 21
    assert {c["convert"] for c in res["checks"]} == {"cast", "magic", "dot8"}
    assert res["conversions_exact"] == {"cast": True, "magic": True, "int4 magic": True}
    assert res["projection"]["label"].startswith("PROJECTION")
    rows = res["projection"]["rows"]
    assert {(r["shape"], r["batch"]) for r in rows} == {(s, b) for s in ("smollm2-135m", "llama-3-8b") for b in (1, 8)}
    for r in rows:
        b = r["bytes_per_step"]
        assert set(b) == {"fp16", "int8", "k8v4"} and b["k8v4"] < b["int8"] < 0.52 * b["fp16"]
        assert r["bytes_per_step_int8_unfused"] > b["fp16"]
        assert r["projection_ms"]["H200"]["fp16"] < r["projection_ms"]["A100"]["fp16"]
        assert r["model_us"]["int8 cast"]["bound_us"] >= r["model_us"]["int8 magic"]["bound_us"]


@pytest.mark.triton  # the correctness sweep runs the kernels; without triton: tests/test_platform.py
def test_bench_kernels_table_and_bad_input(capsys):
    assert main(["bench", "kernels", "--shapes", "smollm2-135m", "--batches", "4", "--contexts", "256"]) == 0
    out = capsys.readouterr().out
    assert "correctness: 21/21" in out and "PROJECTION" in out and "smollm2-135m" in out
    with pytest.raises(SystemExit):
        main(["bench", "kernels", "--batches", "0"])
    assert "--batches" in capsys.readouterr().err


def test_bench_engine_without_the_vllm_peer_says_how_to_get_it(capsys, monkeypatch, tmp_path):
    monkeypatch.setenv("KVLAB_VLLM_PYTHON", str(tmp_path / "no-such-python"))
    assert main(["bench", "engine", "--model", "tiny", "--num-requests", "3", "--max-num-seqs", "2", "--scale", "0.05",
                 "--systems", "kvlab_continuous", "vllm", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert set(res["systems"]) == {"kvlab_continuous"}
    assert "make peer" in res["skipped"]["vllm"] or "Linux" in res["skipped"]["vllm"]
    # nothing left to run: exit 2 with one line, not a traceback
    assert main(["bench", "engine", "--model", "tiny", "--num-requests", "3", "--systems", "vllm"]) == 2
    assert "nothing to run" in capsys.readouterr().err


def test_bench_engine_when_the_vllm_peer_fails_says_so_with_its_output(capsys, monkeypatch, tmp_path):
    """A peer that starts and dies: exit status 1 (not bad input, not a traceback) and the tail of its output."""
    fake = tmp_path / "python"
    fake.write_text("#!/bin/sh\necho 'ImportError: no module named vllm' >&2\nexit 3\n")
    fake.chmod(0o755)
    monkeypatch.setenv("KVLAB_VLLM_PYTHON", str(fake))
    monkeypatch.setattr("kvlab.bench.engine.model_folder", lambda model: str(tmp_path))  # the tiny model has none
    assert main(["bench", "engine", "--model", "tiny", "--num-requests", "3", "--max-num-seqs", "2", "--scale", "0.05",
                 "--systems", "kvlab_continuous", "vllm_eager"]) == 1
    err = capsys.readouterr().err
    assert "kvlab: vLLM peer stopped (exit 3):" in err and "no module named vllm" in err and "Traceback" not in err


def test_bench_engine_repeat_takes_turns_and_reports_medians(capsys):
    assert main(["bench", "engine", "--model", "tiny", "--num-requests", "3", "--max-num-seqs", "2", "--scale", "0.05",
                 "--systems", "kvlab_continuous", "kvlab_static", "--repeat", "3", "--json"]) == 0
    res = json.loads(capsys.readouterr().out)
    assert res["repeat"] == 3
    for row in res["systems"].values():
        runs = row["output_tok_s_runs"]
        assert len(runs) == 3 and row["output_tok_s"] == sorted(runs)[1]  # the median run
        assert len(row["throughput_vs_kvlab_paired"]) == 3
    with pytest.raises(SystemExit):  # argparse refuses it, naming the option
        main(["bench", "engine", "--model", "tiny", "--repeat", "0"])
    assert "--repeat must be >= 1" in capsys.readouterr().err
