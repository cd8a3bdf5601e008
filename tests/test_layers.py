"""No module imports from a layer above its own, and no two packages import each other: the ground (errors,
config, utils, storage) depends on nothing of batchvl's above it; inputs, outputs, preprocess, the engine
and the models are the pipeline's stages, which the run drives; the engine calls models only through its
own adapter protocol, and the kernels and layer swaps live in `layers/`, which both use. The order is
written once, here, and shown in docs/architecture.md."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).parents[1] / "batchvl"

# Lowest first. A module may import from its own layer or from a lower one. The modules at the package
# root besides `errors` (api, cli, __main__, __init__) are the application, above every layer.
LAYERS = [
    "errors", "config", "utils", "storage", "inputs", "outputs", "layers", "preprocess", "engine", "server",
    "models", "demo", "pipeline", "commands",
]  # fmt: skip
APPLICATION = len(LAYERS)
ROOT_MODULES = {"__init__", "__main__", "api", "cli", "errors"}


def layer_of(module: str) -> int:
    """`module` is a dotted name inside batchvl, e.g. 'engine.engine' or 'cli'."""
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


def test_every_package_has_a_layer_and_the_root_holds_at_most_eight_modules():
    packages = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    assert packages == set(LAYERS) - {"errors"}
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    assert modules == ROOT_MODULES and len(modules) <= 8


def test_no_package_hides_a_function_of_the_api():
    # `batchvl.run(...)` is the API's; a subpackage `batchvl/run/`, once imported, would replace it
    import batchvl
    import batchvl.pipeline.runner  # noqa: F401  (every package imported)

    packages = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    assert packages.isdisjoint(batchvl.__all__)
    assert callable(batchvl.run) and callable(batchvl.caption)


def test_no_two_modules_import_each_other():
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        module = ".".join(path.relative_to(PACKAGE).with_suffix("").parts).removesuffix(".__init__")
        graph[module] = {imported for imported, _ in imports_in(path.read_text())}
    cycles = sorted(
        f"{a} <-> {b}" for a, uses in graph.items() for b in uses if a < b and a in graph.get(b, ())
    )
    assert cycles == []


def test_the_check_sees_imports_from_above_even_inside_functions():
    assert (
        layer_of("utils.stats")
        < layer_of("engine.engine")
        < layer_of("models.loader")
        < layer_of("pipeline.runner")
    )
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
