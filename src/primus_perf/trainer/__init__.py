"""Reference Megatron-style trainer: model, parallelism, configs, loop, dispatch."""
