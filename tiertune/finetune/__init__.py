"""Entry points (train, estimate, export, demo) and what they need around the engine: see ARCHITECTURE.md."""
