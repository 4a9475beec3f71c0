"""kvlab.bench: the measurements behind the notebooks' numbers and ``kvlab bench``, one module per subject:
``caches`` (bandwidth, a decode step, recompute vs cache, static vs paged, KV formats' quality;
notebooks 00-03), ``engine`` (the engine against HF, notebook 04), ``kernels`` (the Triton decode
kernel, notebook 05). Every ratio is against a baseline run in the same process. This file imports
nothing, so each module loads only what it measures.
"""
