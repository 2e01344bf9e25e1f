"""Benchmarks: request workloads, a serving load generator, the TP vs TP+DCP experiment,
offline throughput, and the decode step against its memory-bandwidth floor (`kvshard bench`)."""
