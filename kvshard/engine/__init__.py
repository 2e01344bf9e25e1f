"""The decode path on rank 0: request -> scheduler -> runner (all ranks) -> sampler -> output."""
