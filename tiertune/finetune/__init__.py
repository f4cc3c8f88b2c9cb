"""The run around the engine: the training loop (``train``), the run directory and its checkpoints, the data,
signals, progress and logs, the ranks of a launch: see ARCHITECTURE.md."""
