"""Exercise checkers for the notebooks (Tensor-Puzzles style): ``kvlab.check.<exercise>(your_function)``.

A checker runs the learner's function on fixed cases against kvlab's answer and prints ONE line, ``[ok]``,
``[todo]`` (a stub: the notebook still runs top to bottom) or ``[fail]``; it returns True only on ``[ok]``.
One module per notebook (``sizing`` 00 ... ``evict`` 07).
"""

from kvlab.check.capstone import fp8_scales, max_held
from kvlab.check.engine import admission_rule, chunk_prefills, schedule_decodes
from kvlab.check.evict import copy_or_recompute, h2o_keep, sinks_window_blocks
from kvlab.check.kernels import block_walk, dequant_int8, online_softmax_update
from kvlab.check.naive import decode_loop, grow, static_write
from kvlab.check.paged import append_slot, blocks_after_fork, prefix_hits, slot_mapping
from kvlab.check.kept import forget, mine
from kvlab.check.progress import EXERCISES, progress, progress_file
from kvlab.check.quant import pack_int4, quantize_per_head, quantize_static
from kvlab.check.solutions import solution, use
from kvlab.check.sizing import kv_token_bytes, mla_bytes_per_token

__all__ = ["kv_token_bytes", "mla_bytes_per_token", "grow", "decode_loop", "static_write",
           "slot_mapping", "append_slot", "prefix_hits", "blocks_after_fork", "quantize_per_head", "quantize_static", "pack_int4", "admission_rule", "schedule_decodes", "chunk_prefills",
           "block_walk", "online_softmax_update", "dequant_int8", "max_held", "fp8_scales", "sinks_window_blocks", "h2o_keep", "copy_or_recompute", "EXERCISES", "progress", "progress_file", "mine", "forget",
           "solution", "use"]
