"""tiertune.quant: see DESIGN.md; lands with its issue."""
