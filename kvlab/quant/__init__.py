"""KV-cache quantization: quantizers, rotation, formats and scale policies, calibration data (notebook 03).

This package needs no model: the pool is :mod:`kvlab.cache.quantized`, calibrating a model is
:mod:`kvlab.calibrate`.
"""

from kvlab.quant.calibration import Calibration
from kvlab.quant.core import (GRANULARITIES, dequantize_int4, dequantize_int8, error_metrics,
                              int8_roundtrip, quantize_fp8, quantize_int4, quantize_int8, scale_from_absmax)
from kvlab.quant.config import FP32, KVQuantConfig, TensorFormat, named_config
from kvlab.quant.rotation import hadamard, rotate

__all__ = ["Calibration", "GRANULARITIES", "quantize_int8", "dequantize_int8",
           "int8_roundtrip", "quantize_int4", "dequantize_int4", "quantize_fp8", "error_metrics",
           "scale_from_absmax", "FP32", "KVQuantConfig", "TensorFormat", "named_config", "hadamard",
           "rotate"]
