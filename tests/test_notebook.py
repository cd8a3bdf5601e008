"""notebooks/label_dataset.ipynb runs top to bottom in a real Jupyter kernel, with the job's notebook bar."""

from pathlib import Path

import nbformat
import pyarrow.parquet as pq
from nbclient import NotebookClient

NOTEBOOK = Path(__file__).resolve().parents[1] / "notebooks" / "label_dataset.ipynb"


def tagged(notebook, tag: str):
    (cell,) = [c for c in notebook.cells if tag in c.metadata.get("tags", [])]
    return cell


def test_label_dataset_notebook_runs(tmp_path):
    notebook = nbformat.read(NOTEBOOK, as_version=4)
    assert all(not c.get("outputs") for c in notebook.cells if c.cell_type == "code"), (
        "commit it without outputs"
    )
    client = NotebookClient(
        notebook,
        timeout=600,
        kernel_name="python3",
        store_widget_state=True,
        resources={"metadata": {"path": str(tmp_path)}},
    )
    client.execute()  # raises CellExecutionError on the first failing cell
    outputs = [o for c in notebook.cells if c.cell_type == "code" for o in c.outputs]
    assert not [o for o in outputs if o.output_type == "error"]

    # The caption cell shows tqdm's notebook bar (a widget), filled to the 7 samples.
    state = notebook.metadata.widgets["application/vnd.jupyter.widget-state+json"]["state"]
    (view,) = [o for o in tagged(notebook, "caption").outputs if o.output_type == "display_data"]
    bar = state[view.data["application/vnd.jupyter.widget-view+json"]["model_id"]]
    parts = [state[child.removeprefix("IPY_MODEL_")] for child in bar["state"]["children"]]
    (progress,) = [p["state"] for p in parts if p["model_name"] == "FloatProgressModel"]
    assert progress["value"] == progress["max"] == 7
    texts = [p["state"]["value"] for p in parts if p["model_name"] == "HTMLModel"]
    assert any("7/7" in text and "sample/s" in text for text in texts)

    # The gallery shows 4 images beside outputs that are in the written results.
    written = pq.read_table(tmp_path / "work" / "labels" / "data-00000-of-00001.parquet").to_pylist()
    gallery = tagged(notebook, "gallery").outputs[0].data["text/html"]
    assert gallery.count('<img class="bvl-thumb" src="data:image/jpeg;base64,') == 4
    assert sum(row["text"] is not None and row["text"] in gallery for row in written) >= 8

    errors = sum(r["status"] == "error" for r in written)
    assert f"{errors} error rows" in tagged(notebook, "errors").outputs[0].text
    broken = [r for r in written if r["name"] == "broken"]
    assert len(broken) == 4 and all(r["error_type"] == "image_decode_error" for r in broken)

    # The typed labels: one row per image fully labeled, joined back onto the images.
    complete = [
        k for k in {r["key"] for r in written} if all(r["status"] == "ok" for r in written if r["key"] == k)
    ]
    printed = "".join(
        o.get("text", "") for o in tagged(notebook, "labeled").outputs if o.output_type == "stream"
    )
    assert f"{len(complete)} of 7 images fully labeled" in printed
    assert "Value('bool')" in printed or "bool" in printed  # the attrs struct, typed from the schema
    assert (tmp_path / "work" / "labels" / "report.html").is_file()
