"""batchvl: batch, offline captioning and visual question answering with vision-language models."""

__version__ = "0.1.0"
