"""One request as the engine sees it (notebook 04): its tokens, its state and its clock.

``num_computed_tokens`` of its ``prompt + output`` tokens have their K/V in the pool; the step
that computes the LAST token samples a new one.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from enum import Enum

import torch

from kvlab.engine.sampling_params import SamplingParams


class SequenceStatus(str, Enum):
    WAITING = "waiting"  # queued, holds no blocks
    RUNNING = "running"  # holds blocks, scheduled every step until it finishes or is preempted
    PREEMPTED = "preempted"  # lost its blocks to make room; back at the front of the queue
    FINISHED = "finished"


@dataclass
class RequestMetrics:
    """Wall-clock moments of one request (``time.perf_counter`` seconds) and its preemptions."""

    arrival: float
    first_scheduled: float | None = None
    first_token: float | None = None
    finished: float | None = None
    token_times: list[float] = field(default_factory=list)
    num_preemptions: int = 0
    cached_prompt_tokens: int = 0  # prompt tokens found in the prefix cache at (last) admission
    held_blocks: int = 0  # blocks, and tokens in them, the sequence held when it finished
    held_tokens: int = 0

    def as_dict(self, num_output_tokens: int) -> dict:
        """Queue time, TTFT, TPOT (mean time per output token after the first), end-to-end latency."""
        ttft = None if self.first_token is None else self.first_token - self.arrival
        e2e = None if self.finished is None else self.finished - self.arrival
        tpot = None
        if self.finished is not None and self.first_token is not None and num_output_tokens > 1:
            tpot = (self.token_times[-1] - self.first_token) / (num_output_tokens - 1)
        queue = None if self.first_scheduled is None else self.first_scheduled - self.arrival
        return {"queue_s": queue, "ttft_s": ttft, "tpot_s": tpot, "e2e_s": e2e, "output_tokens": num_output_tokens,
                "preemptions": self.num_preemptions, "cached_prompt_tokens": self.cached_prompt_tokens}


class Sequence:
    def __init__(self, seq_id: int, prompt_token_ids: list[int], params: SamplingParams, arrival: float,
                 arrival_step: int = 0):
        self.seq_id = seq_id
        self.prompt_token_ids = list(prompt_token_ids)
        self.output_token_ids: list[int] = []
        # prompt + output, one list kept in step by append_token: read every step, never concatenated
        self.token_ids: list[int] = list(prompt_token_ids)
        self.params = params
        self.status = SequenceStatus.WAITING
        self.num_computed_tokens = 0
        self.finish_reason: str | None = None  # "eos", "stop", "length" or "aborted"
        self.arrival_step = arrival_step
        self.metrics = RequestMetrics(arrival)
        seed = params.seed if params.seed is not None else random.randrange(2**63)
        self.generator = torch.Generator().manual_seed(seed)
        self.logits: list[torch.Tensor] = []  # one per output, when params.return_logits

    def append_token(self, token: int) -> None:
        """A sampled token joins the output (and the sequence the next step feeds)."""
        self.output_token_ids.append(token)
        self.token_ids.append(token)

    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_uncomputed(self) -> int:
        """Tokens still to feed: the rest of the prompt (prefill), or 1 (the last sampled token)."""
        return self.num_tokens - self.num_computed_tokens

    @property
    def is_finished(self) -> bool:
        return self.status == SequenceStatus.FINISHED

    def __repr__(self) -> str:
        return (f"Sequence({self.seq_id}, {self.status.value}, prompt={len(self.prompt_token_ids)}, "
                f"output={len(self.output_token_ids)}, computed={self.num_computed_tokens})")
