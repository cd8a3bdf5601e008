import base64
import hashlib
import io
import os
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from batchvl.config import InputConfig
from batchvl.errors import UserError
from batchvl.inputs.parquet import ParquetSource
from batchvl.inputs.types import ShardEnd, ShardInfo
from batchvl.outputs.commit import ShardMarker, commit_shard, marker_path, read_committed, read_marker
from batchvl.outputs.results import committed_outputs, results_table
from batchvl.outputs.writers import ResultRow, rows_to_table
from batchvl.storage.output_dir import LocalDir


def png_bytes(color=(255, 0, 0)) -> bytes:
    buffer = io.BytesIO()
    Image.new("RGB", (4, 4), color).save(buffer, format="PNG")
    return buffer.getvalue()


def write_table(path, columns: dict):
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table(columns), path)
    return path


def list_shards(patterns):
    return ParquetSource(InputConfig(paths=patterns)).list_shards()


def read_all(path, keep=lambda index: True, **kwargs):
    source = ParquetSource(InputConfig(paths=[str(path)], **kwargs))
    (shard,) = source.list_shards()
    items = list(source.iter_shard(shard, keep))
    assert items[-1] == ShardEnd(shard.shard, shard.num_rows)  # the count covers every row, kept or not
    return items[:-1]


def test_list_shards_sorts_and_names_by_relative_path(tmp_path):
    for name in ["b/part-1.parquet", "a/part-0.parquet", "a/part-2.parquet"]:
        write_table(tmp_path / name, {"image": [b"x"]})
    shards = list_shards([str(tmp_path / "**" / "*.parquet")])
    assert [s.shard for s in shards] == ["a/part-0.parquet", "a/part-2.parquet", "b/part-1.parquet"]
    assert all(s.num_rows == 1 for s in shards)
    with pytest.raises(UserError, match="no Parquet files match"):
        list_shards([str(tmp_path / "missing" / "*.parquet")])
    # A folder named like a shard (Spark's x.parquet/part-0.parquet) is refused, not skipped unsaid...
    write_table(tmp_path / "c" / "x.parquet" / "part-0.parquet", {"image": [b"x"]})
    write_table(tmp_path / "c" / "y.parquet", {"image": [b"x"]})
    with pytest.raises(
        UserError, match=r"'.*/c/x.parquet' matches .* but is a folder.*c/x.parquet/\*.parquet"
    ):
        list_shards([str(tmp_path / "c" / "*.parquet")])
    # ...unless the pattern reaches its files too
    shards = list_shards([str(tmp_path / "c" / "**" / "*.parquet")])
    assert [s.shard for s in shards] == ["x.parquet/part-0.parquet", "y.parquet"]


def test_bytes_struct_list_and_missing_cells(tmp_path):
    image = png_bytes()
    struct = pa.array(
        [{"bytes": image, "path": None}, {"bytes": None, "path": None}],
        type=pa.struct([("bytes", pa.binary()), ("path", pa.string())]),
    )
    samples = read_all(write_table(tmp_path / "s.parquet", {"image": struct, "caption": ["a", "b"]}))
    assert samples[0].images[0].data == image and samples[0].error is None
    assert samples[0].fields == {"caption": "a"}
    assert samples[1].error.error_type == "missing_image"

    samples = read_all(write_table(tmp_path / "l.parquet", {"image": [[image, image], None]}))
    assert len(samples[0].images) == 2
    assert samples[1].error.error_type == "missing_image"


def test_a_cell_of_numbers_is_named_unsupported_not_missing(tmp_path):
    # an array kept as nested lists: the outer list is read as the row's images, each a list of numbers
    samples = read_all(write_table(tmp_path / "n.parquet", {"image": [[[1, 2], [3, 4]], [[5]]]}))
    assert samples[0].error.error_type == "unsupported_media"
    assert samples[0].error.message == (
        "column 'image' holds a list of ints, not an image: it takes image bytes, a {bytes, path} struct "
        "(datasets' Image feature: cast an array column to it), a path or a URL"
    )
    samples = read_all(write_table(tmp_path / "i.parquet", {"image": [7]}))
    assert samples[0].error.error_type == "unsupported_media"
    assert samples[0].error.message.startswith("column 'image' holds a value of type int, not an image")


def root_with_a_link_out(tmp_path):
    """A root `data/` holding img/ok.png and img/link.png, a symbolic link to secret.png beside the root."""
    root = tmp_path / "data"
    (root / "img").mkdir(parents=True)
    (root / "img" / "ok.png").write_bytes(png_bytes())
    (tmp_path / "secret.png").write_bytes(png_bytes())
    os.symlink(tmp_path / "secret.png", root / "img" / "link.png")
    return root


def test_path_column_is_confined_to_root(tmp_path):
    root = root_with_a_link_out(tmp_path)
    paths = ["img/ok.png", "../../etc/passwd", "/etc/passwd", "img/link.png", "img/missing.png"]
    samples = read_all(write_table(root / "p.parquet", {"image": paths}))
    assert samples[0].error is None and samples[0].images[0].path == str(root / "img" / "ok.png")
    assert [s.error.error_type for s in samples[1:]] == [
        "path_outside_root",
        "path_outside_root",
        "path_outside_root",
        "file_not_found",
    ]


def test_an_absolute_path_inside_the_root_is_read_and_each_refusal_names_its_rule(tmp_path):
    root = root_with_a_link_out(tmp_path)
    paths = [str(root / "img" / "ok.png"), str(tmp_path / "secret.png"), "../secret.png", "img/link.png"]
    samples = read_all(write_table(root / "p.parquet", {"image": paths}))
    assert samples[0].error is None and samples[0].images[0].path == str(root / "img" / "ok.png")
    assert [s.error.message for s in samples[1:]] == [
        f"media path '{tmp_path / 'secret.png'}' is absolute and not under input.root '{root}'",
        f"media path '../secret.png' climbs out of input.root '{root}' with '..'",
        f"media path 'img/link.png' is a symbolic link (or lies under one) to {tmp_path / 'secret.png'}, "
        f"outside input.root '{root}'",
    ]


def test_a_data_url_cell_is_the_image_it_holds(tmp_path):
    image = png_bytes()
    cells = [
        "data:image/png;base64," + base64.b64encode(image).decode(),
        "DATA:image/png;base64,@@@",
        "data:,x",
    ]
    samples = read_all(write_table(tmp_path / "d.parquet", {"image": cells}))
    assert samples[0].error is None and samples[0].images[0].data == image
    assert [s.error.error_type for s in samples[1:]] == ["image_decode_error", "image_decode_error"]
    assert "the data: image is not valid base64" in samples[1].error.message
    assert "a data: image must be base64-encoded" in samples[2].error.message


def test_key_column_and_missing_columns(tmp_path):
    path = write_table(tmp_path / "k.parquet", {"image": [b"x", b"y", b"z"], "id": [10, None, 12]})
    # A null key is the row's index, as without a key column; never the text 'None'.
    assert [s.key for s in read_all(path, key_column="id")] == ["10", "1", "12"]
    with pytest.raises(UserError, match="input.key_column"):
        read_all(path, key_column="nope")
    with pytest.raises(UserError, match="input.image_column"):
        read_all(path, image_column="img")


def test_streams_large_file_in_order_and_splits_it_between_workers(tmp_path):
    path = write_table(tmp_path / "big.parquet", {"image": [b"x"] * 5000})
    assert [s.index for s in read_all(path)] == list(range(5000))
    parts = [[s.index for s in read_all(path, keep=lambda i, w=w: i % 3 == w)] for w in range(3)]
    assert sorted(sum(parts, [])) == list(range(5000))
    assert all(index % 3 == w for w, part in enumerate(parts) for index in part)


def row(sample_index, prompt_index, **fields):
    return ResultRow(
        key=str(sample_index),
        sample_index=sample_index,
        prompt=f"p{prompt_index}",
        prompt_index=prompt_index,
        text="t",
        status="ok",
        error_type=None,
        error_message=None,
        num_prompt_tokens=3,
        num_output_tokens=2,
        finish_reason="stop",
        num_images=1,
        latency_s=0.1,
        fields=fields,
    )


def commit(out_dir, shard: str, rows: list[ResultRow], metadata: dict) -> str:
    marker = ShardMarker.for_rows(shard, rows, {}, "f", task=None)
    return commit_shard(LocalDir(str(out_dir)), shard, rows_to_table(rows, metadata), marker)


def test_a_committed_shard_has_its_rows_in_order_and_a_marker_naming_size_and_hash(tmp_path):
    rows = [row(1, 1, source="b"), row(0, 1, status="x"), row(1, 0, source="b"), row(0, 0, status="x")]
    path = commit(tmp_path, "sub/part-0.parquet", rows, {"job": "j"})
    assert path == str(tmp_path / "sub" / "part-0.parquet")
    table = pq.read_table(path)
    assert list(zip(table["sample_index"].to_pylist(), table["prompt"].to_pylist(), strict=True)) == [
        (0, "p0"),
        (0, "p1"),
        (1, "p0"),
        (1, "p1"),
    ]
    assert table["source"].to_pylist() == [None, None, "b", "b"]
    assert table["input_status"].to_pylist() == ["x", "x", None, None]  # a clash with a result column
    assert table.schema.metadata[b"job"] == b"j"
    assert sorted(os.listdir(tmp_path / "sub")) == ["part-0.parquet"]  # no temp file left
    out = LocalDir(str(tmp_path))
    marker = read_marker(out, "sub/part-0.parquet")
    data = (tmp_path / "sub" / "part-0.parquet").read_bytes()
    assert (marker.output_bytes, marker.output_sha256) == (len(data), hashlib.sha256(data).hexdigest())
    assert marker_path(out, "sub/part-0.parquet") == str(
        tmp_path / "_batchvl" / "done" / "sub" / "part-0.json"
    )


def test_pass_through_columns_never_share_a_name_and_values_of_no_one_type_are_json_text(tmp_path):
    """An input with both `status` and `input_status`: two columns of one name would make a file nothing
    reads back. A field of an int and a string (a WebDataset json field), or an int past 64 bits: the shard
    is still committed, that column as JSON text."""
    rows = [
        row(0, 0, status="x", input_status="y", score=1, big=2**70, ratio=1),
        row(1, 0, status="z", input_status="w", score="high", big=None, ratio=1.5),
    ]
    table = pq.read_table(commit(tmp_path, "s.parquet", rows, {}))
    names = table.column_names
    assert len(names) == len(set(names))
    assert table["input_status"].to_pylist() == ["y", "w"]  # the input's own column keeps its name
    assert table["input_input_status"].to_pylist() == ["x", "z"]  # the input's `status`
    assert table["score"].to_pylist() == ["1", '"high"']
    assert table["big"].to_pylist() == [str(2**70), None]
    assert table["ratio"].to_pylist() == [1.0, 1.5]  # an int and a float: one Arrow type, as before


def test_results_of_shards_whose_column_types_clash_read_back_as_json_text(tmp_path):
    """A pass-through column of ints in one shard and strings in another: each shard was written alone, so
    reading the job's results takes that column as JSON text; types that widen (int and float) widen."""
    commit(tmp_path, "a.parquet", [row(0, 0, score=1, ratio=1)], {})
    commit(tmp_path, "b.parquet", [row(0, 0, score="high", ratio=0.5)], {})
    out = LocalDir(str(tmp_path))
    shards = [ShardInfo(name, str(tmp_path / name), 1) for name in ("a.parquet", "b.parquet")]
    table = results_table(committed_outputs(out, shards))
    assert table["shard"].to_pylist() == ["a.parquet", "b.parquet"]
    assert table["score"].to_pylist() == ["1", '"high"']
    assert table["ratio"].to_pylist() == [1.0, 0.5]


def test_a_committed_local_file_changed_since_is_refused_when_read_back(tmp_path):
    rows = [row(0, 0), row(1, 0)]
    path = commit(tmp_path, "part-0.parquet", rows, {"job": "j"})
    out = LocalDir(str(tmp_path))
    marker = read_marker(out, "part-0.parquet")
    assert read_committed(out, "part-0.parquet", marker).num_rows == 2
    data = bytearray(Path(path).read_bytes())
    data[len(data) // 2] ^= 0xFF  # the same size: only the hash tells
    Path(path).write_bytes(bytes(data))
    marker = read_marker(out, "part-0.parquet")
    with pytest.raises(UserError, match="changed after it was committed") as refused:
        read_committed(out, "part-0.parquet", marker)
    assert path in str(refused.value)


def test_write_empty_shard(tmp_path):
    path = commit(tmp_path, "empty.parquet", [], {})
    assert pq.read_table(path).num_rows == 0
