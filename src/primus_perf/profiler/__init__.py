"""Capture: run the trainer (or any step function) under torch.profiler."""
