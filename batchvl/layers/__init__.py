"""Attention kernels and the paged KV cache's tensors: what both the engine (which calls them through the
model) and the model loader (which registers them with transformers) use."""
