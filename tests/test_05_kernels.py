"""The Triton kernels against the PyTorch references, under the interpreter on the CPU (notebook 05).

Every output buffer is poisoned (NaN, or a sentinel byte in the pool) before the kernel runs, so an
element the kernel forgot to write fails the comparison instead of passing on leftover zeros.

Tolerances (float32 compute):
- against the reference over the SAME stored values (float pool, or the dequantized reference for
  a quantized pool): 2e-5 absolute (fp32 pools) / 2e-3 (fp16 pools: the reference reads the same
  fp16 values; the difference is the fp32 order of summation).
- against full precision (K/V never quantized), on unit-variance random data: int8 per-head 0.05,
  int8 per-token-head 0.03, K8V4 0.15 (INT4 V: 15 levels per 32-channel group).
"""

import math
import random

import pytest
import torch

import kvlab  # noqa: F401  (switches triton to the interpreter on a CPU-only machine)
from kvlab import kernels as K
from kvlab.attention import DecodeIndex, get_backend, paged_attention, quantized_batched_decode_attention
from kvlab.cache.paged_storage import PagedKVCache
from kvlab.kernels.traffic import count_traffic, decode_traffic, spec_of
from kvlab.quant import core
from kvlab.cache import QuantizedPagedKVCache
from kvlab.quant.config import KVQuantConfig, TensorFormat, named_config

TRITON = get_backend("triton")  # the write and decode kernels applied to a pool (notebook 05)

INTERPRETER = K.triton_mode() == "interpreter"
pytestmark = pytest.mark.triton  # every test here runs a kernel (tests/conftest.py skips them without triton)


def _layout(ctx_lens, block_size, num_blocks, seed=0):
    """Random, non-contiguous block tables for ragged contexts; returns (tables, slots of every token)."""
    rng = random.Random(seed)
    need = sum(-(-c // block_size) for c in ctx_lens)
    ids = rng.sample(range(num_blocks), need)
    tables, slots = [], []
    for c in ctx_lens:
        n = -(-c // block_size)
        t, ids = ids[:n], ids[n:]
        tables.append(t)
        slots += [t[i // block_size] * block_size + i % block_size for i in range(c)]
    return tables, torch.tensor(slots)


def _quant_cache(config, h, d, block_size, num_blocks, k, v, slots):
    """A quantized pool written by the PyTorch path; static scales from the data itself."""
    cal = None
    if config.needs_calibration(1):
        config = KVQuantConfig(config.k, config.v, policy="dynamic", rotate_k=config.rotate_k)
    cache = QuantizedPagedKVCache(1, num_blocks, block_size, h, d, config, cal)
    cache.write(0, k, v, slots)
    return cache


# ---- quantize-on-write ----------------------------------------------------------------------------

WRITE_CONFIGS = {
    "fp32": KVQuantConfig(TensorFormat("fp32"), TensorFormat("fp32")),
    "fp16": KVQuantConfig(TensorFormat("fp16"), TensorFormat("fp16")),
    "int8 per-tensor": named_config("int8", granularity="per-tensor", policy="dynamic"),
    "int8 per-head": named_config("int8", policy="dynamic"),
    "int8 per-channel": named_config("int8", granularity="per-channel", policy="dynamic"),
    "int8 per-token": named_config("int8", granularity="per-token", policy="dynamic"),
    "int8 per-token-head": named_config("int8", granularity="per-token-head", policy="dynamic"),
    "int4 g32": named_config("int4"),
    "int4 g8": KVQuantConfig(TensorFormat("int4", group_size=8), TensorFormat("int4", group_size=8)),
    "k8v4": named_config("k8v4", policy="dynamic"),
}


def _stores(cache):
    return cache.k + cache.v


def _poison(cache):
    for st in _stores(cache):
        st.data.view(torch.uint8).fill_(0xA5)  # a byte pattern no write produces by accident
        for t in (st.token_scale,):
            if t is not None:
                t.fill_(float("nan"))


@pytest.mark.parametrize("name", list(WRITE_CONFIGS))
@pytest.mark.parametrize("h,d", [(2, 64), (3, 128)])
def test_write_kernel_matches_the_pytorch_cache_bit_for_bit(name, h, d):
    config = WRITE_CONFIGS[name]
    g = torch.Generator().manual_seed(1)
    bs, n_blocks = 8, 16
    t = 21  # more than one tile of 16 tokens
    k = torch.randn(t, h, d, generator=g) * 3
    v = torch.randn(t, h, d, generator=g)
    k[4] = 0.0  # an all-zero token: the zero guard (scale 1.0) must hold in the kernel too
    k[7, 0, 5] = 40.0  # an outlier
    slots = torch.randperm(n_blocks * bs, generator=g)[:t]
    slots[[3, 11]] = -1  # padding: nothing written for these tokens
    keep = slots >= 0
    ref = QuantizedPagedKVCache(1, n_blocks, bs, h, d, config)
    got = QuantizedPagedKVCache(1, n_blocks, bs, h, d, config)
    _poison(ref)
    _poison(got)
    ref.write(0, k[keep], v[keep], slots[keep])
    for a, b in zip(_stores(ref), _stores(got)):
        if a.fmt.static_scales:  # the dynamic policy's first write set it; the kernel path keeps it
            b.scale = a.scale.clone()
    TRITON.write(got, 0, k, v, slots)
    for a, b in zip(_stores(ref), _stores(got)):
        assert torch.equal(a.data.view(torch.uint8), b.data.view(torch.uint8)), f"{name}: data bytes differ"
        for x, y in ((a.token_scale, b.token_scale), (a.token_zero, b.token_zero)):
            if x is not None:
                assert torch.equal(x.nan_to_num(-1.0), y.nan_to_num(-1.0)), f"{name}: scales differ"
        for c in ("values", "clipped", "at_qmax"):
            assert torch.equal(a.counts[c], b.counts[c]), (name, c, a.counts[c], b.counts[c])


def test_write_kernel_rounds_half_to_even_and_clamps_like_torch():
    # ties at every magnitude, both signs, and values far beyond the range
    scale = torch.tensor([[[0.5]]])
    steps = torch.tensor([0.5, 1.5, 2.5, 3.5, -0.5, -1.5, -2.5, 126.5, -126.5, 127.4, 127.6, 300.0, -300.0, 0.49999997])
    x = (steps * 0.5).reshape(1, 1, -1).repeat(1, 1, 1)
    x = torch.nn.functional.pad(x, (0, 64 - x.shape[-1]))
    cache = QuantizedPagedKVCache(1, 4, 4, 1, 64, named_config("int8", granularity="per-tensor", policy="dynamic"))
    for st in _stores(cache):
        st.scale = scale.clone()
    TRITON.write(cache, 0, x, x, torch.tensor([5]))
    got = cache.k[0].data.view(-1, 64)[5]
    assert torch.equal(got, core.quantize_int8(x[0, 0], scale[0, 0]))
    assert got[:11].tolist() == [0, 2, 2, 4, 0, -2, -2, 126, -126, 127, 127]
    assert int(cache.k[0].counts["clipped"][0]) == 3  # 127.6, 300, -300 lie beyond 127.5 steps


def test_plain_triton_cast_truncates_and_wraps_which_is_why_the_kernel_rounds():
    trunc, rounded = K.cast_demo(torch.tensor([2.5, 2.7, -2.7, 126.6, 130.0, -200.0]))
    assert rounded.tolist() == [2, 3, -3, 127, 127, -127]
    assert trunc[:3].tolist() == [2, 2, -2]  # toward zero, not to nearest
    if INTERPRETER:  # numpy's cast wraps out-of-range values; compiled code leaves them undefined
        assert trunc[4:].tolist() == [-126, 56]


def test_write_kernel_rejects_what_it_cannot_store_and_touches_nothing():
    cache = QuantizedPagedKVCache(1, 4, 4, 2, 16, named_config("fp8", policy="dynamic"))
    before = cache.k[0].data.clone()
    with pytest.raises(ValueError, match="stored as .fp8 per-tensor.; attn_backend=.triton. handles"):
        TRITON.write(cache, 0, torch.randn(2, 2, 16), torch.randn(2, 2, 16), torch.tensor([0, 1]))
    assert torch.equal(cache.k[0].data.view(torch.uint8), before.view(torch.uint8))
    assert cache.k[0].scale is None and int(cache.k[0].counts["values"].sum()) == 0  # no scale set, nothing counted
    asym = QuantizedPagedKVCache(1, 4, 4, 2, 16, KVQuantConfig(TensorFormat("int8"), TensorFormat("int4", group_size=8, symmetric=False),
                                                               policy="dynamic"))
    with pytest.raises(ValueError, match="attn_backend='triton' handles"):
        TRITON.check(asym)
    pool = PagedKVCache(1, 4, 4, 2, 16)
    with pytest.raises(ValueError, match="slot_mapping must have one slot per token"):
        TRITON.write(pool, 0, torch.randn(3, 2, 16), torch.randn(3, 2, 16), torch.tensor([0, 1]))
    before = pool.k_cache[0].clone()
    with pytest.raises(ValueError, match=r"slots in 0\.\.15 or -1"):
        TRITON.write(pool, 0, torch.randn(2, 2, 16), torch.randn(2, 2, 16), torch.tensor([3, 16]))
    assert torch.equal(pool.k_cache[0], before)  # nothing written
    with pytest.raises(ValueError, match="NaN/Inf"):
        TRITON.write(cache_q := QuantizedPagedKVCache(1, 4, 4, 2, 16, named_config("int8", policy="dynamic")), 0,
                         torch.full((1, 2, 16), float("nan")), torch.zeros(1, 2, 16), torch.tensor([0]))
    assert cache_q.k[0].scale is None  # rejected before any scale was set
    with pytest.raises(ValueError, match="slot_mapping must hold slots"):
        TRITON.write(cache_q, 0, torch.zeros(1, 2, 16), torch.zeros(1, 2, 16), torch.tensor([99]))
    assert cache_q.k[0].scale is None


# ---- paged decode attention -----------------------------------------------------------------------

DECODE_CASES = [
    # (h_q, h_kv, d, block_size, ctx_lens, num_splits)
    (3, 3, 64, 16, [1, 15, 17, 100], 1),  # GQA 1, ctx 1, non-multiples of the block size
    (9, 3, 64, 16, [1, 15, 17, 100], 1),  # GQA 3 (SmolLM2)
    (8, 2, 128, 8, [33, 7, 200], 3),  # GQA 4, head_dim 128, splits
    (8, 1, 64, 32, [5, 250], 7),  # GQA 8, more splits than a short context has tiles: empty splits
    (4, 2, 128, 32, [300], 3),  # one long sequence cut in three: every split holds tokens
    (6, 2, 64, 8, [64, 63, 65], 16),  # more splits than tiles for everyone
]


def _nan_out(q):
    return torch.full_like(q, float("nan"))


@pytest.mark.parametrize("h_q,h_kv,d,block_size,ctx,splits", DECODE_CASES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16])
def test_decode_kernel_equals_paged_attention_on_a_float_pool(h_q, h_kv, d, block_size, ctx, splits, dtype):
    g = torch.Generator().manual_seed(len(ctx) * 7 + d)
    n_blocks = 64
    tables, slots = _layout(ctx, block_size, n_blocks, seed=d)
    pool = PagedKVCache(1, n_blocks, block_size, h_kv, d, dtype=dtype)
    pool.k_cache[0].fill_(float("nan"))  # only written slots may be read
    pool.v_cache[0].fill_(float("nan"))
    k, v = torch.randn(len(slots), h_kv, d, generator=g), torch.randn(len(slots), h_kv, d, generator=g)
    TRITON.write(pool, 0, k, v, slots)
    q = torch.randn(len(ctx), h_q, d, generator=g).to(dtype)
    idx = DecodeIndex(tables, ctx, block_size)
    out = TRITON.decode(q, pool, 0, idx, d ** -0.5, num_splits=splits, out=_nan_out(q))
    ref = paged_attention(q.float(), pool.k_cache[0].float().nan_to_num(), pool.v_cache[0].float().nan_to_num(),
                          tables, ctx, [1] * len(ctx), d ** -0.5)
    tol = 2e-5 if dtype == torch.float32 else 2e-3
    assert out.dtype == dtype
    torch.testing.assert_close(out.float(), ref, atol=tol, rtol=0)
    # one query head per program (no GQA grouping) computes the same thing
    alone = TRITON.decode(q, pool, 0, idx, d ** -0.5, group_heads=False, pages=1, out=_nan_out(q))
    torch.testing.assert_close(alone.float(), ref, atol=tol, rtol=0)


QUANT_CASES = {
    "int8 per-head": (named_config("int8"), 0.05),
    "int8 per-token-head": (named_config("int8", granularity="per-token-head", policy="dynamic"), 0.03),
    "int8 per-token": (named_config("int8", granularity="per-token", policy="dynamic"), 0.05),  # [.., 1, 1] pages
    "int8 per-channel": (named_config("int8", granularity="per-channel"), 0.05),
    "k8v4": (named_config("k8v4"), 0.15),
    "int4": (named_config("int4"), 0.3),
    "int8 Hadamard K": (named_config("int8", rotate_k=True), 0.05),
}


@pytest.mark.parametrize("name", list(QUANT_CASES))
@pytest.mark.parametrize("h_q,h_kv,d,block_size,ctx,splits", [DECODE_CASES[i] for i in (1, 2, 3, 4)])
def test_decode_kernel_equals_the_quantized_reference(name, h_q, h_kv, d, block_size, ctx, splits):
    config, full_tol = QUANT_CASES[name]
    g = torch.Generator().manual_seed(3)
    n_blocks = 64
    tables, slots = _layout(ctx, block_size, n_blocks, seed=1)
    k, v = torch.randn(len(slots), h_kv, d, generator=g), torch.randn(len(slots), h_kv, d, generator=g)
    cache = _quant_cache(config, h_kv, d, block_size, n_blocks, k, v, slots)
    q = torch.randn(len(ctx), h_q, d, generator=g)
    last = torch.tensor([sum(ctx[:i + 1]) - 1 for i in range(len(ctx))])  # each sequence's own new token
    idx = DecodeIndex(tables, ctx, block_size)
    with pytest.raises(ValueError, match="needs k_new and v_new"):  # the own token is attended at full precision
        TRITON.decode(q, cache, 0, idx, d ** -0.5)
    out = TRITON.decode(q, cache, 0, idx, d ** -0.5, k[last], v[last], num_splits=splits, out=_nan_out(q))
    ref = quantized_batched_decode_attention(q, k[last], v[last], cache, 0, idx, d ** -0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
    pool = PagedKVCache(1, n_blocks, block_size, h_kv, d)
    pool.write(0, k, v, slots)
    full = paged_attention(q, pool.k_cache[0], pool.v_cache[0], tables, ctx, [1] * len(ctx), d ** -0.5)
    assert (out - full).abs().max() < full_tol, (name, (out - full).abs().max())


FEATURES = {  # what models hand their attention function, alone and together
    "window": dict(window=24),
    "window 1": dict(window=1),
    "softcap": dict(softcap=1.5),
    "sinks": dict(sinks=torch.tensor([0.5, -1.0, 2.0, 3.0])),
    "all": dict(window=40, softcap=2.0, sinks=torch.tensor([1.0, 0.0, -2.0, 4.0])),
}


@pytest.mark.parametrize("feature", list(FEATURES))
@pytest.mark.parametrize("splits", [1, 3])
def test_decode_kernel_honours_window_softcap_and_sinks(feature, splits):
    """Over a float pool against the specification, and over an INT8 pool against the quantized reference;
    a window skips the tiles before it, so split ranges that lie wholly before it stay empty."""
    feat = FEATURES[feature]
    g = torch.Generator().manual_seed(11)
    h_q, h_kv, d, bs, ctx = 4, 2, 16, 4, [37, 9, 130]
    tables, slots = _layout(ctx, bs, 64, seed=5)
    k, v = torch.randn(len(slots), h_kv, d, generator=g) * 2, torch.randn(len(slots), h_kv, d, generator=g)
    pool = PagedKVCache(1, 64, bs, h_kv, d)
    pool.k_cache[0].fill_(float("nan"))
    pool.v_cache[0].fill_(float("nan"))
    TRITON.write(pool, 0, k, v, slots)
    q = torch.randn(len(ctx), h_q, d, generator=g)
    idx = DecodeIndex(tables, ctx, bs)
    out = TRITON.decode(q, pool, 0, idx, 0.3, num_splits=splits, pages=2, out=_nan_out(q), **feat)
    ref = paged_attention(q, pool.k_cache[0].nan_to_num(), pool.v_cache[0].nan_to_num(), tables, ctx, [1] * 3, 0.3,
                          **feat)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
    k_pool, v_pool = pool.k_cache[0].nan_to_num(), pool.v_cache[0].nan_to_num()
    plain = paged_attention(q, k_pool, v_pool, tables, ctx, [1] * 3, 0.3)
    assert (ref - plain).abs().max() > 1e-2  # the feature changes the answer: the comparison means something
    cache = _quant_cache(named_config("int8"), h_kv, d, bs, 64, k, v, slots)
    last = torch.tensor([sum(ctx[:i + 1]) - 1 for i in range(len(ctx))])
    out = TRITON.decode(q, cache, 0, idx, 0.3, k[last], v[last], num_splits=splits, pages=2, out=_nan_out(q),
                              **feat)
    ref = quantized_batched_decode_attention(q, k[last], v[last], cache, 0, idx, 0.3, **feat)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)


def test_decode_kernel_refuses_bad_features():
    pool = PagedKVCache(1, 4, 4, 2, 16)
    idx = DecodeIndex([[0]], [3], 4)
    q = torch.zeros(1, 4, 16)
    for bad, match in ((dict(window=0), "window"), (dict(window=2.5), "window"), (dict(softcap=-1.0), "softcap"),
                       (dict(sinks=torch.zeros(3)), "sinks")):
        with pytest.raises(ValueError, match=match):
            TRITON.decode(q, pool, 0, idx, 0.25, **bad)


def test_decode_kernel_handles_all_zero_keys():
    # all-zero keys (zero-guarded scales, scale 1.0): every score 0, uniform weights: the mean of V
    h, d, bs = 2, 64, 16
    g = torch.Generator().manual_seed(4)
    for name in ("k8v4", "int8"):
        cache = QuantizedPagedKVCache(1, 8, bs, h, d, named_config(name, granularity="per-token-head", policy="dynamic"))
        z, v = torch.zeros(20, h, d), torch.randn(20, h, d, generator=g)
        TRITON.write(cache, 0, z, v, torch.arange(20))
        idx = DecodeIndex([[0, 1]], [20], bs)
        q = torch.randn(1, 4, d, generator=g)
        out = TRITON.decode(q, cache, 0, idx, 0.125, z[-1:], v[-1:], out=_nan_out(q))
        ref = quantized_batched_decode_attention(q, z[-1:], v[-1:], cache, 0, idx, 0.125)
        torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)
        mean_v = torch.cat([cache.read(0, torch.tensor([0, 1]))[1].flatten(0, 1)[:19], v[-1:]]).mean(0)  # (H, D)
        torch.testing.assert_close(out[0], mean_v.repeat_interleave(2, dim=0), atol=2e-5, rtol=0)


def test_decode_kernel_fp16_queries_over_a_quantized_pool():
    g = torch.Generator().manual_seed(6)
    h_q, h_kv, d, bs, ctx = 8, 2, 64, 16, [40, 130]
    tables, slots = _layout(ctx, bs, 32, seed=3)
    k, v = torch.randn(len(slots), h_kv, d, generator=g), torch.randn(len(slots), h_kv, d, generator=g)
    cache = _quant_cache(named_config("k8v4"), h_kv, d, bs, 32, k, v, slots)
    last = torch.tensor([39, 169])
    idx = DecodeIndex(tables, ctx, bs)
    q = torch.randn(2, h_q, d, generator=g)
    ref = quantized_batched_decode_attention(q, k[last], v[last], cache, 0, idx, d ** -0.5)
    q16 = q.half()
    out = TRITON.decode(q16, cache, 0, idx, d ** -0.5, k[last].half(), v[last].half(), num_splits=2,
                              out=_nan_out(q16))
    assert out.dtype == torch.float16
    torch.testing.assert_close(out.float(), ref, atol=3e-3, rtol=0)


def test_decode_kernel_uses_64_bit_offsets_for_large_block_ids():
    # one int8 block of 32 slots x 8 heads x 128 channels = 32 KiB: block 2**16 + 3 starts past 2**31 bytes.
    # torch.empty reserves the pool without touching it; only the written pages become real memory.
    h, d, bs = 8, 128, 32
    n_blocks = 2 ** 16 + 8
    config = named_config("int8", policy="dynamic")
    cache = QuantizedPagedKVCache.__new__(QuantizedPagedKVCache)
    small = QuantizedPagedKVCache(1, 4, bs, h, d, config)
    cache.__dict__.update(small.__dict__)
    cache.num_blocks = n_blocks
    for st in _stores(cache):
        st.data = torch.empty((n_blocks, bs, h, d), dtype=torch.int8)
    g = torch.Generator().manual_seed(0)
    k, v = torch.randn(40, h, d, generator=g), torch.randn(40, h, d, generator=g)
    table = [n_blocks - 1, 2 ** 16 + 3]
    slots = torch.tensor([table[i // bs] * bs + i % bs for i in range(40)])
    assert int(slots.max()) * h * d > 2 ** 31
    TRITON.write(cache, 0, k, v, slots)
    ref_cache = QuantizedPagedKVCache(1, 2, bs, h, d, config)
    ref_cache.k[0].scale, ref_cache.v[0].scale = cache.k[0].scale, cache.v[0].scale
    ref_cache.write(0, k, v, torch.arange(40))
    for big, ref in zip(_stores(cache), _stores(ref_cache)):
        assert torch.equal(big.data[table].flatten(0, 1)[:40], ref.data.flatten(0, 1)[:40])
    q = torch.randn(1, 16, d, generator=g)
    idx = DecodeIndex([table], [40], bs)
    idx.table = idx.table.to(torch.int32)  # 32-bit ids: the kernel must widen before multiplying
    out = TRITON.decode(q, cache, 0, idx, d ** -0.5, k[-1:], v[-1:], out=_nan_out(q))
    ref = quantized_batched_decode_attention(q, k[-1:], v[-1:], ref_cache, 0, DecodeIndex([[0, 1]], [40], bs),
                                             d ** -0.5)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=0)


def test_decode_kernel_argument_errors():
    pool = PagedKVCache(1, 4, 4, 2, 16)
    ko, vo = pool.kernel_operands(0)
    q = torch.randn(1, 4, 16)
    idx = DecodeIndex([[0]], [3], 4)
    with pytest.raises(ValueError, match="num_splits must be a positive integer"):
        K.paged_decode(q, ko, vo, idx.table, idx.seq_lens, 0.25, num_splits=0)
    with pytest.raises(ValueError, match="multiple of KV heads"):
        K.paged_decode(torch.randn(1, 3, 16), ko, vo, idx.table, idx.seq_lens, 0.25)
    with pytest.raises(ValueError, match="q must be"):
        K.paged_decode(q[0], ko, vo, idx.table, idx.seq_lens, 0.25)
    with pytest.raises(ValueError, match="k_own and v_own"):
        K.paged_decode(q, ko, vo, idx.table, idx.seq_lens, 0.25, k_own=torch.randn(1, 2, 16))
    with pytest.raises(ValueError, match=r"seq_lens must be in 1\.\.4"):
        K.paged_decode(q, ko, vo, idx.table, torch.tensor([5]), 0.25)  # one block of 4 slots holds 4 tokens
    with pytest.raises(ValueError, match="out must have q's shape"):
        K.paged_decode(q, ko, vo, idx.table, idx.seq_lens, 0.25, out=torch.empty(1, 4, 8))
    with pytest.raises(ValueError, match="k_own must be"):
        K.paged_decode(q, ko, vo, idx.table, idx.seq_lens, 0.25, k_own=torch.randn(1, 4, 16),
                       v_own=torch.randn(1, 4, 16))
    with pytest.raises(ValueError, match="pages must be a power of two"):
        K.paged_decode(q, ko, vo, idx.table, idx.seq_lens, 0.25, pages=3)
    with pytest.raises(ValueError, match="block ids in 0..3"):
        K.paged_decode(q, ko, vo, torch.tensor([[7]]), idx.seq_lens, 0.25)
    if INTERPRETER:
        with pytest.raises(ValueError, match="bf16 tensors cannot run in Triton's interpreter"):
            K.paged_decode(q.bfloat16(), ko, vo, idx.table, idx.seq_lens, 0.25)
    with pytest.raises(ValueError, match="power-of-two"):
        odd = PagedKVCache(1, 4, 4, 2, 12)
        K.paged_decode(torch.randn(1, 4, 12), *odd.kernel_operands(0), idx.table, idx.seq_lens, 0.25)


# ---- bytes ------------------------------------------------------------------------------------------

def _traffic_cache(fmt, h, d, bs, n_blocks):
    if fmt == "fp16":
        return PagedKVCache(1, n_blocks, bs, h, d, dtype=torch.float16)
    if fmt == "int8-per-token-head":
        return QuantizedPagedKVCache(1, n_blocks, bs, h, d, named_config("int8", granularity="per-token-head",
                                                                         policy="dynamic"))
    cache = QuantizedPagedKVCache(1, n_blocks, bs, h, d, named_config(fmt, policy="dynamic"))
    for st in _stores(cache):
        if st.fmt.static_scales:
            st.scale = torch.full((1, h, 1), 0.02)
    return cache


@pytest.mark.skipif(not INTERPRETER, reason="counts loads through Triton's interpreter (CPU)")
@pytest.mark.parametrize("d", [64, 128])
def test_bytes_the_kernel_loads_match_the_prediction_and_int8_halves_them(d):
    h_q, h_kv, bs = 8, 2, 16
    ctx = [512, 300, 1000]
    tables, _ = _layout(ctx, bs, 128, seed=2)
    idx = DecodeIndex(tables, ctx, bs)
    q = torch.randn(len(ctx), h_q, d, dtype=torch.float16)
    own = torch.randn(len(ctx), h_kv, d, dtype=torch.float16)
    totals = {}
    for fmt in ("fp16", "int8", "k8v4", "int8-per-token-head"):
        cache = _traffic_cache(fmt, h_kv, d, bs, 128)
        k_op, v_op = cache.kernel_operands(0)
        has_own = fmt != "fp16"
        for splits, grouped in ((1, True), (3, True), (1, False)):
            with count_traffic() as n:
                K.paged_decode(q, k_op, v_op, idx.table, idx.seq_lens, 0.1, num_splits=splits,
                               group_heads=grouped, **(dict(k_own=own, v_own=own) if has_own else {}))
            pred = decode_traffic(ctx, h_q, h_kv, d, spec_of(k_op), spec_of(v_op), block_size=bs, num_splits=splits,
                                  group_heads=grouped, has_own=has_own, q_bytes=2,
                                  table_bytes=idx.table.element_size())
            # the interpreter counts exactly, so the model must match exactly (the issue asks for 5 %)
            assert (n["read"], n["write"]) == (sum(pred["read"].values()), sum(pred["write"].values())), (fmt, splits)
            if splits == 1 and grouped:
                totals[fmt] = n["read"] + n["write"]
    assert totals["int8"] <= 0.54 * totals["fp16"], totals
    assert totals["k8v4"] <= 0.42 * totals["fp16"], totals
    assert totals["int8"] < totals["int8-per-token-head"] < 0.56 * totals["fp16"], totals  # + 4 B per token-head



# ---- conversion variants (kvlab.kernels.convert): cheaper ways from stored bytes to matmul operands -----

def test_magic_number_conversions_are_exact_for_every_int8_and_int4_value():
    """Exhaustive: all 256 int8 values and all 16 nibbles, through the numpy replicas of the bit tricks."""
    import numpy as np
    from kvlab.kernels import convert as C

    x = np.arange(-128, 128, dtype=np.int8)
    assert np.array_equal(C.magic_int8_replica(x), x.astype(np.float16))
    n = np.arange(16, dtype=np.uint8)
    assert np.array_equal(C.magic_int4_replica(n), (n.astype(np.int16) - 8).astype(np.float16))
    # the formula holds only for the byte read as unsigned: a sign-extended x | 0x6400 is not 1024 + x
    wrong = (x.astype(np.int16).view(np.uint16) | 0x6400).view(np.float16) - np.float16(1152)
    assert not np.array_equal(wrong, x.astype(np.float16))


def test_prmt_replica_reproduces_every_int8_value_in_every_byte_position():
    import numpy as np
    from kvlab.kernels import convert as C

    vals = np.arange(-128, 128, dtype=np.int8)
    for lane in range(4):  # each value in each of the word's four bytes, the other bytes different
        for x in vals:
            b = np.array([(int(x) + 37 * j) % 256 - 128 for j in range(4)], dtype=np.int8)
            b[lane] = x
            word = int(b.view(np.uint8).astype(np.uint32) @ (1 << (8 * np.arange(4, dtype=np.uint32))))
            assert np.array_equal(C.prmt_replica(word), b.astype(np.float16)), (lane, int(x))
    assert C.prmt(0x44332211, 0x88776655, 0x7170) == 0x88228811  # selector nibbles pick bytes of {b, a}
    assert C.prmt(0x000000F0, 0, 0x1118) == 0x000000FF  # bit 3 of a nibble: the byte's sign replicated


def test_triton_conversion_functions_are_exact_for_every_value():
    from kvlab.kernels import decode as D

    got = D.convert_all_values()
    assert got == {"cast": True, "magic": True, "int4 magic": True, **({"prmt": True} if not INTERPRETER else {})}


VARIANT_CASES = {  # name: (config, per-token-head?)
    "int8 per-head": named_config("int8"),
    "int8 per-token-head": named_config("int8", granularity="per-token-head", policy="dynamic"),
    "k8v4": named_config("k8v4"),
}


@pytest.mark.skipif(not INTERPRETER, reason="the variants' CPU check runs under the interpreter")
@pytest.mark.parametrize("name", list(VARIANT_CASES))
@pytest.mark.parametrize("splits", [1, 3])
def test_conversion_variants_match_the_cast_kernel(name, splits):
    """magic: the same values as cast (int8: bit-identical output; int4: group scales rounded to fp16,
    within the float tolerance). dot8: q quantized per row, within a bound computed from the data."""
    from kvlab.kernels.convert import quantize_rows_replica

    h_q, h_kv, d, bs, ctx = 8, 2, 64, 16, [70, 33, 128]
    g = torch.Generator().manual_seed(5)
    tables, slots = _layout(ctx, bs, 48, seed=4)
    k, v = torch.randn(len(slots), h_kv, d, generator=g), torch.randn(len(slots), h_kv, d, generator=g)
    cache = _quant_cache(VARIANT_CASES[name], h_kv, d, bs, 48, k, v, slots)
    q = torch.randn(len(ctx), h_q, d, generator=g)
    last = torch.tensor([sum(ctx[:i + 1]) - 1 for i in range(len(ctx))])
    idx = DecodeIndex(tables, ctx, bs)
    run = {c: TRITON.decode(q, cache, 0, idx, d ** -0.5, k[last], v[last], num_splits=splits, convert=c,
                            out=_nan_out(q)) for c in ("cast", "magic", "dot8")}
    ref = quantized_batched_decode_attention(q, k[last], v[last], cache, 0, idx, d ** -0.5)
    torch.testing.assert_close(run["cast"], ref, atol=2e-5, rtol=0)
    if name == "k8v4":
        torch.testing.assert_close(run["magic"], run["cast"], atol=2e-3 * v.abs().max().item(), rtol=0)
    else:
        assert torch.equal(run["magic"], run["cast"])
    # dot8: each score moves by at most eps = 0.5 * s_q * sum|k8| (q's rounding), so each softmax weight by a
    # factor within exp(+-2 eps), and the output by at most (exp(2 eps) - 1) * max|V| (+ the float tolerance)
    k_op, _ = cache.kernel_operands(0)
    q_pool = q * d ** -0.5 * (k_op.static_scale.repeat_interleave(h_q // h_kv, 0)[None]
                              if k_op.static_scale is not None else 1.0)
    _, s_q = quantize_rows_replica(q_pool.numpy())
    k8_l1 = k_op.data.float().abs().sum(-1)  # (blocks, bs, H_kv): sum over channels of |stored K|
    k_sc = k_op.slot_scale[..., 0] if k_op.slot_scale is not None else torch.ones_like(k8_l1)
    eps = 0.5 * float(s_q.max()) * float((k8_l1 * k_sc).max())
    v_max = max(v.abs().max().item(), 1.0)
    bound = (math.exp(2 * eps) - 1) * v_max + 2e-5
    err = (run["dot8"] - run["cast"]).abs().max().item()
    assert err <= bound, (err, bound)
    assert err > 0  # it really ran the int8 dot (a cast path would agree exactly)


@pytest.mark.skipif(not INTERPRETER, reason="the refusals are of the interpreter")
def test_conversion_variants_refuse_what_cannot_run_here_and_bad_names():
    h_kv, d, bs = 2, 64, 16
    pool = PagedKVCache(1, 8, bs, h_kv, d)
    k_op, v_op = pool.kernel_operands(0)
    q = torch.randn(1, 4, d)
    table, lens = torch.tensor([[0, 1]]), torch.tensor([20])
    for convert, words in (("prmt", "inline PTX"), ("bf16", "bf16"), ("dot8", "int8 K"), ("fast", "must be one of")):
        with pytest.raises(ValueError, match=words):
            K.paged_decode(q, k_op, v_op, table, lens, 0.1, convert=convert)
    with pytest.raises(ValueError, match="num_stages"):
        K.paged_decode(q, k_op, v_op, table, lens, 0.1, num_stages=0)


@pytest.mark.skipif(not INTERPRETER, reason="counts loads through Triton's interpreter (CPU)")
def test_conversion_variants_read_the_same_bytes():
    h_q, h_kv, d, bs = 8, 2, 64, 16
    ctx = [300, 64]
    tables, _ = _layout(ctx, bs, 64, seed=2)
    idx = DecodeIndex(tables, ctx, bs)
    q = torch.randn(len(ctx), h_q, d)
    for fmt in ("int8", "k8v4"):
        k_op, v_op = _traffic_cache(fmt, h_kv, d, bs, 64).kernel_operands(0)
        counts = []
        for convert in ("cast", "magic", "dot8"):
            with count_traffic() as n:
                K.paged_decode(q, k_op, v_op, idx.table, idx.seq_lens, 0.1, convert=convert)
            counts.append((n["read"], n["write"]))
        pred = decode_traffic(ctx, h_q, h_kv, d, spec_of(k_op), spec_of(v_op), block_size=bs, q_bytes=4,
                              table_bytes=idx.table.element_size())
        assert counts == [(sum(pred["read"].values()), sum(pred["write"].values()))] * 3, fmt


@pytest.mark.skipif(not K.available(), reason=K.WHY_NO_TRITON)
def test_every_variant_compiles_for_hopper_and_only_cast_converts_int8_in_the_loop():
    """Triton's own PTX assembler compiles the kernel for sm_90 here, no GPU needed: the GPU-only variants
    (inline PTX, bf16) compile, and the PTX holds the conversions the operations model counts."""
    from kvlab.kernels.ptx import compile_variants

    rows = {r["convert"]: r for r in compile_variants(("cast", "magic", "prmt", "bf16", "dot8"), ("int8",))}
    per_thread = 2 * 128 * 128 // (4 * 32)  # K and V values of one 128-token tile, d 128, over 4 warps' threads
    assert rows["cast"]["counts"]["cvt from int"] == per_thread  # one cvt per value (decode_ops: "cvt": 1)
    for c in ("magic", "prmt", "bf16"):
        assert rows[c]["counts"]["cvt from int"] == 0, rows[c]
    for c in ("magic", "prmt"):
        assert rows[c]["counts"]["16-bit x2 arithmetic"] == per_thread // 2  # one sub.f16x2 per two values
    assert rows["dot8"]["counts"]["cvt from int"] == 16 * 128 // (4 * 32)  # only the int32 scores
    assert all(r["cubin_bytes"] > 0 for r in rows.values())


def test_operations_model_counts_by_hand():
    """One sequence of 200 tokens, 8 query / 2 KV heads, d 64, tiles of 128 slots: 2 tiles x 2 programs."""
    from kvlab.kernels.traffic import FORMATS, decode_ops, ops_time

    tiles, n, d, rows = 4, 128, 64, 16
    values = tiles * n * d  # of K, and of V
    cast = decode_ops([200], 8, 2, d, *FORMATS["int8"], convert="cast")
    assert cast["tiles"] == tiles and cast["values"] == 2 * values
    assert cast["pipes"] == {"cvt": 2 * values, "int": 0, "fp16": 0, "fp32": 0, "sfu": tiles * rows * n}
    assert cast["mma_flops"] == {"fp16": 2 * 2 * tiles * rows * n * d, "int8": 0}
    magic = decode_ops([200], 8, 2, d, *FORMATS["int8"], convert="magic")["pipes"]
    assert (magic["cvt"], magic["int"], magic["fp16"]) == (0, 6 * values, 2 * values)
    prmt = decode_ops([200], 8, 2, d, *FORMATS["int8"], convert="prmt")["pipes"]
    assert (prmt["cvt"], prmt["int"], prmt["fp16"]) == (0, 1.5 * values, 2 * values)
    dot8 = decode_ops([200], 8, 2, d, *FORMATS["int8"], convert="dot8")
    assert dot8["pipes"]["cvt"] == tiles * rows * n and dot8["pipes"]["int"] == 3 * values  # scores; V's magic
    assert dot8["mma_flops"] == {"fp16": 2 * tiles * rows * n * d, "int8": 2 * tiles * rows * n * d}
    k8v4 = decode_ops([200], 8, 2, d, *FORMATS["k8v4"], convert="cast")["pipes"]
    assert k8v4["cvt"] == values + 1.5 * values and k8v4["fp32"] == 2 * values  # int4 V: u8->f32, f32x2->f16x2
    per_token = decode_ops([200], 8, 2, d, *FORMATS["int8-per-token-head"], convert="cast")["pipes"]
    assert per_token["fp32"] == 2 * tiles * rows * n  # K's scale into the scores, V's into P
    bf16 = decode_ops([200], 8, 2, d, *FORMATS["int8"], convert="bf16")
    assert bf16["modelled"] and (bf16["pipes"]["cvt"], bf16["pipes"]["int"]) == (0, 2 * values)
    assert decode_ops([200], 8, 8, d, *FORMATS["fp16"])["pipes"]["cvt"] == 0
    # at the shape the model says what the H200 showed: converting int8 costs more than reading it
    ctx = [16384] * 32
    for convert, limit in (("cast", "cvt"), ("magic", "bytes"), ("prmt", "bytes")):
        ops = decode_ops(ctx, 32, 8, 128, *FORMATS["int8"], convert=convert)
        t = ops_time(ops, decode_traffic(ctx, 32, 8, 128, *FORMATS["int8"])["total"], "H200")
        assert t["limit"] == limit, (convert, t)
    with pytest.raises(ValueError, match="gpu must be one of"):
        ops_time(cast, 1, "T4")
    with pytest.raises(ValueError, match="convert must be one of"):
        decode_ops([200], 8, 2, d, *FORMATS["int8"], convert="fast")

# ---- the engine on the kernels ------------------------------------------------------------------------

@pytest.mark.slow
@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8", "k8v4"])
def test_triton_backend_gives_the_reference_backends_tokens_on_smollm2(smollm2, kv_cache_dtype):
    from kvlab.data import chat_prompts
    from kvlab.engine import LLM, SamplingParams

    model, tok = smollm2
    prompts = chat_prompts(tok)[:3]
    got = {}
    for backend in ("reference", "triton"):
        llm = LLM(model, tok, num_blocks=48, block_size=16, max_num_seqs=4, attn_backend=backend, kv_cache_dtype=kv_cache_dtype)
        # 4 tokens: 3 decode steps through the kernels on every layer (~0.1 s a launch interpreted)
        got[backend] = [o.token_ids for o in llm.generate(prompts, SamplingParams(max_tokens=4, ignore_eos=True))]
    assert got["triton"] == got["reference"], kv_cache_dtype


def test_triton_backend_refuses_a_pool_it_cannot_read(tiny):
    from kvlab.engine import LLM

    model, tok = tiny
    with pytest.raises(ValueError, match="attn_backend='triton' handles"):
        LLM(model, tok, num_blocks=8, block_size=4, attn_backend="triton", kv_cache_dtype="fp8",
            quant_config=named_config("fp8", policy="dynamic"))


def test_kernels_import_as_kvlab_kernels_beside_transformers():
    import importlib

    import transformers  # noqa: F401

    assert importlib.util.find_spec("kernels") is None or "kvlab" not in importlib.util.find_spec("kernels").origin
    assert K.paged_decode.__module__ == "kvlab.kernels.decode"
    assert math.isfinite(K.traffic.GPU_BANDWIDTH["H100"])


@pytest.mark.skipif(not INTERPRETER, reason="replays the GPU benchmark's logic under the interpreter")
def test_gpu_timing_logic_runs_every_variant_and_keeps_the_fastest(monkeypatch):
    """time_case on a CPU with do_bench replaced by a clock that makes magic the fastest: every variant
    runs once per launch option (interpreted), the table and the JSON name the winner."""
    import triton.testing
    from kvlab.bench import kernels as kb

    calls = []

    def fake_bench(fn):
        fn()  # the kernel really runs (interpreted): a variant that cannot run fails here
        calls.append(1)
        return 0.5 if len(calls) % 7 == 3 else 1.0  # ms

    monkeypatch.setattr(triton.testing, "do_bench", fake_bench)
    monkeypatch.setattr(kb, "CONVERSIONS", ("cast", "magic", "dot8"))
    row = kb.time_case("smollm2-135m", 1, 32, "cpu", converts=("cast", "magic", "dot8"))
    assert set(row["variants"]) == {"fp16", "int8", "k8v4"}
    assert set(row["variants"]["int8"]) == {"cast", "magic", "dot8"}
    for fmt in ("int8", "k8v4"):
        best = row["best_convert"][fmt]
        assert row["us"][fmt] == min(row["variants"][fmt].values()) == row["variants"][fmt][best]
        assert f"{fmt} {best}" in row["model_us"]
    assert row["speedup_vs_fp16"]["fp16"] == 1.0 and "sdpa_fp16_contiguous" in row["GBps"]
    result = kb.run(["smollm2-135m"], (1,), (64,), progress=lambda m: None, converts=("magic",))
    result.update(copy_GBps=1000.0, measured=[row])
    text = kb.format_table(result)
    assert "conversion variants, us" in text and "magic" in text and "every int8 value through each conversion" in text
