"""Argument checks shared by every part of kvlab, and the one ceiling division: a bad argument gets a
ValueError that names it, shows the value and says what is allowed, before anything changes.
"""

from __future__ import annotations

import numbers

import torch


def cdiv(a: int, b: int) -> int:
    """Ceiling division for non-negative ints: blocks for ``a`` tokens of ``b`` each, tiles, splits."""
    return -(-a // b)


def is_int(value) -> bool:
    """An int that is not a bool (``True`` is an int in Python; as a count it is always a mistake)."""
    return isinstance(value, numbers.Integral) and not isinstance(value, bool)


def check_int(name: str, value, minimum: int | None = 1, maximum: int | None = None, what: str = "") -> int:
    """``value`` as an int (not a bool) within the bounds given; ``what`` is the unit ("tokens", "blocks")."""
    if not is_int(value) or (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        if minimum is not None and maximum is not None:
            allowed = f"an integer from {minimum} to {maximum}"
        elif minimum is not None:
            allowed = "a positive integer" if minimum == 1 else f"an integer >= {minimum}"
        elif maximum is not None:
            allowed = f"an integer <= {maximum}"
        else:
            allowed = "an integer"
        raise ValueError(f"{name} must be {allowed}{f' ({what})' if what else ''}, got {value!r}")
    return int(value)


def check_power_of_two(name: str, value, minimum: int = 1, maximum: int | None = None) -> int:
    """``value`` as an int, or a ValueError unless it is a power of two in [minimum, maximum]."""
    if not is_int(value) or value < minimum or (maximum is not None and value > maximum) or value & (value - 1):
        span = f"from {minimum} to {maximum}" if maximum is not None else f">= {minimum}"
        raise ValueError(f"{name} must be a power of two {span}, got {value!r}")
    return int(value)


def check_attention_features(h_q: int, window=None, softcap=None, sinks=None) -> None:
    """What an HF model may hand its attention besides Q, K and V (sliding windows, Gemma-2's soft cap,
    gpt-oss's sinks (H_q,)), checked once for the PyTorch specification and the Triton kernels."""
    if window is not None and (not is_int(window) or window < 1):
        raise ValueError(f"window must be a positive int (the keys a query sees, itself included) or None, "
                         f"got {window!r}")
    if softcap is not None and (isinstance(softcap, bool) or not isinstance(softcap, (int, float)) or not softcap > 0):
        raise ValueError(f"softcap must be a positive number or None, got {softcap!r}")
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (h_q,)):
        shape = tuple(sinks.shape) if isinstance(sinks, torch.Tensor) else type(sinks).__name__
        raise ValueError(f"sinks must be a tensor of one logit per query head, shape ({h_q},), got {shape}")


__all__ = ["cdiv", "is_int", "check_int", "check_power_of_two", "check_attention_features"]
