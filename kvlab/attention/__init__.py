"""Paged attention: the PyTorch specification and the backends that run it (notebooks 02, 04, 05).

Backends: ``reference`` (the spec throughout), ``torch`` (batched decode and float prefill) and
``triton`` (write and decode kernels). A chunk is attended once but decodes every step, so decodes are
where a kernel pays. Every backend is token-identical to HF ``generate()`` in fp32.
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
