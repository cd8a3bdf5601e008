"""Image columns holding http(s) URLs, through a job and the CLI: each URL's outcome is its row (the same
caption as the image given as bytes, or an error of its download's type), counters land in the stats JSON
and the report, loopback is refused unless the job allows it, and a rerun with a cache downloads nothing."""

import datasets
import pyarrow as pa
import pyarrow.parquet as pq

from batchvl import api
from batchvl.commands.retry import retry_failed
from batchvl.config import job_config_from_dict
from batchvl.inputs.table_rows import RowSampler
from batchvl.outputs.run_stats import read_run_stats
from batchvl.pipeline.runner import run_job
from batchvl.storage.output_dir import LocalDir
from tests.conftest import png_bytes, random_image
from tests.http_server import LoopbackServer
from tests.test_cli import batchvl

IMAGES = {name: png_bytes(random_image(40 + 8 * i, 64, i)) for i, name in enumerate(["a", "b", "c"])}


def write_table(folder, keys: list[str], images: list) -> None:
    folder.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"key": keys, "image": images}), folder / "part-0.parquet")


def job(tmp_path, model_dir, data: str, out: str, download: dict) -> dict:
    return {
        "model": {"path": str(model_dir), "dtype": "float32", "device": "cpu"},
        "input": {"paths": [str(tmp_path / data / "*.parquet")], "key_column": "key", "download": download},
        "prompts": [{"name": "caption", "text": "Describe this image."}],
        "sampling": {"max_new_tokens": 5},
        "output": {"dir": str(tmp_path / out)},
    }


def rows_of(out_dir) -> dict[str, dict]:
    return {row["key"]: row for row in pq.read_table(out_dir / "part-0.parquet").to_pylist()}


def test_url_cells_caption_like_bytes_and_each_failure_is_its_own_error_row(tmp_path, loaded_fp32):
    with LoopbackServer() as server:
        urls = {name: server.add_image(f"{name}.png", data) for name, data in IMAGES.items()}
        server.images["flaky"] = IMAGES["c"]
        cases = {
            "a": urls["a"],
            "b-redirected": server.url("/redirect/b.png"),
            "c-after-a-500": server.url("/flaky/500/1/c"),
            "missing": server.url("/img/missing.png"),
            "html": server.url("/html"),
            "loop": server.url("/loop"),
            "endless": server.url("/endless"),
        }
        write_table(tmp_path / "urls", list(cases), list(cases.values()))
        write_table(tmp_path / "bytes", ["a", "b-redirected", "c-after-a-500"], list(IMAGES.values()))
        download = {"allow_private": True, "backoff_s": 0, "retries": 1, "max_bytes": 300_000}
        cfg = job_config_from_dict(job(tmp_path, loaded_fp32.path, "urls", "out", download))
        stats = run_job(cfg, loaded=loaded_fp32, show_progress=False).stats
        reference = job(tmp_path, loaded_fp32.path, "bytes", "ref", {})
        run_job(job_config_from_dict(reference), loaded=loaded_fp32, show_progress=False)

    rows, expected = rows_of(tmp_path / "out"), rows_of(tmp_path / "ref")
    assert len(rows) == len(cases)
    for key in expected:
        assert rows[key]["status"] == "ok", rows[key]["error_message"]
        assert rows[key]["text"] == expected[key]["text"]
    errors = {
        key: (row["error_type"], row["error_message"]) for key, row in rows.items() if key not in expected
    }
    assert {key: kind for key, (kind, _) in errors.items()} == {
        "missing": "download_http_404",
        "html": "image_decode_error",
        "loop": "download_redirect_loop",
        "endless": "image_too_large",
    }
    assert cases["missing"] in errors["missing"][1]
    assert stats["downloads"] == 4  # a, b, c after its retry, and the html page
    page = b"<html><body>Not an image</body></html>"
    assert stats["download_bytes"] == sum(len(d) for d in IMAGES.values()) + len(page)
    assert stats["download_retries"] == 1
    assert stats["download_failures_by_type"] == {
        "download_http_404": 1,
        "download_redirect_loop": 1,
        "image_too_large": 1,
    }


def test_loopback_urls_are_refused_by_default_before_any_request(tmp_path, loaded_fp32):
    with LoopbackServer() as server:
        write_table(tmp_path / "urls", ["a"], [server.add_image("a.png", IMAGES["a"])])
        cfg = job_config_from_dict(job(tmp_path, loaded_fp32.path, "urls", "out", {}))
        run_job(cfg, loaded=loaded_fp32, show_progress=False)
        assert sum(server.requests.values()) == 0
    row = rows_of(tmp_path / "out")["a"]
    assert row["error_type"] == "url_not_allowed"
    assert "input.download.allow_private" in row["error_message"]


def test_a_rerun_with_a_cache_downloads_nothing_and_the_report_counts_downloads(tmp_path, tiny_model_dir):
    with LoopbackServer() as server:
        urls = [server.add_image(f"{name}.png", data) for name, data in IMAGES.items()]
        write_table(tmp_path / "data", ["a", "b", "c"], urls)
        yaml = f"""
model: {{path: {tiny_model_dir}, dtype: float32, device: cpu}}
input:
  paths: ["data/*.parquet"]
  key_column: key
  download: {{allow_private: true, cache_dir: cache, concurrency: 2}}
prompts: [{{name: caption, text: Describe this image.}}]
sampling: {{max_new_tokens: 4}}
output: {{dir: out}}
"""
        (tmp_path / "job.yaml").write_text(yaml)
        assert batchvl("run", "job.yaml", cwd=tmp_path).returncode == 0
        first = dict(server.requests)
        assert batchvl("run", "job.yaml", "--set", "output.overwrite=true", cwd=tmp_path).returncode == 0
        assert dict(server.requests) == first == {f"/img/{name}.png": 1 for name in IMAGES}
    runs = read_run_stats(LocalDir(str(tmp_path / "out")))
    assert [(r["downloads"], r["download_cache_hits"]) for r in runs] == [(3, 0), (0, 3)]
    assert all(row["status"] == "ok" for row in rows_of(tmp_path / "out").values())
    assert batchvl("report", "job.yaml", cwd=tmp_path).returncode == 0
    html = (tmp_path / "out" / "report.html").read_text()
    assert '<section id="downloads">' in html and "from the download cache" in html
    # the gallery's thumbnails come through the job's reader, here from the cache (the server is gone)
    assert html.count("data:image/jpeg;base64,") == 3


def test_caption_takes_a_dataset_of_urls(tmp_path, loaded_fp32):
    with LoopbackServer() as server:
        urls = [server.add_image(f"{name}.png", data) for name, data in IMAGES.items()]
        dataset = datasets.Dataset.from_dict({"image": [*urls, server.url("/img/gone.png")]})
        options = dict(model=loaded_fp32, sampling={"max_new_tokens": 4}, progress=False)
        local = {"allow_private": True}
        results = api.caption(dataset, output_dir=tmp_path / "out", download=local, **options)
        from_bytes = datasets.Dataset.from_dict({"image": list(IMAGES.values())})
        expected = api.caption(from_bytes, output_dir=tmp_path / "ref", **options)
    rows = results.dataset.to_list()
    assert [row["status"] for row in rows] == ["ok", "ok", "ok", "error"]
    assert [row["text"] for row in rows[:3]] == expected.dataset["text"]
    assert rows[3]["error_type"] == "download_http_404"
    assert results.stats["downloads"] == 3


def test_malformed_urls_are_error_rows_naming_them_and_the_other_samples_are_captioned(tmp_path, loaded_fp32):
    with LoopbackServer() as server:
        good = {name: server.add_image(f"{name}.png", IMAGES[name]) for name in ("a", "b")}
        bad = {
            "port-out-of-range": "http://127.0.0.1:99999/x.png",
            "unclosed-ipv6": "http://[::1/x.png",
            "redirect-to-a-bad-port": server.url("/to/127.0.0.1:99999/x.png"),
        }
        cases = {"a": good["a"], **bad, "b": good["b"]}
        write_table(tmp_path / "urls", list(cases), list(cases.values()))
        download = {"allow_private": True, "backoff_s": 0}
        run_job(
            job_config_from_dict(job(tmp_path, loaded_fp32.path, "urls", "out", download)),
            loaded=loaded_fp32,
            show_progress=False,
        )
    rows = rows_of(tmp_path / "out")
    assert [rows[key]["status"] for key in good] == ["ok", "ok"]
    for key, url in bad.items():
        assert rows[key]["error_type"] == "download_error"
        assert (
            rows[key]["error_message"].startswith(url) and "is not a valid URL" in rows[key]["error_message"]
        )


def test_any_other_exception_reading_a_media_cell_is_the_samples_error_row(tmp_path):
    sample = RowSampler("image", "key", None).sample(
        "part-0", 3, {"key": "k", "image": "a\0b.png"}, str(tmp_path)
    )
    assert (sample.error.error_type, sample.error.message) == (
        "preprocess_error",
        "media cell: ValueError: embedded null byte",
    )


def test_a_download_that_hangs_is_ended_by_the_watchdog_and_the_other_samples_flow(tmp_path, loaded_fp32):
    with LoopbackServer() as server:
        server.images["slow.png"] = IMAGES["a"]
        good = {name: server.add_image(f"{name}.png", data) for name, data in IMAGES.items()}
        cases = {"slow": server.url("/slow-headers/slow.png"), **good}
        write_table(tmp_path / "urls", list(cases), list(cases.values()))
        # Its headers take about 5 s, well within total_timeout_s: only the watchdog ends the wait.
        download = {"allow_private": True, "retries": 0, "total_timeout_s": 60}
        spec = job(tmp_path, loaded_fp32.path, "urls", "out", download)
        spec["preprocess"] = {"workers": 1, "timeout_s": 2}
        run_job(job_config_from_dict(spec), loaded=loaded_fp32, show_progress=False)
    rows = rows_of(tmp_path / "out")
    assert rows["slow"]["error_type"] == "preprocess_timeout"
    assert [rows[key]["status"] for key in good] == ["ok"] * len(good)


def test_retry_failed_downloads_again_a_cached_body_that_did_not_decode(tmp_path, loaded_fp32):
    with LoopbackServer() as server:
        server.images["late.png"] = IMAGES["a"]  # an error page with 200 first, the image after
        cases = {"late": server.url("/html-then/late.png"), "b": server.add_image("b.png", IMAGES["b"])}
        write_table(tmp_path / "urls", list(cases), list(cases.values()))
        download = {"allow_private": True, "cache_dir": str(tmp_path / "cache")}
        cfg = job_config_from_dict(job(tmp_path, loaded_fp32.path, "urls", "out", download))
        run_job(cfg, loaded=loaded_fp32, show_progress=False)
        assert rows_of(tmp_path / "out")["late"]["error_type"] == "image_decode_error"
        retry_failed(cfg, cfg, [], loaded=loaded_fp32, show_progress=False)
        assert server.requests == {"/html-then/late.png": 2, "/img/b.png": 1}
    assert [row["status"] for row in rows_of(tmp_path / "out").values()] == ["ok", "ok"]
