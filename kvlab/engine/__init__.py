"""A continuous-batching serving engine over the paged KV pool, in vLLM's nouns (notebook 04).

It runs headless; ``kvlab.viz.engine`` only reads its trace and step stats.
"""

from kvlab.engine.llm import LLM, RequestOutput, kv_cache_dtypes
from kvlab.engine.metrics import StepStats, percentile, summarize
from kvlab.engine.model_runner import ModelRunner
from kvlab.engine.sampling_params import SamplingParams
from kvlab.engine.scheduler import ACTIONS, POLICIES, SchedulerOutput, Scheduler, TraceEvent
from kvlab.engine.sequence import RequestMetrics, Sequence, SequenceStatus

__all__ = ["LLM", "RequestOutput", "kv_cache_dtypes", "StepStats", "percentile", "summarize", "ModelRunner",
           "SamplingParams", "Scheduler", "SchedulerOutput", "TraceEvent", "ACTIONS", "POLICIES", "Sequence",
           "SequenceStatus", "RequestMetrics"]
