"""Where files live: the output folder, local or on an object store (`OutputDir`), and the fsspec
filesystems that input URLs are read through."""
