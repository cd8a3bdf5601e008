"""Outputs: result rows and their Parquet files, the exactly-once shard commit, shard claims, committed
results read back, and the run stats files."""
