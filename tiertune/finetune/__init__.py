"""tiertune.finetune: see DESIGN.md; lands with its issue."""
