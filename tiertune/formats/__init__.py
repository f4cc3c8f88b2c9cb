"""File formats tiertune writes for other programs: GGUF for llama.cpp (``gguf``). Below the run, so that a run
can write them while it trains (GRPO's rollouts from a llama.cpp server take the adapter as a GGUF LoRA each
step) as well as ``tiertune export`` after it."""

ADAPTER_FILE = "adapter_model.safetensors"
"""PEFT's adapter weights file in an adapter directory."""
PEFT_PREFIX = "base_model.model."
"""The prefix of a PEFT adapter's tensor names before the model's module names."""
