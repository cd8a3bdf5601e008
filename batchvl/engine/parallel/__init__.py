"""Parallelism beyond one engine in one process: ViT data parallelism across torchrun ranks (`vit_dp.py`)
and engine replicas side by side on the CPU (`replicas.py`)."""
