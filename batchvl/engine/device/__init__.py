"""The device: which one a process runs on (`placement.py`), waiting for its queued kernels (`sync.py`), and
decode steps replayed as CUDA graphs (`decode_graphs.py`, captured by `graph_capture.py`), and reading a small
tensor back without waiting for the rest (`host_copy.py`).

CUDA-only pieces (CUDA graph capture and replay, streams that overlap a step's host work with the GPU) go
in this wing, imported only where the device is CUDA, so that a CPU run never loads them: `graph_capture`
gives no capture off CUDA, and `decode_graphs` is imported only where one is given."""
