"""The input formats: WebDataset tars, saved `datasets` datasets and media folders."""

import io
import json
import os
import tarfile

import datasets
import pytest
from PIL import Image

from batchvl.config import InputConfig
from batchvl.errors import UserError
from batchvl.inputs.sources import make_source
from batchvl.inputs.types import Sample, ShardEnd
from tests.conftest import random_image


def png(seed: int) -> bytes:
    buffer = io.BytesIO()
    random_image(20, 30, seed).save(buffer, format="PNG")
    return buffer.getvalue()


def read(cfg: InputConfig, keep=lambda index: True):
    source = make_source(cfg)
    out = {}
    for shard in source.list_shards():
        items = list(source.iter_shard(shard, keep))
        assert isinstance(items[-1], ShardEnd) and all(isinstance(i, Sample) for i in items[:-1])
        out[shard.shard] = (items[:-1], items[-1].num_samples)
    return out


def write_tar(path, members: list[tuple[str, bytes]]):
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return path


def wds_members(count: int, start: int = 0):
    members = []
    for i in range(start, start + count):
        members += [
            (f"group/s{i:04d}.jpg", png(i)),
            (f"group/s{i:04d}.json", json.dumps({"question": f"q{i}", "nested": {"x": 1}}).encode()),
            (f"group/s{i:04d}.txt", f"caption {i}\n".encode()),
            (f"group/s{i:04d}.cls", b"7"),
        ]
    return members


def test_webdataset_groups_members_by_key(tmp_path):
    write_tar(tmp_path / "shard-000.tar", wds_members(3))
    write_tar(
        tmp_path / "shard-001.tar",
        [("x.left.png", png(10)), ("x.right.png", png(11)), ("y.json", b"{}"), ("z.png", png(12))],
    )
    out = read(InputConfig(paths=[str(tmp_path / "*.tar")], format="webdataset"))
    samples, count = out["shard-000.tar"]
    assert count == 3 and [s.key for s in samples] == ["group/s0000", "group/s0001", "group/s0002"]
    assert samples[1].fields == {"question": "q1", "txt": "caption 1", "cls": 7}
    assert samples[1].images[0].data == png(1)
    samples, count = out["shard-001.tar"]
    assert count == 3
    assert [len(s.images) for s in samples] == [2, 0, 1]  # two images in one sample
    assert samples[1].error.error_type == "missing_image"


def test_webdataset_workers_split_samples(tmp_path):
    write_tar(tmp_path / "s.tar", wds_members(7))
    cfg = InputConfig(paths=[str(tmp_path / "s.tar")], format="webdataset")
    parts = [[s.index for s in read(cfg, keep=lambda i, w=w: i % 2 == w)["s.tar"][0]] for w in range(2)]
    assert parts == [[0, 2, 4, 6], [1, 3, 5]]


@pytest.mark.parametrize("where", ["inside a member", "at a member boundary"])
def test_truncated_tar_keeps_readable_samples_and_reports_the_cut_one(tmp_path, where):
    full = write_tar(tmp_path / "full.tar", wds_members(6)).read_bytes()
    with tarfile.open(tmp_path / "full.tar") as tar:
        members = tar.getmembers()
    third_image = members[8]  # s0002.jpg
    if where == "inside a member":
        cut = third_image.offset_data + third_image.size // 2
    else:
        cut = third_image.offset_data + ((third_image.size + 511) // 512) * 512  # after s0002.jpg's data
    (tmp_path / "cut.tar").write_bytes(full[:cut])
    samples, count = read(InputConfig(paths=[str(tmp_path / "cut.tar")], format="webdataset"))["cut.tar"]
    assert count == 3
    assert [s.error for s in samples[:2]] == [None, None]
    assert samples[2].key == "group/s0002" and samples[2].error.error_type == "truncated_shard"


def test_hf_dataset_dict_shards_and_image_feature(tmp_path):
    images = [Image.open(io.BytesIO(png(i))) for i in range(5)]
    ds = datasets.Dataset.from_dict({"image": images, "question": [f"q{i}" for i in range(5)]})
    ds = ds.cast_column("image", datasets.Image())
    datasets.DatasetDict({"train": ds, "test": ds.select(range(2))}).save_to_disk(str(tmp_path / "ds"))
    out = read(InputConfig(paths=[str(tmp_path / "ds")], format="hf_dataset"))
    assert sorted(out) == ["test/data-00000-of-00001.arrow", "train/data-00000-of-00001.arrow"]
    samples, count = out["train/data-00000-of-00001.arrow"]
    assert count == 5 and samples[3].fields == {"question": "q3"}
    assert Image.open(io.BytesIO(samples[3].images[0].data)).size == (30, 20)
    with pytest.raises(UserError, match="save_to_disk"):
        read(InputConfig(paths=[str(tmp_path)], format="hf_dataset"))
    arrow = tmp_path / "ds" / "train" / "data-00000-of-00001.arrow"
    arrow.write_bytes(arrow.read_bytes()[: arrow.stat().st_size // 2])  # truncated: a one-line refusal
    with pytest.raises(UserError, match=f"input file '{arrow}' is not a readable Arrow file"):
        make_source(InputConfig(paths=[str(tmp_path / "ds")], format="hf_dataset")).list_shards()


def test_folder_keys_shards_and_confinement(tmp_path):
    root = tmp_path / "photos"
    (root / "b").mkdir(parents=True)
    for name in ["a.png", "b/c.PNG", "b/d.jpg", "e.webp"]:
        (root / name).write_bytes(png(len(name)))
    (root / "notes.txt").write_text("not media")
    (tmp_path / "outside.png").write_bytes(png(1))
    os.symlink(tmp_path / "outside.png", root / "z-link.png")
    out = read(InputConfig(paths=[str(root)], format="folder", files_per_shard=2))
    assert sorted(out) == ["photos/part-00000", "photos/part-00001", "photos/part-00002"]
    keys = [s.key for shard in sorted(out) for s in out[shard][0]]
    assert keys == ["a.png", "b/c.PNG", "b/d.jpg", "e.webp", "z-link.png"]
    link = out["photos/part-00002"][0][0]
    assert link.error.error_type == "path_outside_root"
    assert out["photos/part-00000"][0][1].images[0].path == str(root / "b" / "c.PNG")


def test_tar_links_are_read_and_what_holds_no_bytes_is_its_samples_error_row(tmp_path):
    """`tar cf` stores a file seen twice as a hard link: it was skipped, and its sample had no row."""
    path = tmp_path / "s.tar"
    with tarfile.open(path, "w") as tar:
        for name, kind, target in [
            ("a.png", tarfile.REGTYPE, ""),
            ("b.png", tarfile.LNKTYPE, "a.png"),  # a hard link
            ("c.png", tarfile.SYMTYPE, "a.png"),  # a symbolic link, inside the tar
            ("d.png", tarfile.SYMTYPE, "/etc/passwd"),  # one out of it: the file system is never read
            ("e.png", tarfile.FIFOTYPE, ""),
            ("f", tarfile.DIRTYPE, ""),  # a folder holds no sample
        ]:
            info = tarfile.TarInfo(name)
            info.type, info.linkname = kind, target
            data = png(1) if kind == tarfile.REGTYPE else b""
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    samples, count = read(InputConfig(paths=[str(path)], format="webdataset"))["s.tar"]
    assert count == 5 and [s.key for s in samples] == ["a", "b", "c", "d", "e"]
    assert [s.images[0].data for s in samples[:3]] == [png(1)] * 3 and not any(s.error for s in samples[:3])
    assert samples[3].error.error_type == "file_not_found"
    assert samples[3].error.message == "member 'd.png' links to '/etc/passwd', which the tar does not hold"
    assert samples[4].error.error_type == "not_a_file"


def test_names_that_are_not_utf8_become_escaped_keys_and_shard_ids(tmp_path):
    """A Latin-1 file or member name (kept by os and tarfile as lone surrogates) crashed the writer."""
    latin = os.fsdecode(b"caf\xe9")
    write_tar(tmp_path / f"{latin}.tar", [(f"{latin}.png", png(1)), ("ok.png", png(2))])
    out = read(InputConfig(paths=[str(tmp_path / "*.tar")], format="webdataset"))
    samples, _ = out["caf\\xe9.tar"]
    assert [s.key for s in samples] == ["caf\\xe9", "ok"] and samples[0].images[0].data == png(1)
    photos = tmp_path / "photos"
    photos.mkdir()
    (photos / f"{latin}.png").write_bytes(png(3))
    ((sample,), _) = read(InputConfig(paths=[str(photos)], format="folder"))["photos/part-00000"]
    assert sample.key == "caf\\xe9.png" and sample.error is None
    with open(sample.images[0].path, "rb") as file:  # the file itself, by its own name
        assert file.read() == png(3)
    assert "\0".join([sample.shard, sample.key]).encode()  # what the seeds and the writer take


def test_a_file_that_is_no_tar_is_one_error_row_whose_message_is_one_line(tmp_path):
    (tmp_path / "junk.tar").write_bytes(b"garbage")
    ((sample,), count) = read(InputConfig(paths=[str(tmp_path / "junk.tar")], format="webdataset"))[
        "junk.tar"
    ]
    assert count == 1 and sample.error.error_type == "truncated_shard"
    assert sample.error.message.startswith("tar file has no readable sample: file could not be opened")
    assert "\n" not in sample.error.message and "method tar: ReadError" in sample.error.message


def test_a_glob_of_another_formats_files_names_them(tmp_path):
    (tmp_path / "a.parquet").write_bytes(b"x")
    with pytest.raises(UserError) as refused:
        read(InputConfig(paths=[str(tmp_path / "*")], format="webdataset"))
    assert str(refused.value) == (
        f"input.paths: no tar files match '{tmp_path / '*'}', but 1 other file(s) do, such as "
        f"'{tmp_path / 'a.parquet'}'; set input.format to the reader of those files (docs/inputs.md)"
    )
