"""The step-N folder: its one home (one-process and sharded checkpoints, the optimizer state, Hugging Face export)."""
