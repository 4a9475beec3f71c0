"""From stored bytes to the numbers a matmul takes: the decode kernel's conversion variants (notebook 05).

On Hopper ``int8.to(tl.float16)`` is one ``cvt`` per value, on a pipe of 16 results per clock per SM
against 256 for fp16 arithmetic: at batch 32 x 16K tokens as long as reading the bytes. Each way round
is a ``convert=`` variant of :func:`~kvlab.kernels.decode.paged_decode`:

| variant | int8 value -> fp16                                                    | runs under the interpreter |
|---------|-----------------------------------------------------------------------|----------------------------|
| `cast`  | ``x.to(tl.float16)``: one ``cvt`` per value                           | yes |
| `magic` | the byte ``x ^ 0x80`` as the low byte of fp16 ``0x64XX`` = 1024 + (x + 128), minus 1152: integer ops and one fp16 subtract, no ``cvt`` | yes |
| `prmt`  | the same trick four values at a time in inline PTX: one ``xor``, two ``prmt`` (byte permute), two ``sub.f16x2`` (LMDeploy's ``cvt_f16x4_u8`` idea) | no: inline assembly; :func:`prmt_replica` replays it |
| `bf16`  | ``x.to(tl.bfloat16)`` and bf16 matmuls: Triton's own Hopper fast path | no: the interpreter keeps bf16 as raw integers |
| `dot8`  | K is never converted: q is quantized per row to int8 and QK^T runs as an int8 x int8 -> int32 ``tl.dot`` (as SageAttention does); V as `magic` | yes |

int4 values take the same trick with ``0x6400 | n`` = 1024 + n, minus 1032 (the stored nibble is
q + 8). Every variant gives bit-identical values to ``cast`` (``dot8``: a quantized q).
"""

from __future__ import annotations

import numpy as np

#: how stored integers become matmul operands, the kernel's codes: RAW = not at all (dot8's K, an int8 dot)
CAST, MAGIC, PRMT, RAW = 0, 1, 2, 3
#: the conversion variants of paged_decode, in the order the notebook shows them: (K code, V code)
CONVERT_CODES = {"cast": (CAST, CAST), "magic": (MAGIC, MAGIC), "prmt": (PRMT, PRMT), "bf16": (CAST, CAST),
                 "dot8": (RAW, MAGIC)}
CONVERSIONS = tuple(CONVERT_CODES)
#: which of them Triton's interpreter cannot run, and why
NOT_INTERPRETABLE = {
    "prmt": "inline PTX (tl.inline_asm_elementwise) cannot run in Triton's interpreter; "
            "kvlab.kernels.convert.prmt_replica replays its instructions on the CPU",
    "bf16": "Triton's interpreter keeps bf16 as raw 16-bit integers (its dots and casts on them are wrong)",
}

#: fp16 bit patterns of the magic numbers: 0x6400 is 1024.0, whose last mantissa bit is worth exactly 1
F16_1024 = 0x6400
INT8_BIAS = 1152.0  # 1024 + 128: x ^ 0x80 is x + 128 as an unsigned byte
INT4_BIAS = 1032.0  # 1024 + 8: the stored nibble is q + 8
#: the PTX of the prmt variant: $2 holds four int8 values (value 0 in the low byte), $0 and $1 get
#: values 0-1 and 2-3 as fp16 pairs (value 0 in the low half)
PRMT_ASM = """{
.reg .b32 t, m;
xor.b32 t, $2, 0x80808080;
mov.b32 m, 0x64806480;
prmt.b32 $0, t, 0x64646464, 0x7170;
prmt.b32 $1, t, 0x64646464, 0x7372;
sub.f16x2 $0, $0, m;
sub.f16x2 $1, $1, m;
}"""


def check_convert(convert: str) -> str:
    if not isinstance(convert, str) or convert not in CONVERSIONS:
        raise ValueError(f"convert must be one of {CONVERSIONS}, got {convert!r}")
    return convert


# ---- Python replicas: the same bit operations on numpy arrays, exhaustively testable -----------------

def magic_int8_replica(x) -> np.ndarray:
    """The `magic` variant on numpy: int8 values -> fp16, through their bits only."""
    u = np.asarray(x, dtype=np.int8).view(np.uint8) ^ np.uint8(0x80)  # x + 128, as an unsigned byte
    h = (u.astype(np.uint16) | np.uint16(F16_1024)).view(np.float16)  # 1024 + (x + 128), exactly
    return h - np.float16(INT8_BIAS)


def magic_int4_replica(n) -> np.ndarray:
    """int4 nibbles n = q + 8 (0..15) -> q as fp16, through their bits only."""
    n = np.asarray(n, dtype=np.uint8) & np.uint8(0x0F)
    return (n.astype(np.uint16) | np.uint16(F16_1024)).view(np.float16) - np.float16(INT4_BIAS)


def prmt(a: int, b: int, selector: int) -> int:
    """PTX ``prmt.b32 d, a, b, c``: byte i of d is byte ``c[4i+2:4i]`` of {b, a}, or its sign if bit 4i+3."""
    pool = (a & 0xFFFFFFFF) | ((b & 0xFFFFFFFF) << 32)
    d = 0
    for i in range(4):
        nib = (selector >> (4 * i)) & 0xF
        byte = (pool >> (8 * (nib & 7))) & 0xFF
        if nib & 8:
            byte = 0xFF if byte & 0x80 else 0x00
        d |= byte << (8 * i)
    return d


def _sub_f16x2(a: int, b: int) -> int:
    """``sub.f16x2 d, a, b``: two fp16 lanes, each rounded to nearest (as PTX does)."""
    la = np.array([a & 0xFFFF, a >> 16], dtype=np.uint16).view(np.float16)
    lb = np.array([b & 0xFFFF, b >> 16], dtype=np.uint16).view(np.float16)
    r = (la - lb).view(np.uint16)
    return int(r[0]) | int(r[1]) << 16


def prmt_replica(word: int) -> np.ndarray:
    """:data:`PRMT_ASM` replayed on one 32-bit word of four int8 values: their four fp16 values."""
    t = (word ^ 0x80808080) & 0xFFFFFFFF
    m = 0x64806480
    r0 = _sub_f16x2(prmt(t, 0x64646464, 0x7170), m)
    r1 = _sub_f16x2(prmt(t, 0x64646464, 0x7372), m)
    return np.array([r0 & 0xFFFF, r0 >> 16, r1 & 0xFFFF, r1 >> 16], dtype=np.uint16).view(np.float16)


def quantize_rows_replica(q: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """`dot8`'s q: rows to int8 at max|row| / 127 (zero rows: 1), rounded half up as the kernel does."""
    q = np.asarray(q, dtype=np.float32)
    amax = np.abs(q).max(axis=-1)
    scale = np.where(amax > 0, amax / 127.0, 1.0).astype(np.float32)
    q8 = np.clip(np.floor(q / scale[..., None] + 0.5), -127, 127).astype(np.int8)
    return q8, scale


__all__ = ["CONVERSIONS", "CONVERT_CODES", "CAST", "MAGIC", "PRMT", "RAW", "NOT_INTERPRETABLE", "PRMT_ASM", "check_convert", "magic_int8_replica",
           "magic_int4_replica", "prmt", "prmt_replica", "quantize_rows_replica", "INT8_BIAS", "INT4_BIAS"]
