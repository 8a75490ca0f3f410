"""Matrix products on quantized weights: fast ggml kernels and the naive reference beside them."""

from moeswap.quant.kernels import (
    MAX_TOKENS_PER_CALL, SUPPORTED_TYPES, CpuKernels, QuantExperts, QuantMatrix, needs_importance,
    quantize_rows)

__all__ = ["MAX_TOKENS_PER_CALL", "SUPPORTED_TYPES", "CpuKernels", "QuantExperts",
           "QuantMatrix", "needs_importance", "quantize_rows"]
