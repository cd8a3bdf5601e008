"""Parallelism beyond one engine in one process: the roles of the ranks torchrun starts (`ranks.py`), ViT
data parallelism across them (`vit_dp.py`), and engine replicas side by side on the CPU (`replicas.py`)."""
