"""What a KV format or an eviction policy costs in quality: :mod:`kvlab.eval.quality` (perplexity, KL,
greedy agreement, layer sensitivity; notebook 03) and :mod:`kvlab.eval.eviction` (evicting against
quantizing at equal bytes, the pass key, the blocks each policy keeps; notebook 07)."""

from kvlab.eval.eviction import (CUTS, FORMATS, TIE_KL, answers_after_cut, block_share, equal_byte_budgets,
                                 equal_bytes_verdict, eviction_quality, kept_blocks, passkey, quantize_or_evict)
from kvlab.eval.quality import (auto_config, check_scoring, check_tokens, evaluate, greedy_agreement,
                                greedy_comparison, kv_bytes_per_token, layer_sensitivity, teacher_forced)
