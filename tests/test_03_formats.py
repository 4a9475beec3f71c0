"""The KV format registry (kvlab/formats.py): every part reads one table, so a new format is one entry.

The toy here is a real one: float8 e5m2 (vLLM's ``fp8_e5m2``), registered by this test alone. Nothing
else in kvlab names it, yet sizing, the quantized pool, the engine, the command line, the kernels'
byte model and the Triton backend's refusal all know it at once.
"""

from __future__ import annotations

import pytest
import torch

import kvlab  # noqa: F401
from kvlab import formats, sizing
from kvlab.attention import get_backend
from kvlab.cache import BlockManager, QuantizedPagedKVCache
from kvlab.cli.parser import build_parser
from kvlab.engine import LLM, SamplingParams, kv_cache_dtypes
from kvlab.kernels.traffic import format_specs
from kvlab.quant import TensorFormat, named_config

E5M2 = formats.ElementFormat("fp8e5m2", 8, torch.float8_e5m2, "fp8", qmax=57344.0, clip_slack=4096.0,
                             granularities=formats.GRANULARITIES, default_granularity="per-token-head",
                             description="float8 e5m2: 2 mantissa bits, range to 57344")


@pytest.fixture
def e5m2():
    formats.register(E5M2)
    try:
        yield E5M2
    finally:
        formats.unregister(E5M2.name)


def test_the_registry_holds_the_lab_s_formats():
    assert list(formats.KV_CACHE_DTYPES) == ["fp32", "fp16", "int8", "fp8", "int4", "k8v4"]
    assert formats.kv_cache_dtype("k8v4") == (formats.ELEMENT_FORMATS["int8"], formats.ELEMENT_FORMATS["int4"])
    assert [f.bits for f in formats.ELEMENT_FORMATS.values()] == [32, 16, 16, 8, 8, 4]
    assert formats.element_format("int8").clip_limit == 127.5
    assert formats.element_format("fp8").clip_limit == 448.0 + 16.0
    assert formats.kernel_names() == ("fp32", "fp16", "int8", "int4", "k8v4")


def test_a_format_is_declared_once():
    with pytest.raises(ValueError, match="already registered"):
        formats.register(formats.ELEMENT_FORMATS["int8"])
    with pytest.raises(ValueError, match="kind must be one of"):
        formats.ElementFormat("int3", 3, torch.uint8, "nibbles")
    with pytest.raises(ValueError, match="qmax"):
        formats.ElementFormat("int3", 3, torch.uint8, "int")
    with pytest.raises(ValueError, match="kv_cache_dtype must be one of"):
        formats.kv_cache_dtype("int3")


def test_one_entry_reaches_every_part(e5m2, tiny):
    model, _ = tiny
    cfg = sizing.kv_config(model)
    # sizing: 1 byte per element plus one fp32 scale per token-head, as fp8 at the same granularity
    size = sizing.kv_size(model, "fp8e5m2", tokens=10)
    assert size.total_bytes == sizing.kv_size(model, "fp8", tokens=10, scales="per-token-head").total_bytes
    assert size.bytes_per_token == 2 * cfg.num_layers * cfg.num_kv_heads * (cfg.head_dim + 4)
    assert "fp8e5m2" in sizing.dtypes()
    # the quantized pool stores e5m2 codes and reads them back within e5m2's precision (2 mantissa bits)
    pool = QuantizedPagedKVCache(1, 4, 4, 2, 16, named_config("fp8e5m2"))
    assert pool.k[0].data.dtype == torch.float8_e5m2 and pool.formats(0)[0] == TensorFormat("fp8e5m2", "per-token-head")
    x = torch.randn(6, 2, 16, generator=torch.Generator().manual_seed(0))
    pool.write(0, x, x, torch.arange(6))
    k, _ = pool.read(0, torch.tensor([0, 1]))
    err = (k.flatten(0, 1)[:6] - x).abs() / x.abs().amax(-1, keepdim=True)
    assert 0 < float(err.max()) <= 2 ** -3
    # the engine takes it as a kv_cache_dtype, and serves with it
    assert "fp8e5m2" in kv_cache_dtypes()
    llm = LLM(model, kv_cache_dtype="fp8e5m2", num_blocks=16, block_size=4, max_num_seqs=2, attn_backend="torch")
    out = llm.generate([[1, 2, 3, 4, 5]], SamplingParams(max_tokens=3, ignore_eos=True))
    assert len(out[0].token_ids) == 3 and llm.cache.k[0].data.dtype == torch.float8_e5m2
    # the command line offers it
    parser = build_parser()
    assert parser.parse_args(["size", "--model", "llama-2-7b", "--dtype", "fp8e5m2"]).dtype == "fp8e5m2"
    # the kernels do not read it (kernel=False): the byte model leaves it out, the Triton backend refuses it
    assert "fp8e5m2" not in format_specs()
    with pytest.raises(ValueError, match="fp8e5m2 per-token-head"):
        get_backend("triton").check(pool)


def test_unregister_takes_it_out_everywhere(e5m2):
    formats.unregister("fp8e5m2")
    assert "fp8e5m2" not in sizing.dtypes() and "fp8e5m2" not in kv_cache_dtypes()
    with pytest.raises(ValueError, match="dtype must be one of"):
        TensorFormat("fp8e5m2")
    formats.register(E5M2)  # for the fixture's own clean-up


def test_a_block_manager_and_the_pool_agree_on_block_bytes(e5m2):
    pool = QuantizedPagedKVCache(2, 8, 4, 2, 16, named_config("fp8e5m2"))
    bm = BlockManager(8, 4)
    assert pool.bytes_per_block * bm.num_blocks + pool.fixed_bytes == pool.bytes_reserved
    assert pool.bytes_per_block == 2 * 2 * 4 * 2 * (16 + 4)  # layers x K,V x slots x heads x (codes + scale)
