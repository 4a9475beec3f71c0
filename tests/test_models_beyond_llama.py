"""Models beyond Llama (README section of that name): a matrix of tiny random HF architectures, every cache against HF.

Each architecture in :data:`kvlab.models.TINY_ARCHS` is built from its config alone (2 layers, 4
query heads on 2 KV heads where it has GQA, random weights, fp32). For those the paged path runs,
every way kvlab decodes must give the tokens of HF's own ``generate()``; the others must be refused
up front with one line that names the model and the feature. The last tests break each feature on
purpose and check that the matrix notices: a matrix that passes whatever the attention does would
prove nothing.
"""

from __future__ import annotations

import functools

import pytest
import torch

from kvlab.cache import BlockManager
from kvlab.cache.paged_storage import PagedKVCache
from kvlab.engine import LLM, SamplingParams
from kvlab.generate import greedy_generate, hf_generate, paged_generate
from kvlab.hf import UnsupportedModelError
from kvlab.probe import paged_attention_spec
from kvlab.models import TINY_ARCHS, tiny_model

PROMPTS = [list(range(3, 8)), list(range(10, 27)), list(range(40, 70))]  # 5, 17, 30 tokens: past a window of 8
NEW = 12
RUNS = [a for a, (_, _, paged) in TINY_ARCHS.items() if paged == "runs"]
REFUSED = [a for a, (_, _, paged) in TINY_ARCHS.items() if paged == "refused"]
TRITON = pytest.mark.triton


@functools.cache
def model(arch):
    return tiny_model(arch)


@functools.cache
def reference(arch) -> list[list[int]]:
    ref = hf_generate(model(arch), PROMPTS, NEW)
    # a degenerate random model would let a broken cache pass: its tokens must vary, and must depend on the
    # context (at HF's default init a random tiny BLOOM continues a prompt exactly as it continues its last
    # token alone, so every cache, even none, "matches" HF on it)
    assert len({t for row in ref for t in row}) >= 6, f"{arch}: the random model's tokens are too uniform to test with"
    assert hf_generate(model(arch), [PROMPTS[2][-1:]], NEW)[0] != ref[2], f"{arch}: its tokens ignore the context"
    return ref


def engine_tokens(m, backend="torch", **kw) -> list[list[int]]:
    kw = {"num_blocks": 64, "block_size": 4, "max_num_seqs": 4, "max_num_batched_tokens": 16, **kw}
    llm = LLM(m, None, attn_backend=backend, **kw)  # 16 tokens a step: the 30-token prompt prefills in chunks
    out = llm.generate(PROMPTS, SamplingParams(max_tokens=NEW))
    llm.block_manager.check_invariants()
    return [o.token_ids for o in out]


def test_the_matrix_covers_the_architectures_the_issue_names():
    types = {TINY_ARCHS[a][0] for a in RUNS}
    assert {"llama", "qwen2", "qwen3", "mistral", "gemma2", "gemma3_text", "phi3"} <= types
    assert {"mixtral", "qwen2_moe"} & types  # at least one MoE
    assert TINY_ARCHS["mistral"][1]["sliding_window"] < min(map(len, PROMPTS[1:]))  # the window is exceeded


@pytest.mark.parametrize("arch", RUNS)
def test_dynamic_and_static_caches_give_hf_tokens(arch):
    m, ref = model(arch), reference(arch)
    assert greedy_generate(m, PROMPTS, NEW, cache="dynamic").token_ids == ref
    assert greedy_generate(m, PROMPTS, NEW, cache="static").token_ids == ref


@pytest.mark.parametrize("block_size", [1, 16])
@pytest.mark.parametrize("arch", RUNS)
def test_paged_cache_gives_hf_tokens_with_a_prefix_hit(arch, block_size):
    m, ref = model(arch), reference(arch)
    manager = BlockManager(64 * 16 // block_size, block_size)
    cache = PagedKVCache.from_model(m, manager.num_blocks, block_size)
    first = paged_generate(m, PROMPTS, NEW, manager=manager, cache=cache)
    assert first.token_ids == ref
    again = paged_generate(m, [PROMPTS[2]], NEW, manager=manager, cache=cache)  # its blocks are in the prefix cache
    assert again.cache_stats["cached_prompt_tokens"] >= 16
    assert again.token_ids == [ref[2]]
    manager.check_invariants()


@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("arch", RUNS)
def test_engine_gives_hf_tokens(arch, backend):
    assert engine_tokens(model(arch), backend) == reference(arch)


@functools.cache
def calibration(arch):
    from kvlab.calibrate import calibrate

    return calibrate(model(arch), [list(range(3, 120)), list(range(120, 250))], progress=False)


@pytest.mark.parametrize("arch", RUNS)
def test_quantized_paged_path_runs(arch):
    """An FP32 "quantized" pool goes through the quantized attention (online softmax over dequantized
    tiles) and must still give HF's tokens; an INT8 pool, calibrated on this model, must decode the same
    tokens through the reference and the batched path, which read the same INT8 blocks, and stay close
    to FP where greedy decoding cannot hide it: teacher-forced next-token KL and top-1 (``kvlab.eval``)."""
    from kvlab.eval import evaluate
    from kvlab.quant import named_config

    m, ref = model(arch), reference(arch)
    assert engine_tokens(m, "torch", kv_cache_dtype="fp32") == ref
    int8 = {b: engine_tokens(m, b, kv_cache_dtype="int8", calibration=calibration(arch)) for b in ("reference", "torch")}
    assert int8["reference"] == int8["torch"]
    text = list(range(3, 100)) + list(range(50, 150))  # windows of 64 in chunks of 8: every chunk reads INT8 blocks
    q = evaluate(m, text, {"int8": named_config("int8")}, calibration(arch), window=64, stride=32, chunk=8)
    q = q["configs"]["int8"]
    assert q["kl"] < 0.1 and q["top1"] > 0.8, (arch, q["kl"], q["top1"])  # measured: KL <= 0.043, top-1 >= 0.85


@TRITON
@pytest.mark.parametrize("arch, kv_cache_dtype", [("gemma2", "auto"), ("gpt-oss", "auto"), ("gemma2", "int8")])
def test_triton_engine_gives_hf_tokens(arch, kv_cache_dtype):
    """The kernels honour the window and the soft cap (Gemma-2), the window and the sinks (gpt-oss) and
    Gemma-2's scale (query_pre_attn_scalar ** -0.5, not head_dim ** -0.5), over float and INT8 pools.
    Interpreted on a CPU, so only two models; tests/test_05_kernels.py checks each feature alone."""
    m = model(arch)
    if kv_cache_dtype == "auto":
        assert engine_tokens(m, "triton") == reference(arch)
    else:
        cal = calibration(arch)
        assert engine_tokens(m, "triton", kv_cache_dtype=kv_cache_dtype, calibration=cal) == \
            engine_tokens(m, "torch", kv_cache_dtype=kv_cache_dtype, calibration=cal)


# ---- refused, with one line ------------------------------------------------------------------------

REFUSAL = {  # what the one line must name
    "bloom": "instead of calling transformers' AttentionInterface",
    "llama4": "chunked attention (chunks of 8 tokens)",
    "deepseek-v3": "different head sizes (16 and 8: multi-head latent attention)",
    "phi3-longrope": "RoPE ('longrope')",
}


@pytest.mark.parametrize("arch", REFUSED)
def test_unsupported_models_are_refused_in_one_line_before_any_work(arch, monkeypatch):
    import kvlab.engine.llm

    m = model(arch)
    with pytest.raises(UnsupportedModelError) as e:
        paged_generate(m, PROMPTS, NEW)
    msg = str(e.value)
    assert "\n" not in msg and TINY_ARCHS[arch][0] in msg and REFUSAL[arch] in msg, msg

    def no_pool(*args, **kw):
        raise AssertionError("a pool was allocated for a model that is refused")

    monkeypatch.setattr(kvlab.engine.llm, "make_cache", no_pool)
    with pytest.raises(UnsupportedModelError, match="cannot run"):
        LLM(m, None, num_blocks=8, block_size=4)
    monkeypatch.undo()
    from kvlab.eval import evaluate
    from kvlab.quant import named_config

    with pytest.raises(UnsupportedModelError):
        evaluate(m, list(range(3, 60)), {"fp16": named_config("fp16")}, window=32, stride=16, chunk=8)
    if arch == "deepseek-v3":  # kvlab's other caches store K and V at one shape too, and say so
        assert "'dynamic'" not in msg
        with pytest.raises(ValueError, match="keys/values must both be"):
            greedy_generate(m, PROMPTS, NEW, cache="dynamic")
    else:  # the refusal says the dynamic cache runs it, and it does: HF's own attention
        assert "the 'dynamic' and 'static' caches can" in msg
        assert greedy_generate(m, PROMPTS, NEW, cache="dynamic").token_ids == hf_generate(m, PROMPTS, NEW)


def test_without_the_probe_bloom_would_give_other_tokens_silently(monkeypatch):
    """Why BLOOM is refused: its layers never call the attention function kvlab registers, so in the paged
    path its attention sees neither the cache nor where one packed prompt ends and the next begins."""
    import kvlab.probe as P

    monkeypatch.setattr(P, "_probe", lambda m: (P.LayerAttention(0, 0.25), P.LayerAttention(1, 0.25)))
    m = tiny_model("bloom")  # not the cached one: its refusal is remembered
    assert paged_generate(m, PROMPTS, NEW).token_ids != reference("bloom")


def test_a_sequence_dependent_rope_would_change_a_packed_sequence_s_tokens(monkeypatch):
    """Why phi3-longrope is refused: past 64 positions its RoPE switches to the long factors for the
    whole forward, so a short prompt packed with a long one is encoded with the long prompt's RoPE."""
    import kvlab.probe as P

    m = tiny_model("phi3-longrope")  # not the cached one: its refusal is remembered
    short, long = list(range(3, 20)), list(range(30, 100))
    monkeypatch.setattr(P, "SEQUENCE_DEPENDENT_ROPE", ())  # what kvlab would do without the check
    assert paged_generate(m, [short, long], 8).token_ids[0] != hf_generate(m, [short], 8)[0]
    assert paged_generate(m, [short], 8).token_ids[0] == hf_generate(m, [short], 8)[0]  # alone, no harm


def test_a_model_in_training_mode_with_attention_dropout_is_refused():
    m = tiny_model("llama", attention_dropout=0.1)
    paged_attention_spec(m)  # eval mode: dropout is 0
    m.train()
    try:
        with pytest.raises(UnsupportedModelError, match=r"dropout 0\.1 .*model\.eval\(\)"):
            paged_attention_spec(m)
    finally:
        m.eval()


def test_an_argument_the_paged_attention_does_not_know_is_refused():
    from kvlab.hf import PagedBatch, _paged_attention_forward

    m = model("llama")
    attn = m.model.layers[0].self_attn
    q = torch.zeros(1, 4, 1, 16)
    kv = torch.zeros(1, 2, 1, 16)
    cache = PagedKVCache.from_model(m, 2, 4)
    batch = PagedBatch(cache, [[0]], [1], [1], torch.tensor([0]))
    with pytest.raises(UnsupportedModelError, match="chunk_size"):
        _paged_attention_forward(attn, q, kv, kv, None, kvlab_paged=batch, chunk_size=8)
    assert cache.k_cache[0].abs().sum() == 0  # refused before the write


def test_the_probe_runs_once_per_model_and_again_when_its_config_changes():
    m = tiny_model("mistral")
    calls = []
    hook = m.model.layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
    first = paged_attention_spec(m)
    assert paged_attention_spec(m) is first and len(calls) == 1
    m.config.sliding_window = 4
    assert [a.sliding_window for a in paged_attention_spec(m)] == [4, 4] and len(calls) == 2
    hook.remove()


def test_what_each_layer_needs_is_read_from_the_model():
    spec = {a: [(x.sliding_window, x.softcap, x.sinks) for x in paged_attention_spec(model(a))]
            for a in ("llama", "mistral", "gemma2", "gemma3", "gpt-oss")}
    assert spec["llama"] == [(None, None, False)] * 2
    assert spec["mistral"] == [(8, None, False)] * 2
    assert spec["gemma2"] == [(8, 2.0, False), (None, 2.0, False)]  # local and global layers alternate
    assert spec["gemma3"] == [(8, None, False), (None, None, False)]
    assert spec["gpt-oss"] == [(8, None, True), (None, None, True)]
    assert paged_attention_spec(model("gemma3"))[0].scaling == 256 ** -0.5  # query_pre_attn_scalar, not head_dim


# ---- what the cache keeps under a sliding window ---------------------------------------------------

def test_blocks_out_of_every_window_are_kept_and_counted():
    prompt = list(range(3, 43))  # 40 tokens, window 8, blocks of 4
    mistral = paged_generate(model("mistral"), [prompt], 4, block_size=4)
    s = mistral.cache_stats
    assert s["sliding_window"] == 8
    assert s["blocks_used"] == 11  # 44 tokens at the last step: every block is kept ...
    assert s["blocks_outside_window"] == (43 - 8) // 4  # ... and these are the ones no layer reads anymore
    gemma = paged_generate(model("gemma2"), [prompt], 4, block_size=4).cache_stats  # a global layer reads them all
    assert gemma["sliding_window"] is None and gemma["blocks_outside_window"] == 0


# ---- the matrix can fail: break each feature and it notices ------------------------------------------

@pytest.mark.parametrize("backend", ["reference", "torch"])
@pytest.mark.parametrize("arch, drop", [("mistral", "sliding_window"), ("gemma2", "softcap"), ("gpt-oss", "s_aux"),
                                        ("gemma3", "scaling")])
def test_the_matrix_notices_a_feature_ignored(arch, drop, backend, monkeypatch):
    import kvlab.hf as H

    forward = H._paged_attention_forward

    def ignoring(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kw):
        if drop == "scaling":
            scaling = None  # head_dim ** -0.5, as a function that ignores the argument would use
        kw.pop(drop, None)
        return forward(module, query, key, value, attention_mask, scaling, dropout, **kw)

    monkeypatch.setattr(H, "_paged_attention_forward", ignoring)
    H.register_paged_attention()
    try:
        assert paged_generate(model(arch), PROMPTS, NEW, attn_backend=backend).token_ids != reference(arch)
    finally:
        monkeypatch.undo()
        H.register_paged_attention()
    assert paged_generate(model(arch), PROMPTS, NEW, attn_backend=backend).token_ids == reference(arch)


# ---- the PyTorch attention paths, feature by feature -----------------------------------------------

def _dense(q, k, v, scale, window=None, softcap=None, sinks=None):
    """The textbook formula, one query row at a time: what every path must compute."""
    ctx, q_len, h_q, h_kv = k.shape[0], q.shape[0], q.shape[1], k.shape[1]
    out = torch.empty_like(q)
    for j in range(q_len):
        p = ctx - q_len + j
        lo = 0 if window is None else max(0, p - window + 1)
        for h in range(h_q):
            kk, vv = k[lo:p + 1, h // (h_q // h_kv)], v[lo:p + 1, h // (h_q // h_kv)]
            s = kk @ q[j, h] * scale
            if softcap is not None:
                s = torch.tanh(s / softcap) * softcap
            if sinks is not None:
                s = torch.cat([s, sinks[h:h + 1]])
            w = torch.softmax(s, 0)[:len(kk)]
            out[j, h] = w @ vv
    return out


FEATS = {"window": dict(window=5), "softcap": dict(softcap=1.5),
         "sinks": dict(sinks=torch.tensor([0.5, 2.0, -1.0, 3.0])),
         "all": dict(window=7, softcap=2.0, sinks=torch.tensor([1.0, 0.0, -2.0, 4.0]))}


@pytest.mark.parametrize("feature", list(FEATS))
def test_every_pytorch_path_honours_the_feature(feature):
    from kvlab.attention import (DecodeIndex, batched_decode_attention, paged_attention,
                                 quantized_batched_decode_attention, quantized_paged_attention)
    from kvlab.cache import QuantizedPagedKVCache
    from kvlab.quant.config import FP32

    feat = FEATS[feature]
    g = torch.Generator().manual_seed(2)
    bs, ctx, q_lens = 4, [23, 6, 17], [5, 6, 1]  # a prefill chunk, a whole prompt, a decode
    k, v = torch.randn(sum(ctx), 2, 8, generator=g) * 2, torch.randn(sum(ctx), 2, 8, generator=g)
    pool, fp32 = PagedKVCache(1, 18, bs, 2, 8), QuantizedPagedKVCache(1, 18, bs, 2, 8, FP32)
    tables, start, q, expected, new_rows = [], 0, [], [], []
    for i, (c, ql) in enumerate(zip(ctx, q_lens)):
        table = list(range(6 * i, 6 * i + -(-c // bs)))  # 6 blocks hold the longest context
        slots = torch.tensor([table[t // bs] * bs + t % bs for t in range(c)])
        pool.write(0, k[start:start + c], v[start:start + c], slots)
        fp32.write(0, k[start:start + c - ql], v[start:start + c - ql], slots[:c - ql])  # before this forward
        qi = torch.randn(ql, 4, 8, generator=g)
        expected.append(_dense(qi, k[start:start + c], v[start:start + c], 0.3, **feat))
        q.append(qi)
        new_rows += range(start + c - ql, start + c)
        tables.append(table)
        start += c
    q, expected = torch.cat(q), torch.cat(expected)
    out = paged_attention(q, pool.k_cache[0], pool.v_cache[0], tables, ctx, q_lens, 0.3, **feat)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    rows = torch.tensor(new_rows)
    out = quantized_paged_attention(q, k[rows], v[rows], fp32, 0, tables, ctx, q_lens, 0.3, tile_blocks=2, **feat)
    torch.testing.assert_close(out, expected, atol=1e-5, rtol=0)
    dec = DecodeIndex(tables, ctx, bs)  # every sequence's last token as a decode
    last = [sum(ql for ql in q_lens[:i + 1]) - 1 for i in range(3)]
    out = batched_decode_attention(q[last], pool.k_cache[0], pool.v_cache[0], dec, 0.3, **feat)
    torch.testing.assert_close(out, expected[last], atol=1e-5, rtol=0)
    fp32_all = QuantizedPagedKVCache(1, 18, bs, 2, 8, FP32)
    fp32_all.k[0].data.copy_(pool.k_cache[0])
    fp32_all.v[0].data.copy_(pool.v_cache[0])
    last_rows = rows[last]
    out = quantized_batched_decode_attention(q[last], k[last_rows], v[last_rows], fp32_all, 0, dec, 0.3, **feat)
    torch.testing.assert_close(out, expected[last], atol=1e-5, rtol=0)


@pytest.mark.parametrize("bad, match", [(dict(window=0), "window"), (dict(window=True), "window"),
                                        (dict(softcap=0.0), "softcap"), (dict(softcap="50"), "softcap"),
                                        (dict(sinks=torch.zeros(3)), r"sinks .*\(4,\)"),
                                        (dict(sinks=[0.0] * 4), "sinks")])
def test_bad_features_are_refused_by_name(bad, match):
    from kvlab.attention import DecodeIndex, batched_decode_attention, paged_attention

    pool = PagedKVCache(1, 2, 4, 2, 8)
    q = torch.zeros(1, 4, 8)
    with pytest.raises(ValueError, match=match):
        paged_attention(q, pool.k_cache[0], pool.v_cache[0], [[0]], [3], [1], 0.3, **bad)
    with pytest.raises(ValueError, match=match):
        batched_decode_attention(q, pool.k_cache[0], pool.v_cache[0], DecodeIndex([[0]], [3], 4), 0.3, **bad)
