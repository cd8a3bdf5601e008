"""One registry of error types: every SampleError the code raises names a type in `errors.ERROR_TYPES`,
every type there is raised somewhere, and the table in docs/output.md is the one generated from it."""

import ast
import re
from pathlib import Path

from batchvl.errors import ERROR_TYPES, error_types_markdown_table

PACKAGE = Path(__file__).parents[1] / "batchvl"


def raised_types() -> dict[str, str]:
    """The literal error type of every `SampleError(...)` call in the package -> where it is (an f-string
    type as its literal start followed by `<...>`)."""
    found = {}
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if not (
                isinstance(node, ast.Call) and getattr(node.func, "id", None) == "SampleError" and node.args
            ):
                continue
            first = node.args[0]
            if isinstance(first, ast.Constant):
                name = first.value
            elif isinstance(first, ast.JoinedStr):  # f"download_http_{status}"
                name = "".join(
                    part.value if isinstance(part, ast.Constant) else "<>" for part in first.values
                )
            else:
                continue  # a type passed on from another SampleError
            found[name] = f"{path.relative_to(PACKAGE.parent)}:{node.lineno}"
    return found


def registered(name: str) -> bool:
    return any(
        re.fullmatch(re.sub(r"<\w*>", "<>", key).replace("<>", ".+"), name.replace("<>", "x"))
        for key in ERROR_TYPES
    )


def test_every_raised_error_type_is_registered_and_every_registered_one_is_raised():
    raised = raised_types()
    assert len(raised) >= 30  # the scan finds the calls, multi-line ones included
    unregistered = {name: where for name, where in raised.items() if not registered(name)}
    assert unregistered == {}, "add these to batchvl.errors.ERROR_TYPES"
    patterns = {re.sub(r"<\w*>", "<>", key) for key in ERROR_TYPES}
    assert patterns == set(raised), "ERROR_TYPES lists types nothing raises"


def test_the_docs_table_is_generated_from_the_registry():
    docs = (Path(__file__).parents[1] / "docs" / "output.md").read_text()
    table = re.search(r"<!-- error-types:start -->\n(.*)\n<!-- error-types:end -->", docs, re.S).group(1)
    assert table == error_types_markdown_table(), "docs/output.md error-type table is stale: regenerate it"
