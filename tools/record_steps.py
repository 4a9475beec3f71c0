"""Record notebook 04 section 5's quiet run into kvlab/bench/steps_recorded.json: the decode-step sweep and
the chunked-prefill rounds, judged by the same rules the notebook prints. Run it alone on a machine with
nothing else running (two torch processes on 2 cores slow each other many times over):

    .venv/bin/python tools/record_steps.py
"""
from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

import kvlab
from kvlab.bench import steps as S
from kvlab.data import chat_prompts, text_tokens

QUESTIONS = ["What is the capital of France?", "Write a haiku about autumn.", "Name three primary colours.",
             "Why do cats purr?", "Explain a KV cache in one sentence.", "What is 12 times 12?",
             "Give me a synonym for happy.", "Translate 'good morning' into Spanish."]  # notebook 04's


def cpu_name() -> str:
    try:
        return next(line.split(":", 1)[1].strip() for line in Path("/proc/cpuinfo").read_text().splitlines()
                    if line.startswith("model name"))
    except (OSError, StopIteration):
        return platform.processor() or platform.machine()


def main() -> None:
    kvlab.setup()
    model, tokenizer = kvlab.load_model("smollm2-135m")
    prompts = chat_prompts(tokenizer, QUESTIONS)
    sweep = S.decode_sweep(model, tokenizer, prompts, text_tokens(tokenizer, 1000, offset=4000))
    chunking = S.chunking_rounds(model, tokenizer, prompts, text_tokens(tokenizer, 700, offset=2000))
    chunking.pop("engines")
    S.RECORDED.write_text(json.dumps({"machine": f"{cpu_name()}, {os.cpu_count()} cores, nothing else running",
                                      "date": time.strftime("%Y-%m-%d"), "sweep": sweep, "chunking": chunking},
                                     indent=1) + "\n")
    print("\n".join(S.sweep_verdicts(sweep) + S.chunking_verdicts(chunking)))


if __name__ == "__main__":
    main()
