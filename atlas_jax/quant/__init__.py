"""Weight-only quantization for serving: int8, int4 and FP8 projections, dequantized in the step.

`quantize_model(model, "int8")` replaces the model's attention and MLP projections (and the MoE
experts', and optionally the LM head) with qwix `QArray`s: the 8- or 4-bit values, shaped as the
float weight, and float32 scales of the same rank:

  int8  symmetric, one scale per output channel (per layer, per expert)
  int4  symmetric, one scale per output channel and per `group_size` contracted inputs
  fp8   float8_e4m3fn values, one scale per output channel

The values and scales are what the device holds; the step's matmuls (`atlas_jax.model.layers`)
dequantize them as they multiply, so the compiled step's weight arguments shrink to about 1/4
(int8, fp8) or 1/8 (int4) of float32. Embeddings, norms, biases, routers and LoRA adapters stay
in the model's dtype. qwix's array API (`qwix.quantize`, `qwix.dequantize`) does the numerics;
its model-level PTQ provider cannot be used here (see README: it swaps a parameter by mutating
the module that calls the matmul, which inside the layer scan is a per-layer copy at another
trace level).
"""

from atlas_jax.quant.weights import (
  FORMATS,
  PROJECTIONS,
  QArray,
  StaticQArray,
  contracted_axes,
  dequantize_model,
  dequantized,
  is_quantized,
  quantize_model,
  quantize_weight,
  quantized_product,
  w8a8_experts,
  w8a8_grouped_product,
  w8a8_product,
)

__all__ = [
  "FORMATS",
  "PROJECTIONS",
  "QArray",
  "StaticQArray",
  "contracted_axes",
  "dequantize_model",
  "dequantized",
  "is_quantized",
  "quantize_model",
  "quantize_weight",
  "quantized_product",
  "w8a8_experts",
  "w8a8_grouped_product",
  "w8a8_product",
]
