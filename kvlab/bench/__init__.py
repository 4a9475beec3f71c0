"""kvlab.bench: the measurements behind the notebooks' numbers and ``kvlab bench`` (one module per subject).

| module       | what it measures                                        | command                          | notebook |
|--------------|---------------------------------------------------------|----------------------------------|----------|
| `caches.py`  | bandwidth, a decode step, recompute vs cache, static vs paged, every KV format's quality | `kvlab bench recompute`, `static`, `quant` | 00-03 |
| `engine.py`  | the engine against HF `generate()` and `generate_batch` | `kvlab bench engine`             | 04       |
| `kernels.py` | the Triton decode kernel: correctness, time, GB/s       | `kvlab bench kernels`            | 05       |

(`kvlab bench memory` is the block-level simulation of notebook 02, :mod:`kvlab.cache.simulate`.)
Every ratio is taken against a baseline run in the same process, a moment before. This file imports
nothing, so each module loads only what it measures (``kvlab.bench.kernels`` needs no transformers).
"""
