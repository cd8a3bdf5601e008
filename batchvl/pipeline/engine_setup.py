"""What a run drives, chosen by `engine.backend`: the engine, how prompts are rendered for it, and how the
preprocessing workers prepare a sample for it.

- `batchvl`: the model is loaded and the engine built over it (`launch.py`); prompts are token ids, images
  pixel arrays.
- `openai`: no model; prompts are chat messages, images PNG data URLs, and the engine is a server's
  (`server_setup.py`), which `close` stops where batchvl launched it.
"""

from __future__ import annotations

from dataclasses import dataclass

from batchvl.engine.interface import EngineInterface
from batchvl.preprocess.sample import PromptBuilder, SampleProcessor


@dataclass
class EngineSetup:
    engine: EngineInterface
    prompts: PromptBuilder
    samples: SampleProcessor
