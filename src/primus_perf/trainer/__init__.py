"""Reference Megatron-style trainer: model, parallelism, configs, data, loop."""
