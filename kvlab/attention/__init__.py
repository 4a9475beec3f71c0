"""Paged attention: the PyTorch specification and the backends that run it (notebooks 02, 04, 05).

``spec.py`` is the specification (causal, windowed, soft-capped, sinked attention through block
tables, one sequence at a time); ``batched.py`` runs all decodes of a step at once (``DecodeIndex``:
a gather and an SDPA per length group) and all float prefill chunks (``PrefillIndex``);
``backends.py`` holds the backends, each a ``write`` / ``decode`` / ``prefill`` over the pool
interface: ``reference`` (the spec throughout), ``torch`` (batched decode; batched prefill on a float
pool) and ``triton`` (the write and paged decode kernels). Prefill runs the spec outside ``torch``:
a chunk is attended once, decodes at every step, so decodes are where a kernel pays. Every backend
is token-identical to HF ``generate()`` in fp32 (tests/test_04_engine.py, tests/test_05_kernels.py).
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
