"""The torch and transformers releases batchvl supports, and the one check of them.

Within these ranges the differences between releases are met where they matter by asking for the behaviour
(batchvl/models/); this is the only place that compares version numbers. pyproject.toml declares the same
ranges (tests/utils/test_versions.py keeps them equal).
"""

from __future__ import annotations

from importlib.metadata import PackageNotFoundError, version

from packaging.specifiers import SpecifierSet
from packaging.version import InvalidVersion, Version

from batchvl.errors import UserError

SUPPORTED = {
    # the oldest with every API batchvl calls: DataLoader(in_order=), SDPA's enable_gqa
    "torch": ">=2.6",
    # the oldest and the newest release the parity tests pass on (make test-oldest, make test)
    "transformers": ">=5.17,<5.25",
}


def check_library_versions() -> None:
    """Refuse, in one line, a torch or transformers outside the supported range, before any work.

    The installed version is read from the distribution found first on the import path, the one `import`
    loads. A pre-release (a source build's `2.7.0a0+git...`) is compared like any other version (older
    `packaging` releases refuse every pre-release unless told)."""
    for name, spec in SUPPORTED.items():
        try:
            installed = version(name)
        except PackageNotFoundError:
            raise UserError(f"{name} is not installed; batchvl needs {name}{spec}") from None
        try:
            supported = SpecifierSet(spec).contains(Version(installed), prereleases=True)
        except InvalidVersion:
            supported = False
        if not supported:
            raise UserError(
                f"{name} {installed} is not supported: batchvl needs {name}{spec} "
                f"(install one with `pip install '{name}{spec}'`)"
            )
