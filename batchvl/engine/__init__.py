"""The engine: requests in, results out, one step at a time (schedule, encode, forward, sample).

The core loop and its types sit at the top: `engine.py` (the loop), `request.py` (a request's state),
`model_runner.py` (the tensors: KV cache, packed forwards), `adapter.py` (what a model family provides),
`interface.py` (what the job loop drives), `builder.py` (the one place an engine is assembled), `stats.py`.
Everything else lives in a wing named for what it does:

- `scheduling/`: the token budget per step, admission, the paged KV blocks, the prefix cache, the KV
  cache's size.
- `encoder_cache/`: image embeddings from memory, disk or the vision tower (`cache.py` owns the lookup).
- `sampling/`: what becomes of a step's logits: sampling, log-probabilities, stop rules, grammars,
  scored choices.
- `parallel/`: more than one engine or process: ViT data parallelism, engine replicas on the CPU.
- `device/`: the device a process runs on and waiting for its kernels; the CUDA-only pieces (graph
  capture, streams for overlapped steps) belong here, imported only where the device is CUDA.
"""
