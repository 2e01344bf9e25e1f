"""Tensor-parallel building blocks; each parameter carries the `weight_loader` that shards it."""
