"""The encoder cache: an image's embedding from memory, else disk, else the vision tower (`cache.py`),
with its bookkeeping (`bookkeeping.py`), its disk tier (`disk.py`; the files it may write, `disk_layout.py`;
their format, `disk_entry.py`) and the digest that ties disk entries to one vision tower
(`vision_digest.py`)."""
