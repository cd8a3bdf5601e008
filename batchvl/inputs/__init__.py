"""Inputs: the readers that list and stream shards (Parquet, WebDataset, saved datasets, folders, OpenAI
batch files), the media cells of table rows, and downloads."""
