"""The measuring lab of the claims table (notebook 06): SmolLM2 measurements made once and shared by the
claims that need the same numbers; ``Lab.seconds`` says what each cost.
"""

from __future__ import annotations

import statistics
import time
from functools import cached_property
from typing import Callable

from kvlab.eval import passkey
from kvlab.bench.caches import recompute_vs_cache
from kvlab.cache import simulate
from kvlab.cache.evict import SlidingWindow
from kvlab.calibrate import calibrate, collect_kv, default_calibration
from kvlab.capstone import roomy_agreement
from kvlab.data import EVAL_PLAY, calibration_chunks, chat_prompts, text_tokens
from kvlab.engine import LLM, SamplingParams
from kvlab.eval import evaluate, layer_sensitivity
from kvlab.models import load_model
from kvlab.quant import KVQuantConfig, TensorFormat, named_config


#: the formats :attr:`Lab.quality` scores against the FP cache, with the calibration of notebook 03
QUALITY = {"fp16": named_config("fp16"), "int8": named_config("int8"), "int8 p99.9": named_config("int8", stat="p99.9"),
           "k8v4": named_config("k8v4"), "k4v8": KVQuantConfig(TensorFormat("int4"), TensorFormat("int8"))}
#: :attr:`Lab.saturation`'s, with scales from 16 tokens
SATURATION = {"static": named_config("int8", policy="static"), "corrected": named_config("int8", policy="corrected")}


class Lab:
    """Small on purpose (a few hundred tokens each) so the table runs in about a minute on two CPU cores;
    the quality measurements use notebook 03's settings, so a number shared with 03 is the same number."""

    def __init__(self, model=None, tokenizer=None, held_out_tokens: int = 384, answers: dict | None = None,
                 passkey: dict | None = None):
        self._model, self._tokenizer = model, tokenizer
        self.held_out_tokens = held_out_tokens
        if answers is not None:  # measured already, as notebook 06 does: the table reads that run, not a second one
            if not isinstance(answers, dict) or not {"identical", "requests", "prefix_share"} <= set(answers):
                raise ValueError("answers must be kvlab.capstone.agreement(...)'s dict (identical, requests, prefix_share)")
            self.__dict__["answers"] = answers
        if passkey is not None:  # notebook 07's run of kvlab.eval.passkey (n=4), full cache and a 256 window
            if not isinstance(passkey, dict) or not {"full", "window"} <= set(passkey):
                raise ValueError("passkey must be kvlab.eval.passkey(...)'s dict with 'full' and 'window' runs")
            self.__dict__["passkey"] = passkey
        self.seconds: dict[str, float] = {}  # what each measurement cost, for the notebook

    def _timed(self, name: str, fn: Callable):
        t0 = time.perf_counter()
        out = fn()
        self.seconds[name] = time.perf_counter() - t0
        return out

    @property
    def model(self):
        if self._model is None:
            self._model, self._tokenizer = load_model("smollm2-135m")
        return self._model

    @property
    def tokenizer(self):
        self.model  # noqa: B018  (loads both)
        return self._tokenizer

    @cached_property
    def passkey(self) -> dict:
        """Notebook 07's pass keys in ~540-token prompts: the full cache against a 256-token window."""
        return self._timed("passkey", lambda: passkey(self.model, self.tokenizer,
                                                     {"full": None, "window": SlidingWindow(256)}, n=4))

    @cached_property
    def seed_shares(self) -> dict:
        """Token-state shares per policy over seeds 0-4 (notebook 02's verdicts near a threshold)."""
        return {name: simulate.over_seeds(name) for name in ("sharegpt", "alpaca")}

    @cached_property
    def calibration(self):
        # notebook 03's calibration (1,024 tokens in chunks of 512) and its 384 held-out tokens
        return self._timed("calibration", lambda: default_calibration(self.model, self.tokenizer, "smollm2-135m",
                                                                      tokens=1024, progress=False))

    @cached_property
    def kv(self):
        """Post-RoPE K and V of every layer for 256 tokens of calibration text: lists of (T, H, D)."""
        return self._timed("kv", lambda: collect_kv(self.model, calibration_chunks(self.tokenizer, 256, 256),
                                                    progress=False))

    @cached_property
    def held_out(self) -> list[int]:
        return text_tokens(self.tokenizer, self.held_out_tokens, play=EVAL_PLAY)

    @cached_property
    def _scored(self) -> dict:
        """The held-out text scored once for :attr:`quality` and :attr:`saturation`: every config (on its own
        pool, as a run of it alone) beside ONE full-precision run."""
        def run():
            tiny = calibrate(self.model, [text_tokens(self.tokenizer, 16, play="twelfth-night")], progress=False)
            scales = {**dict.fromkeys(QUALITY, self.calibration), **dict.fromkeys(SATURATION, tiny)}
            n = len(self.held_out)
            return evaluate(self.model, self.held_out, {**QUALITY, **SATURATION}, scales, window=n, stride=n, chunk=32)
        return self._timed("quality and saturation", run)

    def _part(self, names) -> dict:
        return {**self._scored, "configs": {n: self._scored["configs"][n] for n in names}}

    @cached_property
    def quality(self) -> dict:
        """Perplexity, KL and top-1 of FP16, INT8 (abs-max, p99.9), K8V4 and K4V8 against the FP cache."""
        return self._part(QUALITY)

    @cached_property
    def answers(self) -> dict:
        """INT8's greedy answers against FP16's: 06 passes its run in (``Lab(answers=...)``); alone, ``roomy_agreement``."""
        return self._timed("answers", lambda: roomy_agreement(self.model, self.tokenizer, self.calibration))

    @cached_property
    def saturation(self) -> dict:
        """Static INT8 scales calibrated on 16 title-page tokens (notebook 03 §4), plain and widened 1.2x."""
        return self._part(SATURATION)

    @cached_property
    def sensitivity(self) -> list[float]:
        """KL with only one layer's cache INT4, per layer, in notebook 03's setting."""
        tokens = text_tokens(self.tokenizer, 128, play="twelfth-night", offset=1024)
        return self._timed("sensitivity", lambda: layer_sensitivity(self.model, tokens, self.calibration, chunk=64))

    @cached_property
    def speedups(self) -> list[dict]:
        """Recompute vs cache at 32- and 256-token prompts, 16 new tokens each (notebook 01), one run each:
        three runs' speed-ups stayed within 4 % of each other (2.2-2.4x and 5.8-6.0x on 2 cores)."""
        return self._timed("speedups", lambda: recompute_vs_cache(self.model, self.tokenizer, prompt_lens=(32, 256),
                                                                  new_tokens=16, repeats=1))

    @cached_property
    def step_ms(self) -> dict[tuple[str, int], float]:
        """Median decode-step ms at batch 1 and 16, short and 1,000-token contexts (notebook 04 §5)."""
        def run():
            prompts = chat_prompts(self.tokenizer)
            long_text = text_tokens(self.tokenizer, 1000, offset=4000)
            out = {}
            for context in ("short", "1k"):
                for batch in (1, 16):
                    reqs = ([prompts[i % len(prompts)] for i in range(batch)] if context == "short"
                            else [long_text + [200 + i] for i in range(batch)])
                    eng = LLM(self.model, self.tokenizer, num_blocks=200, block_size=16, max_num_seqs=batch,
                              max_num_batched_tokens=1024)
                    eng.generate(reqs, SamplingParams(max_tokens=6, ignore_eos=True))
                    pure = [s.total_s for s in eng.step_stats if s.prefill_tokens == 0 and s.decode_tokens == batch]
                    out[context, batch] = 1e3 * statistics.median(pure)
            return out
        return self._timed("step_ms", run)
