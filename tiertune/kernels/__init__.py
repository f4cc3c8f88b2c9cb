"""tiertune.kernels: see DESIGN.md; lands with its issue."""
