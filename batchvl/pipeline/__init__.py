"""A run: plan the job, feed samples through the pool and the engine, turn results into rows, commit
complete shards, and end cleanly."""
