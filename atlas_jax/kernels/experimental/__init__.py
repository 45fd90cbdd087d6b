"""Kernels that have not yet run on the hardware they are written for, kept apart from the ones
that have. Nothing in the library imports them or picks them.

* `flash_mgpu`: FlashAttention for Hopper in Pallas's Mosaic GPU backend, forward and backward;
  here until `python bench/gpu.py --only mgpu` passes once on a Hopper GPU.
"""
