"""A model folder missing what a run needs is refused in one line naming the folder and the file, before
any work: a config.json that is not JSON or not an object, weights that are absent, truncated or not
safetensors, an index naming a file the folder lacks, a folder without its tokenizer files."""

import json
import shutil

import pytest

from batchvl.errors import UserError
from batchvl.models.checkpoint_folder import check_model_folder


@pytest.fixture
def model_copy(tiny_model_dir, tmp_path):
    folder = tmp_path / "model"
    shutil.copytree(tiny_model_dir, folder)
    return folder


def refusal(folder) -> str:
    with pytest.raises(UserError) as info:
        check_model_folder(str(folder))
    assert "\n" not in str(info.value)
    return str(info.value)


def test_a_whole_folder_passes_and_gives_its_configuration(model_copy):
    assert check_model_folder(str(model_copy)).model_type == "qwen2_vl"


def test_a_config_that_is_not_json_or_not_an_object_or_of_no_known_type_is_named(model_copy):
    config = model_copy / "config.json"
    text = config.read_text()
    config.write_text("{bad")
    assert refusal(model_copy).startswith(f"model.path '{model_copy}': config.json is not valid JSON (")
    config.write_text("[1, 2]")
    assert refusal(model_copy) == (
        f"model.path '{model_copy}': config.json holds a JSON list, not the model's configuration (an object "
        "with its model_type); restore the checkpoint's file"
    )
    config.write_text(json.dumps({**json.loads(text), "model_type": "no_such_model"}))
    assert refusal(model_copy).startswith(
        f"model.path '{model_copy}': transformers cannot read config.json: "
    )


def test_weights_absent_truncated_or_foreign_are_named_before_any_load(model_copy):
    weights = model_copy / "model.safetensors"
    whole = weights.read_bytes()
    weights.write_bytes(whole[: len(whole) // 2])
    assert refusal(model_copy).startswith(
        f"model.path '{model_copy}': model.safetensors is not a whole safetensors file ("
    )
    weights.write_bytes(b"PK\x03\x04 a zip file, as torch.save writes")
    assert "model.safetensors is not a whole safetensors file" in refusal(model_copy)
    weights.unlink()
    assert refusal(model_copy) == (
        f"model.path '{model_copy}' has no .safetensors weights; convert the checkpoint to safetensors"
    )


def test_an_index_naming_a_shard_the_folder_lacks_is_refused(model_copy):
    (model_copy / "model.safetensors").rename(model_copy / "model-00001-of-00002.safetensors")
    weight_map = {"a": "model-00001-of-00002.safetensors", "b": "model-00002-of-00002.safetensors"}
    (model_copy / "model.safetensors.index.json").write_text(json.dumps({"weight_map": weight_map}))
    assert refusal(model_copy) == (
        f"model.path '{model_copy}': model.safetensors.index.json names weight files the folder lacks: "
        "model-00002-of-00002.safetensors; copy the checkpoint again"
    )


def test_a_folder_without_its_tokenizer_files_is_refused(model_copy):
    (model_copy / "tokenizer.json").unlink()  # transformers then loads the special tokens alone
    message = refusal(model_copy)
    assert message.startswith(f"model.path '{model_copy}' has no usable tokenizer (the one loaded from it")
    assert message.endswith(
        "copy the checkpoint's tokenizer files (tokenizer.json, tokenizer_config.json) into it"
    )


def test_a_run_given_the_model_loaded_reads_neither_weights_nor_tokenizer(model_copy):
    (model_copy / "model.safetensors").unlink()  # a model built on its device has no weight files
    (model_copy / "tokenizer.json").unlink()
    assert check_model_folder(str(model_copy), loaded=True).model_type == "qwen2_vl"
    assert "has no .safetensors weights" in refusal(model_copy)
