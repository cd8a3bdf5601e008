"""No module imports from a layer above its own: the ground (errors, config, utils) depends on nothing of
batchvl's above it, the engine calls models only through its own adapter protocol, and the attention
kernels live in `layers/`, which both the engine and the models use."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "batchvl"

# Lowest first. A module may import from its own layer or from a lower one. Top-level modules (job,
# plan, cli, ...), the report and the API are the application layer.
LAYERS = ["errors", "config", "utils", "io", "layers", "preprocess", "engine", "models"]
APPLICATION = len(LAYERS)


def layer_of(module: str) -> int:
    """`module` is a dotted name inside batchvl, e.g. 'engine.engine' or 'job'."""
    head = module.split(".")[0]
    return LAYERS.index(head) if head in LAYERS else APPLICATION


def imports_in(source: str) -> list[tuple[str, int]]:
    """(imported batchvl module, line) for every import in the source, function-level ones included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("batchvl."):
            found.append((node.module.removeprefix("batchvl."), node.lineno))
        elif isinstance(node, ast.Import):
            names = [alias.name for alias in node.names if alias.name.startswith("batchvl.")]
            found += [(name.removeprefix("batchvl."), node.lineno) for name in names]
    return found


def test_no_module_imports_from_a_layer_above_it():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts)
        for imported, line in imports_in(path.read_text()):
            if layer_of(imported) > layer_of(module):
                wrong.append(f"{path.relative_to(PACKAGE.parent)}:{line} imports batchvl.{imported}")
    assert wrong == []


def test_the_check_sees_imports_from_above_even_inside_functions():
    assert layer_of("utils.stats") < layer_of("engine.engine") < layer_of("models.loader") < layer_of("job")
    source = "import os\n\ndef load():\n    from batchvl.engine.engine import Engine\n"
    assert imports_in(source) == [("engine.engine", 4)]


def test_checking_a_model_type_imports_no_family_code():
    import subprocess
    import sys

    probe = (
        "import sys; from batchvl.models.registry import model_family; model_family('qwen2_vl'); "
        "print(sorted(m for m in sys.modules if m.startswith('batchvl.models.') or "
        "m.startswith('batchvl.preprocess.') and m.endswith('_vision')))"
    )
    out = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, check=True).stdout
    assert out.strip() == "['batchvl.models.registry']"


def test_every_family_resolves_its_parts():
    from batchvl.models.registry import FAMILIES

    for family in FAMILIES.values():
        assert isinstance(family.adapter, type) and callable(family.media_preparer)
