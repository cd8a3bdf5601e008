"""No module imports from a layer above its own, and no two packages import each other: the ground (errors,
config, utils, storage) depends on nothing of batchvl's above it; inputs, outputs, preprocess, the engine
and the models are the pipeline's stages, which the run drives; the engine calls models only through its
own adapter protocol, and the kernels and layer swaps live in `layers/`, which both use. The order is
written once, here, and shown in docs/architecture.md."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "batchvl"
BENCHMARKS = Path(__file__).parents[1] / "benchmarks"

# Lowest first. A module may import from its own layer or from a lower one. The modules at the package
# root besides `version` and `errors` (api, cli, __main__, __init__) are the application, above every layer.
LAYERS = [
    "version", "errors", "config", "utils", "storage", "inputs", "outputs", "layers", "preprocess", "engine",
    "server", "models", "demo", "pipeline", "commands",
]  # fmt: skip
APPLICATION = len(LAYERS)
ROOT_MODULES = {"__init__", "__main__", "api", "cli", "errors", "version"}
DYNAMIC_IMPORTS = {"import_module", "__import__"}  # importlib.import_module("batchvl.x"), __import__(...)


def layer_of(module: str) -> int:
    """`module` is a dotted name inside batchvl, e.g. 'engine.engine' or 'cli' ('__init__': the root)."""
    head = module.split(".")[0]
    return LAYERS.index(head) if head in LAYERS else APPLICATION


def is_module(dotted: str, package: Path = PACKAGE) -> bool:
    path = package.joinpath(*dotted.split("."))
    return path.with_suffix(".py").exists() or (path / "__init__.py").exists()


def _within(absolute: str) -> str | None:
    """'batchvl.engine.x' -> 'engine.x'; 'batchvl' -> '__init__' (the root); another package -> None."""
    if absolute == "batchvl":
        return "__init__"
    return absolute.removeprefix("batchvl.") if absolute.startswith("batchvl.") else None


def _imported_from(node: ast.ImportFrom, module: str) -> list[str]:
    """The batchvl modules a `from ... import ...` takes: `from batchvl import x` takes the submodule x if
    there is one, else a name of the root (`__init__`); relative forms are resolved against `module`."""
    if node.level:
        parts = module.split(".")
        base = parts[: len(parts) - node.level]  # the package `.` stands for in `module`
        absolute = ".".join(["batchvl", *base, *([node.module] if node.module else [])])
    else:
        absolute = node.module or ""
    inside = _within(absolute)
    if inside is None:
        return []
    prefix = "" if inside == "__init__" else inside + "."
    return [prefix + alias.name if is_module(prefix + alias.name) else inside for alias in node.names]


def imports_in(source: str, module: str = "__init__") -> list[tuple[str, int]]:
    """(imported batchvl module, line) for every import in `module`'s source, in every form: `import
    batchvl.x`, `from batchvl.x import y`, `from batchvl import x`, relative imports, and
    `importlib.import_module` or `__import__` of a literal name; function-level ones included."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            found += [(name, node.lineno) for name in _imported_from(node, module)]
        elif isinstance(node, ast.Import):
            names = [_within(alias.name) for alias in node.names]
            found += [(name, node.lineno) for name in names if name is not None]
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            function = (
                node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            )
            name = _within(str(node.args[0].value)) if function in DYNAMIC_IMPORTS else None
            if name is not None:
                found.append((name, node.lineno))
    return found


def module_name(path: Path, package: Path = PACKAGE) -> str:
    return ".".join(path.relative_to(package).with_suffix("").parts)


def climbs(module: str, source: str) -> list[str]:
    """The imports in `module`'s source that take from a layer above its own."""
    return [
        f"line {line} imports batchvl.{imported}"
        for imported, line in imports_in(source, module)
        if layer_of(imported) > layer_of(module)
    ]


def test_no_module_imports_from_a_layer_above_it():
    wrong = []
    for path in sorted(PACKAGE.rglob("*.py")):
        wrong += [
            f"{path.relative_to(PACKAGE.parent)}: {climb}"
            for climb in climbs(module_name(path), path.read_text())
        ]
    assert wrong == []


@pytest.mark.parametrize(
    "source",
    [
        "from batchvl.pipeline.runner import JobRunner",
        "import batchvl.pipeline.runner",
        "import batchvl.pipeline.runner as runner",
        "from batchvl.pipeline import runner",
        "from batchvl import __version__",  # a name of the root, which imports the application
        "from batchvl import api",
        "import batchvl",
        "from ...pipeline import runner",
        "from ...pipeline.runner import JobRunner",
        "from ... import cli",
        "import importlib\nrunner = importlib.import_module('batchvl.pipeline.runner')",
        "from importlib import import_module\nrunner = import_module('batchvl.pipeline.runner')",
        "runner = __import__('batchvl.pipeline.runner')",
        "def later():\n    from batchvl.pipeline.runner import JobRunner\n    return JobRunner",
    ],
)
def test_a_planted_climb_is_seen_in_every_form_of_import(source):
    module = "engine.encoder_cache.cache"  # a module of a lower layer than the pipeline
    assert climbs(module, source), source
    assert climbs("engine.engine", "from batchvl.engine.request import Request") == []
    assert climbs("engine.encoder_cache.cache", "from ..request import Request\nfrom . import disk") == []


def test_every_package_has_a_layer_and_the_root_holds_at_most_eight_modules():
    packages = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    assert packages == set(LAYERS) - {"errors", "version"}
    modules = {path.stem for path in PACKAGE.glob("*.py")}
    assert modules == ROOT_MODULES and len(modules) <= 8


def test_no_package_hides_a_function_of_the_api():
    # `batchvl.run(...)` is the API's; a subpackage `batchvl/run/`, once imported, would replace it
    import batchvl
    import batchvl.pipeline.runner  # noqa: F401  (every package imported)

    packages = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    assert packages.isdisjoint(batchvl.__all__)
    assert callable(batchvl.run) and callable(batchvl.caption)


def import_cycle(graph: dict[str, set[str]]) -> list[str]:
    """One cycle of the import graph (module -> the modules it imports), as the modules in order, or []."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(module: str) -> list[str]:
        state[module] = 1
        path.append(module)
        for used in sorted(graph.get(module, ())):
            if state.get(used) == 1:
                return path[path.index(used) :] + [used]
            if used not in state and (cycle := visit(used)):
                return cycle
        state[module] = 2
        path.pop()
        return []

    for module in sorted(graph):
        if module not in state and (cycle := visit(module)):
            return cycle
    return []


def package_graph() -> dict[str, set[str]]:
    graph = {}
    for path in PACKAGE.rglob("*.py"):
        module = module_name(path)
        graph[module.removesuffix(".__init__")] = {name for name, _ in imports_in(path.read_text(), module)}
    return graph


def benchmarks_graph() -> dict[str, set[str]]:
    """The benchmark scripts, which import each other by their plain names."""
    scripts = {path.stem: path for path in BENCHMARKS.glob("*.py")}
    graph = {}
    for name, path in scripts.items():
        uses = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and not node.level and node.module in scripts:
                uses.add(node.module)
            elif isinstance(node, ast.Import):
                uses |= {alias.name for alias in node.names if alias.name in scripts}
        graph[name] = uses
    return graph


def graph_of_the_tests() -> dict[str, set[str]]:
    """The test modules and their helpers, which import each other as `tests.x`."""
    tests = Path(__file__).parent
    modules = {
        ".".join(path.relative_to(tests.parent).with_suffix("").parts): path for path in tests.rglob("*.py")
    }
    graph = {}
    for name, path in modules.items():
        uses = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, ast.ImportFrom)
                and not node.level
                and (node.module or "").startswith("tests")
            ):
                submodules = {f"{node.module}.{alias.name}" for alias in node.names} & set(modules)
                uses |= submodules or {node.module}
            elif isinstance(node, ast.Import):
                uses |= {alias.name for alias in node.names if alias.name in modules}
        graph[name.removesuffix(".__init__")] = uses
    return graph


def test_no_import_cycle_in_the_package_the_benchmarks_or_the_tests():
    assert import_cycle(package_graph()) == []
    assert import_cycle(benchmarks_graph()) == []
    assert import_cycle(graph_of_the_tests()) == []


def test_a_cycle_of_any_length_is_found():
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert import_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) == []


def test_the_check_sees_imports_from_above_even_inside_functions():
    assert (
        layer_of("utils.stats")
        < layer_of("engine.engine")
        < layer_of("models.loader")
        < layer_of("pipeline.runner")
    )
    source = "import os\n\ndef load():\n    from batchvl.engine.engine import Engine\n"
    assert imports_in(source, "utils.stats") == [("engine.engine", 4)]


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


def test_the_tests_are_laid_out_like_the_package():
    """A test of one package lives in tests/<package>/; the root holds the application's and the whole
    tree's tests (the CLI, the API, these layers) and the shared fixtures."""
    tests = Path(__file__).parent
    packages = {path.name for path in PACKAGE.iterdir() if (path / "__init__.py").exists()}
    folders = {path.name for path in tests.iterdir() if (path / "__init__.py").exists()}
    assert folders <= packages
    assert {"engine", "pipeline", "server", "inputs", "outputs"} <= folders
