"""HQQ's codes, held by the integer storage forms: `quantize`, `dequantize`, `Codes` (`storage_forms/hqq_codes.py`)."""

from ...storage_forms.hqq_codes import SUPPORTED_BITS, Codes, dequantize, quantize, require

__all__ = ["SUPPORTED_BITS", "Codes", "dequantize", "quantize", "require"]
