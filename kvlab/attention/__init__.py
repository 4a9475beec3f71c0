"""Paged attention: the PyTorch specification and the backends that run it (notebooks 02, 04, 05).

| module        | what                                                                          |
|---------------|-------------------------------------------------------------------------------|
| `spec.py`     | the specification: causal (windowed, soft-capped, sinked) attention, read through block tables, one sequence at a time; the quantized pool's online-softmax reference |
| `batched.py`  | all decodes of a step at once: one block-table tensor (`DecodeIndex`), a gather and an SDPA per length group; all prefill chunks at once (`PrefillIndex`) |
| `backends.py` | the backends: one object each, ``write`` / ``decode`` / ``prefill`` over the pool interface |

What runs each part of a step, per backend (``LLM(attn_backend=...)``, ``paged_generate``):

| backend       | write (new K/V to their slots)       | decode (1 new token per sequence)           | prefill (chunks)               |
|---------------|--------------------------------------|---------------------------------------------|--------------------------------|
| ``reference`` | ``pool.write`` (PyTorch)             | the spec, one sequence at a time            | the spec, one sequence at a time |
| ``torch``     | ``pool.write`` (PyTorch)             | one gather + one masked SDPA per length group | float pool: one gather + one masked SDPA for all chunks; quantized: the spec |
| ``triton``    | the write kernel (quantize + scatter)| the paged decode kernel, one launch a layer | the spec, one sequence at a time |

Prefill runs the specification in the reference and Triton backends (a prompt's chunk is attended
once, while its decodes are attended at every step, so the decodes are where a kernel pays); the
torch backend batches the chunks of a float pool too (:class:`PrefillIndex`), which saves the
per-sequence Python loop of the CPU engine. Every backend is
token-identical to HF ``generate()`` in fp32 (tests/test_04_engine.py, tests/test_05_kernels.py).
"""

from kvlab.attention.backends import (BACKEND_NAMES, BACKENDS, AttentionBackend, TorchBackend, TritonBackend,
                                      get_backend, spec_attention)
from kvlab.attention.batched import (DecodeIndex, PrefillIndex, batched_decode_attention, batched_prefill_attention,
                                     quantized_batched_decode_attention)
from kvlab.attention.spec import (attend, gather_kv, paged_attention, quantized_paged_attention, scores_softmax,
                                  visible)
from kvlab.validate import check_attention_features as check_features

__all__ = ["attend", "gather_kv", "paged_attention", "quantized_paged_attention", "scores_softmax", "visible",
           "check_features", "DecodeIndex", "PrefillIndex", "batched_decode_attention", "batched_prefill_attention",
           "quantized_batched_decode_attention",
           "AttentionBackend", "TorchBackend", "TritonBackend", "BACKENDS", "BACKEND_NAMES", "get_backend",
           "spec_attention"]
