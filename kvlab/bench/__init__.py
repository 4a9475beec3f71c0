"""kvlab.bench: the measurements behind the notebooks' numbers and ``kvlab bench``: ``caches`` (notebooks
00-03), ``engine`` (04), ``kernels`` (05). Every ratio is against a baseline run in the same process; this
file imports nothing, so each module loads only what it measures.
"""
