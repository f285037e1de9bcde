"""Post-training quantisation: FP8 linear layers (litevlm.quant.fp8)."""

from litevlm.quant.fp8 import (
    FP8Linear,
    FP8Recipe,
    QuantReport,
    calibrate,
    load_fp8,
    precision_of,
    quantize_model,
    read_fp8_meta,
    save_fp8,
)

__all__ = [
    "FP8Linear",
    "FP8Recipe",
    "QuantReport",
    "calibrate",
    "load_fp8",
    "precision_of",
    "quantize_model",
    "read_fp8_meta",
    "save_fp8",
]
