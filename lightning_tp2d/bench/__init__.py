"""Benchmarks: throughput, memory, maximum sequence length and communication of every layout side by side with
PyTorch's own 1-D tensor parallelism, and the cost model that projects them to many GPUs."""
