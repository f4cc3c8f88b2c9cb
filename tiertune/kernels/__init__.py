"""Fused GPU kernels (Triton) with exact torch references, and the patching of model modules to use them."""

KERNEL_CHOICES = ("auto", "torch", "triton")
"""The values of a recipe's ``kernels`` (the engine also takes ``none``: the model's own modules)."""
