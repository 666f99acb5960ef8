"""What a training step runs: kernels and the routers that pick them (one router per kind)."""
