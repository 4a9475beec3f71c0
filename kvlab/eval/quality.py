"""How much does a KV format cost in quality, and which layers can take fewer bits (notebook 03)?

Each config runs in lockstep with a full-precision reference through the SAME paged path, fed in
chunks: a chunk reads its own K/V in full precision and everything before it through the cache,
so smaller chunks test more of the cache (``chunk=1`` is pure decode).
"""

from __future__ import annotations

import math
import time
from contextlib import contextmanager
from dataclasses import replace

import torch

from kvlab.cache import BlockManager, QuantizedPagedKVCache, saturation_summary
from kvlab.cache.paged import check_token_ids
from kvlab.engine import ModelRunner, SamplingParams, Sequence
from kvlab.engine.scheduler import SchedulerOutput
from kvlab.generate import paged_generate
from kvlab.probe import paged_attention_spec
from kvlab.quant.config import FP32, KVQuantConfig, TensorFormat, named_config
from kvlab.sizing import kv_config, kv_size
from kvlab.validate import cdiv, is_int


class PoolRunner:
    """Sequences through one pool on the engine's own runner and packed weights, the path a served request
    takes, asked for the logits of every position. Several run side by side in one step (:meth:`forward_many`)."""

    def __init__(self, model, config: KVQuantConfig, calibration, sequences: list[list[int]], block_size: int):
        blocks = sum(cdiv(len(x), block_size) for x in sequences)
        self.bm = BlockManager(blocks, block_size, enable_prefix_caching=False)
        self.cache = QuantizedPagedKVCache.from_model(model, blocks, block_size, config, calibration)
        self.runner = ModelRunner(model, self.cache, "reference", prepack=True)
        self.seqs = [Sequence(i, x, SamplingParams(), arrival=0.0) for i, x in enumerate(sequences)]

    def forward(self, piece: list[int]) -> torch.Tensor:
        """Logits (len(piece), V) of the first sequence's next chunk (a runner of one sequence)."""
        return self.forward_many({0: piece})[0]

    def forward_many(self, pieces: dict[int, list[int]], as_decodes: bool = False) -> dict[int, torch.Tensor]:
        """Each listed sequence's next chunk in ONE step: sequence index -> logits (len(piece), V).
        ``as_decodes``: the chunk attends as if decoded a token a step (see ``ModelRunner.execute_model``)."""
        seqs = [self.seqs[i] for i in pieces]
        for seq, piece in zip(seqs, pieces.values()):
            start = seq.num_computed_tokens
            assert seq.token_ids[start:start + len(piece)] == list(piece), "chunks out of order"
            if start == 0:
                self.bm.allocate(seq.seq_id, piece)
            else:
                for t in piece:
                    self.bm.append_slot(seq.seq_id, t)
        lens = [len(p) for p in pieces.values()]
        decodes = sum(1 for seq, n in zip(seqs, lens) if n == 1 and seq.num_computed_tokens > 0)
        assert decodes in (0, len(seqs)), "a step is all prefill chunks or all decodes"
        step = SchedulerOutput(step=0, seqs=seqs, num_new_tokens=lens, num_decodes=decodes)
        logits, _ = self.runner.execute_model(step, self.bm, all_logits=True, as_decodes=as_decodes)
        out, at = {}, 0
        for i, seq, n in zip(pieces, seqs, lens):
            seq.num_computed_tokens += n
            out[i] = logits[at:at + n].float()
            at += n
        return out


def _decoder_layers(model) -> list | None:
    """The model's decoder layers in order (HF's ``get_decoder().layers``), or None where it has none."""
    layers = getattr(model.get_decoder(), "layers", None) if hasattr(model, "get_decoder") else None
    return layers if isinstance(layers, torch.nn.ModuleList) else None


@contextmanager
def _as_fp_below(layers, outputs: list, below: int | None):
    """``below=None`` (the FP run): record each decoder layer's output into ``outputs``. Else layers under
    ``below`` return the FP run's outputs instead of computing them again: their K/V are full precision,
    their input the FP run's, so they would compute exactly that (a layer-sensitivity config quantizes one
    layer: the layers under it are the FP run's). Nothing reads the K/V they skip writing."""
    handles, patched = [], list(zip(layers[:below or 0], outputs))
    if below is None:
        outputs.clear()  # a layer's output is the next one's input, never changed in place (HF's decoder layers)
        handles = [layer.register_forward_hook(lambda _m, _a, out: outputs.append(out)) for layer in layers]
    own = [(layer, layer.__dict__.get("forward")) for layer, _ in patched]  # a hook library's own, kept
    for layer, out in patched:
        layer.forward = lambda *_a, out=out, **_k: out
    try:
        yield
    finally:
        for h in handles:
            h.remove()
        for layer, forward in own:
            if forward is None:
                layer.__dict__.pop("forward", None)
            else:
                layer.forward = forward


def _windows(n: int, window: int, stride: int):
    """(start, end, first target relative to start) of windows scoring every target once, with up to
    window - stride tokens of context."""
    _check_window(window, stride)
    start, done = 0, 0  # targets 1..done are scored
    while True:
        end = min(start + window, n)
        yield start, end, done + 1 - start
        done = end - 1
        if end == n:
            return
        start += stride


def _check_window(window: int, stride: int) -> None:
    if window < 2 or not 1 <= stride <= window:
        raise ValueError(f"need window >= 2 and 1 <= stride <= window, got window={window}, stride={stride}")


def check_scoring(num_tokens: int, window: int, stride: int, chunk: int, block_size: int = 16) -> None:
    """Checked before any model work (``kvlab ppl`` calls it before loading the model)."""
    for name, value in (("window", window), ("stride", stride), ("chunk", chunk), ("block_size", block_size)):
        if not is_int(value):
            raise TypeError(f"{name} must be an integer, got {value!r}")
    if num_tokens < 2:
        raise ValueError("need at least 2 tokens to score")
    if chunk < 1:
        raise ValueError(f"chunk must be >= 1, got {chunk}")
    fed = min(window, num_tokens) - 1  # positions each window feeds (its last token is only a target)
    if chunk >= fed and fed > 1:
        raise ValueError(f"chunk must be smaller than the {fed} positions a window feeds, got chunk={chunk}: in a "
                         "single chunk every position attends to its own K/V in full precision, so the cache "
                         "under test would never be read")
    _check_window(window, stride)


def check_tokens(tokens, vocab_size: int) -> list[int]:
    """Token ids in the model's vocabulary: an id outside it would fail deep in the embedding."""
    if isinstance(tokens, torch.Tensor):
        tokens = tokens.flatten().tolist()
    if not isinstance(tokens, (list, tuple)):
        raise TypeError(f"tokens must be a list of token ids, got {type(tokens).__name__}")
    return check_token_ids(tokens, "tokens", vocab_size)


def _check_configs(configs) -> None:
    if not isinstance(configs, dict):
        raise TypeError(f"configs must be a dict name -> KVQuantConfig, got {type(configs).__name__}")
    for name, cfg in configs.items():
        if not isinstance(cfg, KVQuantConfig):
            raise TypeError(f"configs[{name!r}] must be a KVQuantConfig (e.g. kvlab.quant.named_config('int8')), "
                            f"got {cfg!r}")
    if "fp" in configs:
        raise ValueError("configs must not use the name 'fp': it is the full-precision reference every config is "
                         "compared with")


@torch.inference_mode()
def evaluate(model, tokens: list[int], configs: dict, calibration=None, window: int = 512, stride: int = 256,
             chunk: int = 32, block_size: int = 16) -> dict:
    """Perplexity, KL(FP || config) and top-1 agreement of each config against FP, on the same positions.

    ``delta_ppl_ci95`` is a paired 95 % interval from per-token NLL differences, positions taken as
    independent (not quite): a scale of the noise on THIS text, not across texts. ``calibration``: one for
    every config, or a dict config name -> its own (configs compared on one FP run)."""
    tokens = check_tokens(tokens, model.config.vocab_size)
    _check_configs(configs)
    scales = calibration if isinstance(calibration, dict) else dict.fromkeys(configs, calibration)
    if set(scales) != set(configs):
        raise ValueError(f"calibration as a dict needs one entry per config: {sorted(map(str, configs))}")
    check_scoring(len(tokens), window, stride, chunk, block_size)
    paged_attention_spec(model)  # a model the paged attention cannot run is refused before any work
    names = ["fp"] + list(configs)
    nll = {n: 0.0 for n in names}
    kl = {n: 0.0 for n in configs}
    dsum = {n: 0.0 for n in configs}  # per-token NLL differences (config - FP): sum and sum of squares
    dsq = {n: 0.0 for n in configs}
    top1 = {n: 0 for n in configs}
    scored = 0
    seconds = {n: 0.0 for n in names}
    stats = {}
    layers = _decoder_layers(model)
    full = (FP, FP)  # layers under a config's first quantized one run as the FP run's (_as_fp_below)
    below = {n: 0 if configs[n].rotate_k else next((i for i in range(len(layers)) if configs[n].formats(i) != full),
                                                   len(layers)) for n in configs} if layers is not None else {}
    reuse = any(below.values())
    fp_out: list = []

    def run(n, piece):
        if not reuse:
            return runners[n].forward(piece)
        with _as_fp_below(layers, fp_out, None if n == "fp" else below[n]):
            return runners[n].forward(piece)
    for w_start, w_end, first in _windows(len(tokens), window, stride):
        ids = tokens[w_start:w_end]
        runners = {n: PoolRunner(model, FP32 if n == "fp" else configs[n], None if n == "fp" else scales[n], [ids],
                                 block_size) for n in names}
        for c0 in range(0, len(ids) - 1, chunk):
            piece = ids[c0:min(c0 + chunk, len(ids) - 1)]  # the last token is only a target
            targets = torch.tensor(ids[c0 + 1:c0 + 1 + len(piece)])
            keep = torch.arange(c0, c0 + len(piece)) >= first - 1  # position p predicts target p + 1
            if not keep.any():
                for n in names:  # context only: still feed it through every cache
                    run(n, piece)
                continue
            tg = targets[keep]
            ref = p_ref = top_ref = fp_nll = None
            for n in names:  # FP first; each config's (T, V) log-probs reduced at once, not held: the FP run's
                t0 = time.perf_counter()  # and one config's, however many configs (layer sensitivity scores 30)
                logp = torch.log_softmax(run(n, piece), -1)[keep]
                seconds[n] += time.perf_counter() - t0
                token_nll = -logp.gather(1, tg[:, None])[:, 0].double()
                nll[n] += token_nll.sum().item()
                if n == "fp":
                    ref, p_ref, top_ref, fp_nll = logp, logp.exp(), logp.argmax(-1), token_nll
                    continue
                d = token_nll - fp_nll
                dsum[n] += d.sum().item()
                dsq[n] += d.pow(2).sum().item()
                kl[n] += (p_ref * (ref - logp)).sum().item()
                top1[n] += (logp.argmax(-1) == top_ref).sum().item()
            scored += int(keep.sum())
        for n in configs:  # counters add up over windows (each window has a fresh pool)
            sat = runners[n].cache.saturation()
            if n in stats:
                sat = {w: {c: stats[n][w][c] + t for c, t in cs.items()} for w, cs in sat.items()}
            stats[n] = sat
    out = {"tokens": len(tokens), "scored": scored, "window": window, "stride": stride, "chunk": chunk,
           "ppl_fp": math.exp(nll["fp"] / scored), "configs": {}}
    for n in configs:
        ppl = math.exp(nll[n] / scored)
        mean = dsum[n] / scored
        se = math.sqrt(max(dsq[n] / scored - mean * mean, 0.0) / max(scored - 1, 1))
        ci = tuple(100 * (math.exp(mean + z * 1.96 * se) - 1) for z in (-1, 1))
        out["configs"][n] = {"label": configs[n].label(), "ppl": ppl,
                             "delta_ppl_pct": 100 * (ppl / out["ppl_fp"] - 1), "delta_ppl_ci95": ci,
                             "kl": kl[n] / scored,
                             "top1": top1[n] / scored, "seconds": seconds[n], "saturation": stats[n],
                             **saturation_summary(stats[n])}
    return out


def kv_bytes_per_token(model, config: KVQuantConfig) -> float:
    """Bytes one token adds under ``config``: data and per-token scales (static scale tables amortised)."""
    cfg = kv_config(model)
    one = dict(num_hidden_layers=1, num_attention_heads=cfg.num_heads, num_key_value_heads=cfg.num_kv_heads,
               head_dim=cfg.head_dim)
    total = 0.0
    for layer in range(cfg.num_layers):
        for fmt in config.formats(layer):
            total += kv_size(one, fmt.dtype, tokens=1, scales=fmt.sizing_scales,
                             zero_points=fmt.dtype == "int4" and not fmt.symmetric).bytes_per_token / 2
    return total


@torch.inference_mode()
def greedy_comparison(model, prompts: list[list[int]], config: KVQuantConfig, calibration=None,
                      max_new_tokens: int = 32, block_size: int = 16) -> dict:
    """Greedy generation through the quantized pool against full precision, per prompt. After a first
    divergence the texts go separate ways, so the divergence points are the measure."""
    blocks = sum(cdiv(len(p) + max_new_tokens, block_size) for p in prompts)
    runs = []
    for cfg in (FP32, config):
        bm = BlockManager(blocks, block_size, enable_prefix_caching=False)
        cache = QuantizedPagedKVCache.from_model(model, blocks, block_size, cfg, calibration)
        runs.append(paged_generate(model, prompts, max_new_tokens, manager=bm, cache=cache).token_ids)
    first = []
    for ra, rb in zip(*runs):
        diff = next((i for i, (a, b) in enumerate(zip(ra, rb)) if a != b), None)
        if diff is None and len(ra) != len(rb):
            diff = min(len(ra), len(rb))
        first.append(diff)
    same = sum(a == b for ra, rb in zip(*runs) for a, b in zip(ra, rb))
    return {"first_divergence": first, "identical": sum(d is None for d in first), "prompts": len(prompts),
            "position_share": same / sum(len(r) for r in runs[0]), "token_ids": runs}


@torch.inference_mode()
def teacher_forced(model, sequences: list[list[int]], starts: list[int], config: KVQuantConfig, calibration=None,
                   block_size: int = 16) -> dict:
    """Top-1 agreement with given answers, fed through the quantized pool: the rate *on the answers' own
    path*; ``intact`` counts answers greedy decoding would leave unchanged, ``top1_fp32`` is the floor
    set by float rounding alone."""
    if len(sequences) != len(starts):
        raise ValueError(f"starts must give one answer start per sequence ({len(sequences)}), got {len(starts)}")
    seqs = []
    for ids, start in zip(sequences, starts):
        ids = check_tokens(ids, model.config.vocab_size)
        if not is_int(start) or not 1 <= start < len(ids):
            raise ValueError(f"each start must be an int in [1, len(sequence)), got {start!r} for {len(ids)} tokens")
        seqs.append(ids)
    # every sequence side by side, as the engine serves them: the prompts in one prefill step, then the
    # answers as decoding feeds them (each token reading every earlier one back from the pool, itself at
    # full precision: as_decodes), a few sequences' answers per forward instead of a step per token
    agree, miss = {"q": 0, "fp": 0}, [None] * len(seqs)
    for n, config_n in (("q", config), ("fp", FP32)):
        r = PoolRunner(model, config_n, calibration, [ids[:-1] for ids in seqs], block_size)
        first = r.forward_many({i: ids[:start] for i, (ids, start) in enumerate(zip(seqs, starts))})
        preds = {i: [int(lg[-1].argmax())] for i, lg in first.items()}  # the prompt's last position: the 1st answer token
        group, size = {}, 0
        for i, (ids, start) in enumerate(zip(seqs, starts)):
            if len(ids) - 1 > start:
                group[i], size = ids[start:-1], size + len(ids) - 1 - start
            if group and (size >= 512 or i == len(seqs) - 1):  # bounded logits memory: (tokens, vocab) floats
                for j, lg in r.forward_many(group, as_decodes=True).items():
                    preds[j] += lg.argmax(-1).tolist()
                group, size = {}, 0
        for i, (ids, start) in enumerate(zip(seqs, starts)):
            hits = [p == t for p, t in zip(preds[i], ids[start:])]
            agree[n] += sum(hits)
            if n == "q" and not all(hits):
                miss[i] = hits.index(False)
    scored = sum(len(ids) - start for ids, start in zip(seqs, starts))
    return {"positions": scored, "top1": agree["q"] / scored, "top1_fp32": agree["fp"] / scored,
            "intact": sum(m is None for m in miss), "sequences": len(sequences), "first_miss": miss}


def greedy_agreement(model, prompts: list[list[int]], config: KVQuantConfig, calibration=None,
                     max_new_tokens: int = 32, block_size: int = 16) -> float:
    """Share of greedy tokens equal to full precision's, position by position (:func:`greedy_comparison`)."""
    return greedy_comparison(model, prompts, config, calibration, max_new_tokens, block_size)["position_share"]


# ---- mixed precision: which layers can take fewer bits? Measure, then choose under a byte budget ----

FP = TensorFormat("fp32")


def layer_sensitivity(model, tokens: list[int], calibration=None, chunk: int = 32,
                      policy: str = "static") -> list[float]:
    """KL per layer when only that layer's K and V are INT4 (the rest full precision)."""
    layers = kv_config(model).num_layers
    int4 = TensorFormat("int4")
    configs = {layer: KVQuantConfig(FP, FP, policy=policy, layers={layer: (int4, int4)}) for layer in range(layers)}
    res = evaluate(model, tokens, configs, calibration, window=len(tokens), stride=len(tokens), chunk=chunk)
    return [res["configs"][layer]["kl"] for layer in range(layers)]


def auto_config(model, sensitivity: list[float], budget_bytes_per_token: float,
                high: KVQuantConfig, low: KVQuantConfig) -> KVQuantConfig:
    """Every layer ``high``, then the least sensitive ones ``low`` until the budget holds (notebook 03)."""
    layers = len(sensitivity)
    chosen: dict[int, tuple] = {layer: high.formats(layer) for layer in range(layers)}
    cfg = replace(high, layers=dict(chosen))
    for layer in sorted(range(layers), key=lambda i: sensitivity[i]):
        if kv_bytes_per_token(model, cfg) <= budget_bytes_per_token:
            break
        chosen[layer] = low.formats(layer)
        cfg = replace(high, layers=dict(chosen))
    if kv_bytes_per_token(model, cfg) > budget_bytes_per_token:
        raise ValueError(f"budget {budget_bytes_per_token:.0f} B/token is below what the low format needs "
                         f"({kv_bytes_per_token(model, cfg):.0f} B/token)")
    return cfg
