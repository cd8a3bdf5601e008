"""`batchvl report`: the page's numbers, gallery and error rows against the job's outputs, then the page
in a real headless Chromium (Debian's chromium and chromium-driver; `make browser` installs them)."""

import base64
import io
import os
import re
import shutil
import subprocess
import sys
from html.parser import HTMLParser
from pathlib import Path

import datasets
import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from PIL import Image

from batchvl import api
from batchvl.config import load_job_config
from batchvl.pipeline.runner import run_job
from tests.conftest import png_bytes
from tests.http_server import LoopbackServer

PROMPTS_YAML = "[{name: caption, text: Describe this image.}, {name: short, text: One word.}]"


def smooth_image(height: int, width: int, seed: int) -> Image.Image:
    """Gradients with a colour per seed: compressible, so a JPEG thumbnail stays close to the original."""
    y, x = np.mgrid[0:height, 0:width]
    rng = np.random.default_rng(seed)
    colour = rng.integers(40, 216, size=3)
    pixels = np.stack(
        [(colour[c] + 40 * np.sin(x / (9 + 4 * c)) + 30 * np.cos(y / 13)) for c in range(3)], -1
    )
    return Image.fromarray(np.clip(pixels, 0, 255).astype(np.uint8))


class PageParser(HTMLParser):
    """Collects what the tests look at: gallery cards, table rows by table id, svg titles, attributes."""

    def __init__(self):
        super().__init__()
        self.cards: list[dict] = []  # {shard, sample, images: [src], text}
        self.table_rows: dict[str, list[list[str]]] = {}
        self.svg_titles: list[str] = []
        self.urls: list[str] = []
        self.csp: str | None = None
        self.stats: dict[str, str] = {}
        self._table = self._cell = self._title = self._stat = None
        self._in_card = 0
        self._stat_text = ""

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        self.urls += [a[k] for k in ("src", "href") if k in a]
        if tag == "meta" and a.get("http-equiv") == "Content-Security-Policy":
            self.csp = a["content"]
        if tag == "div" and a.get("class") == "bvl-card":
            self.cards.append(
                {"shard": a["data-shard"], "sample": int(a["data-sample"]), "images": [], "text": ""}
            )
            self._in_card = 1
        elif tag == "div" and self._in_card:
            self._in_card += 1
        if tag == "img" and self._in_card:
            self.cards[-1]["images"].append(a["src"])
        if tag == "table":
            self._table = a.get("id")
            self.table_rows[self._table] = []
        if tag == "tr" and self._table:
            self.table_rows[self._table].append([])
        if tag == "td":
            self._cell = ""
        if tag == "title":
            self._title = ""
        if tag == "div" and a.get("class") == "bvl-stat":
            self._stat, self._stat_text = True, ""
        if tag == "b" and self._stat:  # a stat's label ends and its value begins
            self._stat_text += "\0"

    def handle_endtag(self, tag):
        if tag == "div" and self._in_card:
            self._in_card -= 1
        if tag == "td" and self._cell is not None:
            self.table_rows[self._table][-1].append(self._cell)
            self._cell = None
        if tag == "table":
            self._table = None
        if tag == "title" and self._title is not None:
            self.svg_titles.append(self._title)
            self._title = None
        if tag == "b" and self._stat:
            label, _, value = self._stat_text.rpartition("\0")
            self.stats[label] = value
            self._stat = None

    def handle_data(self, data):
        if self._in_card:
            self.cards[-1]["text"] += data
        if self._cell is not None:
            self._cell += data
        if self._title is not None:
            self._title += data
        if self._stat:
            self._stat_text += data


def parse_page(path) -> PageParser:
    parser = PageParser()
    parser.feed(path.read_text(encoding="utf-8"))
    return parser


def decode_data_uri(uri: str) -> Image.Image:
    header, _, payload = uri.partition(",")
    assert header in ("data:image/jpeg;base64", "data:image/png;base64")
    return Image.open(io.BytesIO(base64.b64decode(payload))).convert("RGB")


@pytest.fixture(scope="module")
def finished_job(tmp_path_factory, tiny_model_dir, loaded_fp32):
    root = tmp_path_factory.mktemp("report")
    images = {f"s{i}": smooth_image(60 + 17 * i, 110 - 9 * i, seed=i) for i in range(7)}
    data = {name: png_bytes(image) for name, image in images.items()}
    data["broken"], data["empty"] = b"\x89PNG broken", b""
    (root / "data").mkdir()
    for number, keys in enumerate((["s0", "broken", "s1", "s2", "s3"], ["s4", "empty", "s5", "s6"])):
        pq.write_table(
            pa.table({"key": keys, "image": [data[k] for k in keys]}),
            root / "data" / f"part-{number}.parquet",
        )
    (root / "job.yaml").write_text(
        f"model: {{path: {tiny_model_dir}, dtype: float32, device: cpu}}\n"
        'input: {paths: ["data/*.parquet"], key_column: key}\n'
        f"prompts: {PROMPTS_YAML}\n"
        "sampling: {max_new_tokens: 6}\n"
        "output: {dir: out}\n"
    )
    run_job(load_job_config(root / "job.yaml"), loaded=loaded_fp32, show_progress=False)
    done = subprocess.run(
        [sys.executable, "-m", "batchvl", "report", "job.yaml", "--samples", "4", "--seed", "3"],
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 0, done.stderr
    assert (
        done.stdout.strip() == f"report: {root / 'out' / 'report.html'} (18 rows, 4 errors, 4 in the gallery)"
    )
    rows = {
        (f"part-{n}.parquet", r["sample_index"], r["prompt"]): r
        for n in range(2)
        for r in pq.read_table(root / "out" / f"part-{n}.parquet").to_pylist()
    }
    return root, images, rows


def test_the_report_and_the_gallery_show_a_sample_whose_download_failed_with_its_error(tmp_path, loaded_fp32):
    with LoopbackServer() as server:
        urls = [
            server.add_image("a.png", png_bytes(smooth_image(48, 64, seed=0))),
            server.url("/img/gone.png"),
        ]
        results = api.caption(
            datasets.Dataset.from_dict({"image": urls}),
            model=loaded_fp32,
            output_dir=tmp_path / "out",
            download={"allow_private": True},
            sampling={"max_new_tokens": 4},
            progress=False,
        )
        report = parse_page(Path(results.report()))
        gallery = PageParser()
        gallery.feed(results.gallery(n=2).data)
    error = f"download_http_404: {urls[1]}: HTTP 404 Not Found"
    for page in (report, gallery):
        first, failed = sorted(page.cards, key=lambda card: card["sample"])
        assert len(first["images"]) == 1
        assert failed["images"] == [] and error in failed["text"]
        assert "cannot show this image" not in failed["text"]  # no attempt to decode the missing image


def test_report_numbers_gallery_and_error_rows(finished_job):
    root, images, rows = finished_job
    page = parse_page(root / "out" / "report.html")

    assert page.csp == "default-src 'none'; img-src data:; style-src 'unsafe-inline'"
    assert page.urls and all(url.startswith("data:image/") for url in page.urls)  # nothing to fetch

    ok_rows = [r for r in rows.values() if r["status"] == "ok"]
    errors = [r for r in rows.values() if r["status"] == "error"]
    assert page.stats["shards written"] == "2 / 2"
    assert page.stats["rows ok"] == str(len(ok_rows)) == "14"
    assert page.stats["error rows"] == "4"
    assert page.table_rows["errors-by-type"][1:] == [["image_decode_error", "2"], ["empty_image", "2"]]
    error_table = page.table_rows["error-rows"][1:]
    assert sorted(map(tuple, error_table)) == sorted(
        (
            f"part-{0 if r['key'] == 'broken' else 1}.parquet",
            r["key"],
            r["prompt"],
            r["error_type"],
            r["error_message"],
        )
        for r in errors
    )

    # Two histograms (prompt and output lengths) whose bars count every ok row once.
    counts = [int(t.rpartition(": ")[2]) for t in page.svg_titles if re.fullmatch(r"\d+(-\d+)?: \d+", t)]
    assert sum(counts) == 2 * len(ok_rows)

    # The gallery: 4 samples with an ok row, each thumbnail the sample's own image, each output shown.
    assert len(page.cards) == 4
    keys_by_place = {(shard, r["sample_index"]): r["key"] for (shard, _, _), r in rows.items()}
    for card in page.cards:
        key = keys_by_place[(card["shard"], card["sample"])]
        assert key in images
        (uri,) = card["images"]
        expected = images[key].copy()
        expected.thumbnail((224, 224))
        shown = decode_data_uri(uri)
        assert shown.size == expected.size
        assert np.abs(np.asarray(shown, np.int16) - np.asarray(expected, np.int16)).mean() < 3
        for prompt in ("caption", "short"):
            assert rows[(card["shard"], card["sample"], prompt)]["text"] in card["text"]


def find_browser():
    browser = next((shutil.which(n) for n in ("chromium", "chromium-browser") if shutil.which(n)), None)
    return browser, shutil.which("chromedriver")


@pytest.fixture(scope="module")
def chromium():
    browser, driver_path = find_browser()
    if not browser or not driver_path:
        pytest.skip("needs Debian's chromium and chromium-driver: run `make browser` (root, apt-get)")
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    options = webdriver.ChromeOptions()
    options.binary_location = browser
    for argument in ("--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"):
        options.add_argument(argument)
    options.add_argument("--window-size=1400,1800")
    options.add_argument("--force-device-scale-factor=1")
    options.set_capability("goog:loggingPrefs", {"browser": "ALL"})
    driver = webdriver.Chrome(service=Service(driver_path), options=options)
    yield driver
    driver.quit()


def console_messages(driver, url: str) -> list[dict]:
    driver.get(url)
    driver.execute_script("return document.readyState")
    return [entry for entry in driver.get_log("browser") if entry["level"] in ("SEVERE", "WARNING")]


def test_report_in_headless_chromium(finished_job, chromium, tmp_path):
    from selenium.webdriver.common.by import By

    root, images, _ = finished_job
    # The console check catches what it should: a page that fetches from outside is refused by the
    # report's Content-Security-Policy, and that is a console error.
    page = (root / "out" / "report.html").read_text()
    control = tmp_path / "control.html"
    control.write_text(page.replace("</body>", '<img src="https://example.invalid/x.png"></body>'))
    assert any(
        "Content Security Policy" in e["message"] for e in console_messages(chromium, control.as_uri())
    )

    assert console_messages(chromium, (root / "out" / "report.html").as_uri()) == []
    assert chromium.title == "batchvl report: out"
    gallery = chromium.find_element(By.ID, "gallery")
    cards = gallery.find_elements(By.CLASS_NAME, "bvl-card")
    assert len(cards) == 4 and all(card.is_displayed() for card in cards)
    thumbs = gallery.find_elements(By.TAG_NAME, "img")
    assert all(
        chromium.execute_script("return arguments[0].complete && arguments[0].naturalWidth", t)
        for t in thumbs
    )

    chromium.execute_script("arguments[0].scrollIntoView()", gallery)
    chromium.save_screenshot(str(tmp_path / "report.png"))
    screenshot = Image.open(tmp_path / "report.png").convert("RGB")
    # The screenshot shows the gallery: where the first thumbnail is laid out, the pixels are its image.
    first = thumbs[0]
    box = chromium.execute_script(
        "const r = arguments[0].getBoundingClientRect(); return [r.left, r.top, r.width, r.height]", first
    )
    left, top, width, height = (round(v) for v in box)
    shown = np.asarray(screenshot.crop((left, top, left + width, top + height)), np.int16)
    expected = np.asarray(decode_data_uri(first.get_attribute("src")), np.int16)
    assert shown.shape == expected.shape
    assert np.abs(shown - expected).mean() < 6
    background = np.asarray(screenshot.crop((0, 0, 8, 8)), np.int16)
    assert np.abs(shown - background.mean((0, 1))).mean() > 20  # not a blank region


def test_report_on_an_output_dir_that_does_not_exist_is_a_user_error(finished_job):
    root, _, _ = finished_job
    done = subprocess.run(
        [sys.executable, "-m", "batchvl", "report", "job.yaml", "--set", "output.dir=never-ran"],
        cwd=root,
        capture_output=True,
        text=True,
        env={**os.environ, "HF_HUB_OFFLINE": "1"},
    )
    assert done.returncode == 2
    (line,) = done.stderr.strip().splitlines()
    assert "never-ran does not exist: run the job first" in line
    assert not (root / "never-ran").exists()


def test_report_out_is_a_path_in_the_current_folder_or_an_object_store_url(finished_job, s3):
    root, _, _ = finished_job
    endpoint, client = s3
    client.create_bucket(Bucket="reports")
    options = f"output.storage_options={{endpoint_url: '{endpoint}', key: testing, secret: testing}}"
    for out in ("page.html", "s3://reports/job/page.html"):
        args = ["report", "job.yaml", "--samples", "0", "--out", out, "--set", options]
        done = subprocess.run(
            [sys.executable, "-m", "batchvl", *args],
            cwd=root,
            capture_output=True,
            text=True,
            env={**os.environ, "HF_HUB_OFFLINE": "1"},
        )
        assert done.returncode == 0, done.stderr
        assert done.stdout.strip() == f"report: {out} (18 rows, 4 errors, 0 in the gallery)"
    stored = client.get_object(Bucket="reports", Key="job/page.html")["Body"].read().decode()
    for page in ((root / "page.html").read_text(encoding="utf-8"), stored):
        assert page.startswith("<!DOCTYPE html>") and "<title>batchvl report: out</title>" in page
    assert not (root / "s3:").exists()
