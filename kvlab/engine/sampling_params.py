"""What a request asks for: how many tokens, how to pick them, when to stop (notebook 04).

Validated at ``add_request`` time, so a bad request is refused before it touches the block pool.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

from kvlab.cache.evict import EvictionPolicy
from kvlab.validate import is_int


def _int(name: str, value, minimum: int) -> int:
    if not is_int(value) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return value


@dataclass(frozen=True)
class SamplingParams:
    """vLLM's ``SamplingParams``, cut down; ``temperature=0`` (greedy) is the lab's correctness anchor.

    Each request samples from its own generator (``seed``), so its tokens never depend on its batch.
    The first ``len(forced_token_ids)`` outputs are those ids instead of sampled ones (a quality run feeds a
    text's own tokens). ``seed=None`` draws a fresh seed; ``eviction=None`` keeps the engine's policy.
    """

    max_tokens: int = 16
    temperature: float = 0.0
    top_k: int = 0  # 0: off
    top_p: float = 1.0  # 1.0: off
    seed: int | None = None
    stop_token_ids: tuple[int, ...] = field(default=())
    ignore_eos: bool = False
    eviction: EvictionPolicy | None = None
    forced_token_ids: tuple[int, ...] = field(default=())
    return_logits: bool = False

    def __post_init__(self):
        _int("max_tokens", self.max_tokens, 1)
        if isinstance(self.temperature, bool) or not isinstance(self.temperature, (int, float)) \
                or not math.isfinite(self.temperature) or self.temperature < 0:
            raise ValueError(f"temperature must be a finite number >= 0 (0 = greedy), got {self.temperature!r}")
        _int("top_k", self.top_k, 0)
        if isinstance(self.top_p, bool) or not isinstance(self.top_p, (int, float)) or not 0 < self.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {self.top_p!r}")
        if self.seed is not None:
            _int("seed", self.seed, 0)
        stops = self.stop_token_ids
        if is_int(stops):
            stops = (stops,)
        if not isinstance(stops, (list, tuple, set, frozenset)) or \
                any(not is_int(t) or t < 0 for t in stops):
            raise ValueError(f"stop_token_ids must be a token id or a list of token ids (ints >= 0), got {stops!r}")
        object.__setattr__(self, "stop_token_ids", tuple(sorted(set(stops))))
        for name in ("ignore_eos", "return_logits"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} must be True or False, got {getattr(self, name)!r}")
        if self.eviction is not None and not isinstance(self.eviction, EvictionPolicy):
            raise TypeError(f"eviction must be a kvlab.cache.evict policy (SlidingWindow, SinksWindow, HeavyHitters, "
                            f"PromptSelect) or None, got {type(self.eviction).__name__} {self.eviction!r}")
        forced = self.forced_token_ids
        if not isinstance(forced, (list, tuple)) or any(not is_int(t) or t < 0 for t in forced):
            raise ValueError(f"forced_token_ids must be a list of token ids (ints >= 0), got {forced!r}")
        object.__setattr__(self, "forced_token_ids", tuple(forced))

    @property
    def greedy(self) -> bool:
        return self.temperature == 0 or self.top_k == 1
