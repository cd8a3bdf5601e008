"""The encoder disk cache's folder on its own: entries read back whole or not at all (corrupt, truncated,
misplaced), the least recently used entries evicted at the size bound, processes sharing the folder
while they write, read and evict, a folder holding other files left alone, and the vision digest that
keys the entries."""

import json
import logging
import multiprocessing
import os
import time
from pathlib import Path

import pytest
import torch
import xxhash

from batchvl.config import job_config_from_dict
from batchvl.engine.encoder_cache import vision_digest as vision_digest_module
from batchvl.engine.encoder_cache.disk import EncoderDiskCache
from batchvl.engine.encoder_cache.disk_entry import decode_entry, encode_entry
from batchvl.engine.encoder_cache.disk_layout import MARKER, MARKER_TEXT
from batchvl.errors import ConfigError, UserError

DIGEST = "model-digest"
ENTRY_BYTES = 64 * 48 * 4  # a float32 embedding of 64 rows of 48, as `embedding` makes


def embedding(seed: int, dtype=torch.float32) -> torch.Tensor:
    return torch.randn(64, 48, generator=torch.Generator().manual_seed(seed)).to(dtype)


def test_an_entry_reads_back_bitwise_in_its_dtype(tmp_path):
    cache = EncoderDiskCache(str(tmp_path), 1 << 30, DIGEST)
    for seed, dtype in ((0, torch.float32), (1, torch.bfloat16)):
        cache.store(f"image{seed}", embedding(seed, dtype))
        loaded = cache.load(f"image{seed}")
        assert loaded.dtype == dtype and torch.equal(loaded, embedding(seed, dtype))
    assert cache.load("never-stored") is None
    assert (cache.hits, cache.writes) == (2, 2)


def test_another_models_digest_never_reads_an_entry(tmp_path):
    EncoderDiskCache(str(tmp_path), 1 << 30, DIGEST).store("image", embedding(0))
    assert EncoderDiskCache(str(tmp_path), 1 << 30, "other-weights").load("image") is None


@pytest.mark.parametrize(
    "damage",
    [
        lambda data: data[: len(data) // 2],  # a writer cut short
        lambda data: data[:-1],  # the checksum's last byte missing
        lambda data: data[:20] + bytes([data[20] ^ 1]) + data[21:],  # one bit of the header flipped
        lambda data: data[:-40] + bytes([data[-40] ^ 1]) + data[-39:],  # one bit of the payload flipped
        lambda data: b"",
    ],
    ids=["half", "no-checksum-end", "header-bit", "payload-bit", "empty"],
)
def test_a_damaged_entry_is_a_miss_and_is_written_again(tmp_path, damage, caplog):
    cache = EncoderDiskCache(str(tmp_path), 1 << 30, DIGEST)
    cache.store("image", embedding(0))
    path = cache.path("image")
    with open(path, "rb") as file:
        data = file.read()
    with open(path, "wb") as file:
        file.write(damage(data))
    with caplog.at_level(logging.WARNING):
        assert cache.load("image") is None
    assert "is damaged" in caplog.text
    cache.store("image", embedding(0))
    assert torch.equal(cache.load("image"), embedding(0))


def test_an_entry_under_another_keys_name_is_a_miss(tmp_path):
    cache = EncoderDiskCache(str(tmp_path), 1 << 30, DIGEST)
    cache.store("image-a", embedding(0))
    os.makedirs(os.path.dirname(cache.path("image-b")), exist_ok=True)
    os.replace(cache.path("image-a"), cache.path("image-b"))
    assert cache.load("image-b") is None


def set_age(path: str, seconds_ago: float) -> None:
    then = time.time_ns() - int(seconds_ago * 1e9)
    os.utime(path, ns=(then, then))


def test_the_size_bound_evicts_the_least_recently_used_entries(tmp_path):
    entry = os.path.getsize(_stored(tmp_path / "probe", "probe"))
    cache = EncoderDiskCache(str(tmp_path / "cache"), 3 * entry + entry // 2, DIGEST)  # room for three
    for age, name in ((300, "read-since"), (200, "oldest-unread"), (100, "newer")):
        cache.store(name, embedding(0))
        set_age(cache.path(name), age)
    assert cache.load("read-since") is not None  # now the most recently used
    cache.store("newest", embedding(1))  # four entries: over the bound
    names = ("read-since", "oldest-unread", "newer", "newest")
    kept = {name for name in names if os.path.exists(cache.path(name))}
    assert kept == {"read-since", "newer", "newest"}
    assert torch.equal(cache.load("newest"), embedding(1))


def test_a_new_process_counts_the_folder_and_trims_it_and_stale_temporary_files(tmp_path):
    first = EncoderDiskCache(str(tmp_path), 1 << 30, DIGEST)
    for seed in range(4):
        first.store(f"image{seed}", embedding(seed))
        set_age(first.path(f"image{seed}"), 100 - seed)
    stale = first.path("image0") + f".123.{'a' * 32}.tmp"  # named as the cache names them
    fresh = first.path("image1") + f".456.{'b' * 32}.tmp"
    for path, age in ((stale, 7200), (fresh, 10)):
        with open(path, "wb") as file:
            file.write(b"partial")
        set_age(path, age)
    entry = os.path.getsize(first.path("image0"))
    EncoderDiskCache(str(tmp_path), 2 * entry + entry // 2, DIGEST)
    left = [seed for seed in range(4) if os.path.exists(first.path(f"image{seed}"))]
    assert left == [2, 3]  # the two most recent
    assert not os.path.exists(stale) and os.path.exists(fresh)  # a writer may still be renaming it


def _stored(folder, name: str) -> str:
    cache = EncoderDiskCache(str(folder), 1 << 30, DIGEST)
    cache.store(name, embedding(0))
    return cache.path(name)


def _rewrite_while_read(folder: str, ready, stop_at: float) -> None:
    """A writer: store every key once, say so, then store them again and again."""
    cache = EncoderDiskCache(folder, 1 << 30, DIGEST)
    for seed in range(8):
        cache.store(f"image{seed}", embedding(seed))
    ready.set()
    while time.time() < stop_at:
        for seed in range(8):
            cache.store(f"image{seed}", embedding(seed))


def test_a_reader_never_sees_an_entry_a_writer_is_rewriting(tmp_path):
    """Entries are written under a temporary name and renamed into place: a reader beside a process that
    keeps rewriting them reads each one whole every time (written in place, it read short files)."""
    context = multiprocessing.get_context("spawn")
    ready = context.Event()
    writer = context.Process(target=_rewrite_while_read, args=(str(tmp_path), ready, time.time() + 20))
    writer.start()
    try:
        assert ready.wait(60), "the writer did not start"
        cache = EncoderDiskCache(str(tmp_path), 1 << 30, DIGEST)
        expected = [embedding(seed) for seed in range(8)]
        reads = 0
        stop_at = time.time() + 3
        while time.time() < stop_at:
            for seed in range(8):
                loaded = cache.load(f"image{seed}")
                assert loaded is not None and torch.equal(loaded, expected[seed])
                reads += 1
    finally:
        writer.kill()
        writer.join()
    assert reads > 100


def _share_a_small_folder(folder: str, seed: int, seconds: float, outcomes) -> None:
    """A process that stores and reads ten keys in a folder with room for four, so that it evicts what
    the other process is reading; every read must be a miss or the right embedding."""
    cache = EncoderDiskCache(folder, 4 * ENTRY_BYTES + ENTRY_BYTES // 2, DIGEST)
    expected = [embedding(key) for key in range(10)]
    wrong, step, stop_at = [], seed, time.time() + seconds
    while time.time() < stop_at:
        key = step % 10
        loaded = cache.load(f"image{key}")
        if loaded is None:
            cache.store(f"image{key}", expected[key])
        elif not torch.equal(loaded, expected[key]):
            wrong.append(key)
        step += 3 + seed
    outcomes.put((wrong, cache.hits, cache.writes))


def test_two_processes_share_a_folder_they_both_evict_from(tmp_path):
    context = multiprocessing.get_context("spawn")
    outcomes = context.Queue()
    processes = [
        context.Process(target=_share_a_small_folder, args=(str(tmp_path), seed, 4.0, outcomes))
        for seed in (0, 1)
    ]
    for process in processes:
        process.start()
    results = [outcomes.get(timeout=120) for _ in processes]
    for process in processes:
        process.join()
    assert all(process.exitcode == 0 for process in processes)
    assert [wrong for wrong, _, _ in results] == [[], []]
    assert all(hits > 10 and writes > 10 for _, hits, writes in results)  # both read and evicted
    entries = [name for _, _, names in os.walk(tmp_path) for name in names if name.endswith(".emb")]
    # At most twice the bound (four): each process may have written up to the bound since it last counted
    assert 1 <= len(entries) <= 9


def test_a_folder_that_cannot_be_made_is_a_one_line_mistake(tmp_path):
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    with pytest.raises(UserError, match="engine.encoder_cache_dir .* cannot be made"):
        EncoderDiskCache(str(blocker / "cache"), 1 << 30, DIGEST)


def job(**engine) -> dict:
    return {
        "model": {"path": "m"},
        "input": {"paths": ["x.parquet"]},
        "prompts": [{"name": "caption", "text": "Describe."}],
        "engine": engine,
        "output": {"dir": "out"},
    }


def test_the_folder_is_local_resolved_against_the_job_file_and_only_for_the_built_in_engine(tmp_path):
    cfg = job_config_from_dict(job(encoder_cache_dir="cache"), tmp_path)
    assert cfg.engine.encoder_cache_dir == str(tmp_path / "cache")
    with pytest.raises(ConfigError, match="must be a local folder"):
        job_config_from_dict(job(encoder_cache_dir="s3://bucket/cache"), tmp_path)
    server = {"backend": "openai", "server": {"url": "http://127.0.0.1:1/v1"}}
    with pytest.raises(ConfigError, match="applies to engine.backend: batchvl"):
        job_config_from_dict(job(encoder_cache_dir="cache", **server), tmp_path)


def test_a_folder_that_cannot_be_written_never_fails_the_job(tmp_path, caplog):
    cache = EncoderDiskCache(str(tmp_path), 1 << 30, DIGEST)
    cache.store("image", embedding(0))
    blocked = os.path.dirname(cache.path("other-image"))
    if not os.path.exists(blocked):
        with open(blocked, "w"):  # a file where the entry's subfolder would be: writing it fails
            pass
    with caplog.at_level(logging.WARNING):
        cache.store("other-image", embedding(1))
        cache.store("third-image", embedding(2))
    assert caplog.text.count("cannot write") == 1  # logged once, then not tried again
    assert cache.writes == 1 and cache.load("third-image") is None
    assert torch.equal(cache.load("image"), embedding(0))


def test_an_entry_read_back_starts_its_payload_aligned(tmp_path):
    """Headers differ in length with the shape and dtype; the tensor read back in place is aligned."""
    cache = EncoderDiskCache(str(tmp_path), 1 << 30, DIGEST)
    for rows in (1, 7, 64, 1000, 12345):
        for dtype in (torch.float32, torch.bfloat16):
            name = f"{rows}-{dtype}"
            cache.store(name, torch.ones(rows, 3, dtype=dtype))
            assert cache.load(name).data_ptr() % 16 == 0, name


def test_the_vision_digest_is_remembered_until_a_weight_file_changes(tmp_path, loaded_fp32, monkeypatch):
    computed = []
    weights_digest = vision_digest_module._weights_digest
    monkeypatch.setattr(
        vision_digest_module,
        "_weights_digest",
        lambda *args: computed.append(1) or weights_digest(*args),
    )
    first = vision_digest_module.vision_digest(loaded_fp32.adapter, str(tmp_path))
    assert vision_digest_module.vision_digest(loaded_fp32.adapter, str(tmp_path)) == first
    assert len(computed) == 1  # the second time, remembered
    (weights,) = Path(loaded_fp32.path).glob("*.safetensors")
    os.utime(weights)  # as any write would: its times change
    assert vision_digest_module.vision_digest(loaded_fp32.adapter, str(tmp_path)) == first
    assert len(computed) == 2  # read again: the same weights, so the same digest
    monkeypatch.setattr(loaded_fp32.adapter, "dtype", torch.bfloat16)
    assert vision_digest_module.vision_digest(loaded_fp32.adapter, str(tmp_path)) != first


def test_a_trim_goes_below_the_bound_so_that_the_next_write_does_not_trim_again(tmp_path):
    cache = EncoderDiskCache(str(tmp_path), 3 * ENTRY_BYTES + ENTRY_BYTES // 4, DIGEST)
    for seed in range(4):
        cache.store(f"image{seed}", embedding(seed))
        set_age(cache.path(f"image{seed}"), 100 - seed)
    # Four entries (each its payload and a small header) over a bound of 3.25: trimmed to 90% of it
    # (2.9), so two go, not just the one that the bound itself would have wanted gone.
    assert [seed for seed in range(4) if os.path.exists(cache.path(f"image{seed}"))] == [2, 3]


def user_files(folder: Path, key: str) -> dict[Path, bytes]:
    """Files a user keeps in a folder, named and placed like the cache's but not exactly: each one a
    looser check of names or places would count, trim or remove."""
    files = {
        folder / "notes.tmp": b"an old draft",
        folder / "photo.emb": b"my own embedding",
        folder / "project" / key[:2] / (key + ".emb"): b"an entry's name, one folder too deep",
        folder / key[:2] / "mine.emb": b"not a key",
        folder / key[:2] / (key.upper() + ".emb"): b"not the cache's spelling of a key",
        folder / key[:2] / (key + ".emb.bak"): b"a backup",
        folder / key[:2] / (key + ".emb.123.abc.tmp"): b"not the cache's temporary name",
        folder / ("00" if key[:2] != "00" else "01") / (key + ".emb"): b"a key in another's subfolder",
        folder / "digests" / "readme.tmp": b"not a digest",
    }
    for path, data in files.items():
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_bytes(data * 1000)
        set_age(str(path), 7200)  # old and large: what a trim deletes first, were it the cache's
    return files


def test_the_cache_counts_trims_and_removes_only_its_own_files(tmp_path):
    cache = EncoderDiskCache(str(tmp_path), 1 << 30, DIGEST)
    cache.store("image", embedding(0))
    key = cache.key("image")
    mine = user_files(tmp_path, key[:2] + "a" * 30)  # placed later into the cache's folder
    again = EncoderDiskCache(str(tmp_path), 2 * ENTRY_BYTES, DIGEST)
    assert again._size == os.path.getsize(cache.path("image"))  # the user's bytes are not counted
    for seed in range(3):  # over the bound: trimmed
        again.store(f"other{seed}", embedding(seed))
    assert not os.path.exists(cache.path("image"))  # the cache's oldest entry went
    assert {path: path.read_bytes() for path in mine} == {path: data * 1000 for path, data in mine.items()}


def test_a_folder_holding_other_files_is_refused_and_left_as_it_was(tmp_path):
    mine = user_files(tmp_path, "ab" * 16)
    before = sorted(str(path) for path in tmp_path.rglob("*"))
    with pytest.raises(UserError) as info:
        EncoderDiskCache(str(tmp_path), 1, DIGEST)
    message = str(info.value)
    assert "\n" not in message and str(tmp_path) in message
    assert "holds files the encoder cache did not write" in message and "empty or new folder" in message
    assert sorted(str(path) for path in tmp_path.rglob("*")) == before  # no marker, nothing removed
    assert all(path.read_bytes() == data * 1000 for path, data in mine.items())


def test_an_empty_folder_is_marked_and_another_layouts_marker_is_refused(tmp_path):
    (tmp_path / "empty" / "nothing-in-here").mkdir(parents=True)  # folders without files hold nothing
    EncoderDiskCache(str(tmp_path / "empty"), 1 << 30, DIGEST)
    assert (tmp_path / "empty" / MARKER).read_text() == MARKER_TEXT
    (tmp_path / "newer").mkdir()
    (tmp_path / "newer" / MARKER).write_text("batchvl encoder cache, layout 2\n")
    with pytest.raises(UserError, match="holds a BATCHVL_ENCODER_CACHE file of another layout"):
        EncoderDiskCache(str(tmp_path / "newer"), 1 << 30, DIGEST)


def test_a_folder_an_earlier_version_wrote_is_adopted(tmp_path):
    """Before the marker, a cache folder held only entries, remembered digests and temporary files:
    such a folder is marked and its entries read; one file besides them and it is refused."""
    earlier = EncoderDiskCache(str(tmp_path), 1 << 30, DIGEST)
    earlier.store("image", embedding(0))
    with open(earlier.path("image") + f".77.{'c' * 32}.tmp", "wb") as file:  # a killed writer's
        file.write(b"partial")
    (tmp_path / "digests").mkdir()
    (tmp_path / "digests" / ("d" * 32)).write_text("e" * 32)  # remembered without a check, as then
    os.remove(tmp_path / MARKER)
    adopted = EncoderDiskCache(str(tmp_path), 1 << 30, DIGEST)
    assert torch.equal(adopted.load("image"), embedding(0))
    assert (tmp_path / MARKER).read_text() == MARKER_TEXT
    os.remove(tmp_path / MARKER)
    (tmp_path / "digests" / "notes.txt").write_text("mine")
    with pytest.raises(UserError, match="did not write .digests/notes.txt."):
        EncoderDiskCache(str(tmp_path), 1 << 30, DIGEST)


def test_a_folder_where_one_entry_goes_skips_that_entry_only(tmp_path, caplog):
    cache = EncoderDiskCache(str(tmp_path), 1 << 30, DIGEST)
    os.makedirs(cache.path("image-a"))  # a folder where the entry's file goes: it can never be written
    with caplog.at_level(logging.WARNING):
        cache.store("image-a", embedding(0))
    assert "is a folder, not an entry" in caplog.text
    cache.store("image-b", embedding(1))  # the others still are
    assert cache.writes == 1 and torch.equal(cache.load("image-b"), embedding(1))
    assert cache.load("image-a") is None and os.listdir(cache.path("image-a")) == []


def test_a_bound_smaller_than_an_entry_stores_nothing_and_says_so_once(tmp_path, caplog):
    cache = EncoderDiskCache(str(tmp_path), ENTRY_BYTES // 2, DIGEST)
    with caplog.at_level(logging.WARNING):
        for seed in range(3):
            cache.store(f"image{seed}", embedding(seed))
    assert caplog.text.count("is not stored; raise engine.encoder_cache_dir_gb") == 1
    assert cache.writes == 0 and list(tmp_path.rglob("*.emb*")) == []
    cache.store("small", torch.ones(2, 3))  # an embedding that fits is stored
    assert torch.equal(cache.load("small"), torch.ones(2, 3))


def forged(tensor: torch.Tensor, shape: list[int]) -> bytearray:
    """The entry of `tensor` with `shape` in its header instead, its checksum made right again (as a
    writer with a bug, not the disk, would leave it)."""
    data = encode_entry("key", tensor)[:-16]
    written = json.dumps(list(tensor.shape)).encode()
    body = data.replace(written, json.dumps(shape).encode().ljust(len(written)), 1)
    return bytearray(body + xxhash.xxh3_128_digest(body))


def test_a_payload_longer_or_shorter_than_its_shape_is_refused():
    tensor = torch.arange(12, dtype=torch.float32).reshape(4, 3)
    assert torch.equal(decode_entry("key", bytearray(encode_entry("key", tensor))), tensor)
    assert torch.equal(decode_entry("key", forged(tensor, [4, 3])), tensor)  # the forgery's own check
    assert decode_entry("key", forged(tensor, [3, 3])) is None  # a longer payload than 3 x 3
    assert decode_entry("key", forged(tensor, [5, 3])) is None  # a shorter one than 5 x 3


class Model(torch.nn.Module):
    """A model as a family's adapter holds it: a vision tower, a language model and token embeddings."""

    def __init__(self, path: Path):
        super().__init__()
        self.name_or_path = str(path)
        self.visual = torch.nn.Linear(4, 4)
        self.visual.register_buffer("scale", torch.ones(4))
        self.language_model = torch.nn.Linear(4, 4)
        self.embed_tokens = torch.nn.Embedding(8, 4)

    def get_input_embeddings(self):
        return self.embed_tokens

    def get_output_embeddings(self):
        return None


class Adapter:
    def __init__(self, path: Path):
        self.model = Model(path)
        self.language_model = self.model.language_model
        self.device = torch.device("cpu")
        self.dtype = torch.float32


def test_the_vision_digest_covers_buffers_and_not_the_language_model(tmp_path):
    adapter = Adapter(tmp_path / "no-weight-files")  # not remembered: computed every time
    first = vision_digest_module.vision_digest(adapter, str(tmp_path))
    with torch.no_grad():
        adapter.language_model.weight.add_(1)
        adapter.model.embed_tokens.weight.add_(1)
    assert vision_digest_module.vision_digest(adapter, str(tmp_path)) == first
    with torch.no_grad():
        adapter.model.visual.scale.mul_(2)  # a buffer, not a parameter
    assert vision_digest_module.vision_digest(adapter, str(tmp_path)) != first


def test_the_vision_digest_says_whether_native_kernels_run(tmp_path, monkeypatch):
    adapter = Adapter(tmp_path / "no-weight-files")
    digests = set()
    for ops in (None, object()):
        monkeypatch.setattr(vision_digest_module, "native_ops", lambda ops=ops: ops)
        digests.add(vision_digest_module.vision_digest(adapter, str(tmp_path)))
    assert len(digests) == 2


def test_a_remembered_digest_that_fails_its_check_is_computed_again(tmp_path):
    weights = tmp_path / "model"
    weights.mkdir()
    (weights / "model.safetensors").write_bytes(b"weights")  # only its stat is read
    adapter = Adapter(weights)
    folder = str(tmp_path / "cache")
    digest = vision_digest_module.vision_digest(adapter, folder)
    (remembered,) = (tmp_path / "cache" / "digests").iterdir()
    whole = remembered.read_text()
    damaged = {
        "a bare digest": "0" * 32,
        "another digest": "0" * 32 + whole[32:],
        "another check": whole[:33] + "0" * 32,
        "cut short": whole[:40],
        "not text": "\xff" * 65,
    }
    for name, text in damaged.items():
        remembered.write_text(text, encoding="latin-1")
        assert vision_digest_module.vision_digest(adapter, folder) == digest, name  # not the file's
        assert remembered.read_text() != text, name  # written again, whole
