"""Scheduling: what each step runs within its token budget, the paged KV blocks and prefix cache that
admission and preemption trade in, and how large the KV cache is. Ints and hashes only, no tensors."""
