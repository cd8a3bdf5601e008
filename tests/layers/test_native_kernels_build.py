"""How the native kernels are built, or not: turned off by the environment, a failed build a warning and the
torch path, a build named by the machine's vector ISA."""

import logging
import subprocess
import sys
from pathlib import Path

import pytest
import torch.utils.cpp_extension

from batchvl.layers import native_kernels
from batchvl.layers.attention import KVCache


def test_the_environment_turns_them_off(monkeypatch):
    monkeypatch.setenv(native_kernels.DISABLE_VARIABLE, "0")
    assert native_kernels.native_ops.__wrapped__() is None


def test_a_failed_build_is_one_warning_and_the_torch_path(monkeypatch, caplog, tmp_path):
    def failing_load(*args, **kwargs):
        raise RuntimeError("Error building extension: g++ not found")

    monkeypatch.delenv(native_kernels.DISABLE_VARIABLE, raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(torch.utils.cpp_extension, "load", failing_load)
    with caplog.at_level(logging.WARNING, logger=native_kernels.__name__):
        assert native_kernels.native_ops.__wrapped__() is None
    (record,) = caplog.records
    assert "runs on torch ops only" in record.getMessage() and "g++ not found" in record.getMessage()
    # what the engine then does (the patch replaces the cached `native_ops` for this test only)
    monkeypatch.setattr(native_kernels, "native_ops", lambda: None)
    assert not KVCache.allocate(1, 8, 1, 64, torch.float32, "cpu").decodes_in_place


def test_the_build_is_named_by_the_isa_and_the_sources(monkeypatch, tmp_path):
    names = []

    def recording_load(name, sources, extra_cflags, **kwargs):
        names.append((name, extra_cflags))
        raise RuntimeError("stop here")

    monkeypatch.delenv(native_kernels.DISABLE_VARIABLE, raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    monkeypatch.setattr(torch.utils.cpp_extension, "load", recording_load)
    for capability in ("AVX2", "AVX512", "DEFAULT"):
        monkeypatch.setattr(
            torch.backends.cpu, "get_cpu_capability", lambda capability=capability: capability
        )
        native_kernels.native_ops.__wrapped__()
    (avx2, avx2_flags), (avx512, avx512_flags), (default, default_flags) = names
    assert avx2.startswith("batchvl_native_avx2_") and "-DCPU_CAPABILITY=AVX2" in avx2_flags
    assert avx512.startswith("batchvl_native_avx512_") and "-mavx512f" in avx512_flags
    assert default.startswith("batchvl_native_default_") and "-DCPU_CAPABILITY=DEFAULT" in default_flags
    assert len({avx2, avx512, default}) == 3


def test_two_checkouts_of_the_same_sources_build_the_same_files(monkeypatch, tmp_path):
    """cpp_extension's build file names the sources' paths: built from each checkout's own files, two
    checkouts sharing a home rebuilt at each one's first use, back and forth."""
    builds = []

    def recording_load(name, sources, build_directory, **kwargs):
        builds.append((name, sources, build_directory))
        raise RuntimeError("stop here")

    monkeypatch.delenv(native_kernels.DISABLE_VARIABLE, raising=False)
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path / "extensions"))
    monkeypatch.setattr(torch.utils.cpp_extension, "load", recording_load)
    for checkout in ("first", "second"):
        folder = tmp_path / checkout / "native"
        folder.mkdir(parents=True)
        for source in native_kernels.SOURCES:
            (folder / source.name).write_bytes(source.read_bytes())
        monkeypatch.setattr(native_kernels, "SOURCES", [folder / s.name for s in native_kernels.SOURCES])
        native_kernels.native_ops.__wrapped__()
    (first_name, first_sources, directory), (second_name, second_sources, _) = builds
    assert (first_name, first_sources) == (second_name, second_sources)
    assert all(source.startswith(directory) for source in first_sources)
    assert [Path(s).read_bytes() for s in first_sources] == [s.read_bytes() for s in native_kernels.SOURCES]


def test_a_lock_left_by_a_killed_build_does_not_hang_the_next_load():
    """torch's build lock is a file: a process killed while building leaves it, and torch alone would wait
    on it forever at every later load."""
    if native_kernels.native_ops() is None:
        pytest.skip("the native kernels did not build (needs a C++ compiler and ninja)")
    code = (
        "from batchvl.layers import native_kernels as n\n"
        "name, _ = n.build_name_and_flags()\n"
        "(n.build_directory(name) / 'lock').touch()\n"
        "print(n.native_ops() is not None)\n"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300)
    assert done.stdout.strip() == "True", done.stderr


def test_environments_at_other_paths_get_a_build_each(monkeypatch):
    """cpp_extension's build file names where torch and Python are installed: an environment at another path
    sharing the build rebuilt it at its first use, and the first environment back at its next."""
    at_home = native_kernels.build_name_and_flags()[0]
    assert native_kernels.build_name_and_flags()[0] == at_home  # the same environment: the same build
    elsewhere = [
        path.replace("site-packages", "other-packages") for path in torch.utils.cpp_extension.include_paths()
    ]
    monkeypatch.setattr(torch.utils.cpp_extension, "include_paths", lambda *args, **kwargs: elsewhere)
    assert native_kernels.build_name_and_flags()[0] != at_home
