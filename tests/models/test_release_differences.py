"""What differs between the supported transformers releases, met by behaviour: the image-only processors
are found by name however registrations are kept (the parity tests run both ends in CI: make
test-oldest)."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_image_only_processors_are_found_by_name_where_registrations_under_transformers_configs_fail():
    """As transformers 5.17 does: its mapping's `register` silently skips a key defined by transformers."""
    code = """
from transformers.models.auto import auto_factory
register = auto_factory._LazyAutoMapping.register
def register_as_5_17(self, key, value, exist_ok=False):
    if getattr(key, "__module__", "").startswith("transformers."):
        return
    register(self, key, value, exist_ok)
auto_factory._LazyAutoMapping.register = register_as_5_17
from transformers.models.auto.processing_auto import processor_class_from_name
from batchvl.models.processor import IMAGE_ONLY_PROCESSORS
for processor in IMAGE_ONLY_PROCESSORS.values():
    assert processor_class_from_name(processor.__name__) is processor, processor
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT)
    assert done.returncode == 0, done.stderr
