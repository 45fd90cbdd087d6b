"""XLA's CPU backend as a specialisation of the serving runner.

The accelerator runner (`atlas_jax.serving.runner.ModelRunner`) is the base: one ragged step per
engine iteration, the weights as the model holds them, programs under plain `jax.jit`. On a CPU
that layout leaves speed behind, for reasons of XLA's CPU backend alone, and `CPUModelRunner`
changes what differs through the base's hooks, chosen once when the engine starts
(`serve.engine.runner`, "auto" on a CPU backend):

* how the weights are held (`hold`, `weights`): XLA's CPU backend copies each layer's weights
  out of a stacked array before its matmuls, so layers above a size are held one array each and
  run as an unrolled loop; projections may be held transposed ("out-major") where the CPU's
  GEMMs read them faster;
* how a step's rows become calls (`execute`, `shapes`): prompts cut into 16-token segments, one
  row each, in fine batch buckets (XLA's paged loop walks each row's own pages, so a segment
  costs its own tokens, where a ragged block would pad to the longest), decode rows carried in
  the segments' padding, or run by the burst program for one iteration (one program per batch
  bucket for both);
* how programs compile (`compile`): YNNPACK's dots, XLA's own dots for a few rows, YNNPACK's
  reductions for the decode attention at a few rows, each chosen per row count (`ByRows`).

Which of those wins depends on the CPU (its cache sizes and vector units), so `auto` settings
time them once (`probes`) and keep the answer beside jax's compilation cache, so the next start
takes the same plan and its programs load from the cache.
"""

from atlas_jax.serving.cpu.runner import CPUModelRunner

__all__ = ["CPUModelRunner"]
