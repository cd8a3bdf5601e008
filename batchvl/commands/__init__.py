"""The commands beside `run`: retry-failed, status, slurm, export (the labels table) and the report."""
