"""``kvlab export-vllm``: the calibrated scales as vLLM checkpoint tensors + config (notebook 06)."""

from __future__ import annotations

import json

from kvlab import models  # through the module: tests swap models.load_model
from kvlab.export import export_vllm
from kvlab.cli.common import emit
from kvlab.cli.quant import calibration, read_files_first


def cmd_export_vllm(args) -> int:
    cal = read_files_first(args)
    model, tokenizer = models.load_model(args.model)
    cal = calibration(args, model, tokenizer, cal)  # --scales-file, else the cached default calibration
    res = export_vllm(args.out, cal, strategy=args.strategy, stat=args.calib, model=model)
    emit(res, args.json, [json.dumps(res, indent=2)])
    return 0
