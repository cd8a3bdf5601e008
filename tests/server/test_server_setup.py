"""The openai backend's set-up, piece by piece: what scores choices, where a launched server logs."""

from __future__ import annotations

from types import SimpleNamespace

import yaml

from batchvl.config import load_job_config
from batchvl.pipeline.server_setup import choice_tokenizer, server_log_path
from batchvl.pipeline.tasks import TaskSlice
from batchvl.storage.output_dir import LocalDir


def test_a_tokenizer_without_an_end_of_sequence_token_cannot_score_choices():
    assert choice_tokenizer(SimpleNamespace(eos_token_id=None)) is None
    assert choice_tokenizer(None) is None
    scorer = choice_tokenizer(SimpleNamespace(eos_token_id=5))
    assert scorer is not None and scorer.eos_token_id == 5


def test_each_slurm_task_has_its_own_server_log(tmp_path):
    out = LocalDir(str(tmp_path / "out"))
    logs = tmp_path / "out" / "_batchvl" / "logs"
    assert server_log_path(out, TaskSlice(3, 4)) == logs / "server-3.log"
    assert server_log_path(out, TaskSlice(0, 4)) == logs / "server-0.log"
    assert server_log_path(out, None) == logs / "server-0.log"


def test_a_served_models_name_in_model_path_is_kept_and_a_local_folder_made_absolute(tmp_path):
    (tmp_path / "models" / "local").mkdir(parents=True)
    base = {
        "input": {"paths": ["data/*.parquet"]},
        "engine": {"backend": "openai", "server": {"url": "http://127.0.0.1:8000/v1"}},
        "output": {"dir": "out"},
    }
    for path, expected in [
        ("Qwen/Qwen2-VL-7B-Instruct", "Qwen/Qwen2-VL-7B-Instruct"),  # the server's name for its model
        ("models/local", str(tmp_path / "models" / "local")),
    ]:
        (tmp_path / "job.yaml").write_text(yaml.safe_dump({"model": {"path": path}, **base}))
        assert load_job_config(tmp_path / "job.yaml").model.path == expected
