"""What a run drives, chosen by `engine.backend`: the engine, how prompts are rendered for it, and how the
preprocessing workers prepare a sample for it.

The engine is started after the workers (`start_engine`): loading the model's weights and building the
engine (its KV cache, its decode graphs, the steps that size its steps), or starting a server, takes a
while, in which the workers prepare the first samples. A job on a GPU waited some 0.4 s for its first
sample when the workers started after the engine.
The start waits until every worker is forked (`PreprocessPool.forked`): a fork made while it launched a
subprocess (a server, a kernel compiler) would hold that subprocess's exec-status pipe open, and the start
would wait on it forever.

- `batchvl`: the model's weights are loaded and the engine built over them (`launch.py`); prompts are
  token ids, images pixel arrays, both prepared from the model's parts alone.
- `openai`: no model; prompts are chat messages, images PNG data URLs, and the engine is a server's
  (`server_setup.py`), which `close` stops where batchvl launched it.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from batchvl.engine.interface import EngineInterface
from batchvl.preprocess.sample import PromptBuilder, SampleProcessor


@dataclass
class EngineSetup:
    prompts: PromptBuilder
    samples: SampleProcessor
    start_engine: Callable[[], EngineInterface]  # builds the engine, or starts its server: once, when called
    # the most requests the engine takes in between two steps (`wants_requests`): its look-ahead window, or
    # the server's requests in flight; the run's feed holds as many prepared samples (`runner.feed_size`)
    input_window: int
