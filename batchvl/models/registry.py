"""Model families batchvl supports, keyed by the Hugging Face config's `model_type`."""

from __future__ import annotations

from batchvl.errors import UserError
from batchvl.models.qwen_vl import QwenVLAdapter

ADAPTERS = {
    "qwen2_vl": QwenVLAdapter,
}


def adapter_class(model_type: str):
    try:
        return ADAPTERS[model_type]
    except KeyError:
        supported = ", ".join(sorted(ADAPTERS))
        raise UserError(
            f"model type '{model_type}' is not supported; supported model types: {supported}"
        ) from None
