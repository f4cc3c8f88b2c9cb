"""What a fine-tuning method adds to the engine: LoRA/DoRA adapters through peft (``lora``), and the
optimizers' arithmetic (``optim``: AdamW as torch's fused kernel, 8-bit AdamW as bitsandbytes', GaLore's
low-rank update). Their settings are ``tiertune.settings``."""
