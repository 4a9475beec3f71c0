"""What a KV format (notebook 03) or an eviction policy (notebook 07) costs in quality."""

from kvlab.eval.eviction import (CUTS, FORMATS, TIE_KL, answers_after_cut, block_share, equal_byte_budgets,
                                 equal_bytes_verdict, eviction_quality, kept_blocks, passkey, quantize_or_evict)
from kvlab.eval.quality import (auto_config, check_scoring, check_tokens, evaluate, greedy_agreement,
                                greedy_comparison, kv_bytes_per_token, layer_sensitivity, teacher_forced)
