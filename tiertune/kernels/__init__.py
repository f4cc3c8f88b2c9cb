"""Fused GPU kernels (Triton) with exact torch references, and the patching of model modules to use them."""
