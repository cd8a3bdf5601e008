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
