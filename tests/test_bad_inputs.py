"""A user's bad input gets one clear LiteVLMError naming the problem, and nothing is written half-way: missing images
in a DriveLM JSON, an unknown camera in its image_paths, a checkpoint without a tokenizer or with one that does not
fit it, a chat template without a user turn, a question holding the prompt's image token."""

from __future__ import annotations

import hashlib
import json
import shutil
from pathlib import Path

import pytest

from litevlm.cli import main
from litevlm.data.source import load_data
from litevlm.errors import LiteVLMError
from litevlm.pipeline import Pipeline

# A transformers checkpoint without tokenizer files makes load_hf warn before the tokenizer check refuses it.
pytestmark = pytest.mark.filterwarnings("ignore:the checkpoint names no")


def snapshot(folder: Path) -> dict[str, str]:
    """Every file under `folder` -> the sha256 of its bytes: two snapshots are equal iff nothing was written."""
    return {
        str(f.relative_to(folder)): hashlib.sha256(f.read_bytes()).hexdigest() for f in folder.rglob("*") if f.is_file()
    }


@pytest.fixture
def data(tiny_drivelm, tmp_path) -> Path:
    """A copy of the small DriveLM set that a test may break; returns its JSON's path."""
    shutil.copytree(tiny_drivelm.parent, tmp_path / "data")
    return tmp_path / "data" / "drivelm.json"


@pytest.fixture
def checkpoint(tiny_hf_checkpoint, tmp_path) -> Path:
    """A copy of the user's transformers checkpoint that a test may break."""
    d = tmp_path / "InternVL-tiny-hf"
    shutil.copytree(tiny_hf_checkpoint, d)
    return d


def edit_json(path: Path, change) -> None:
    d = json.loads(path.read_text())
    change(d)
    path.write_text(json.dumps(d))


def first_frame(d: dict) -> dict:
    scene = next(iter(d.values()))
    return next(iter(scene["key_frames"].values()))


# -- the data ---------------------------------------------------------------------------------------------------
def test_missing_images_are_named_before_anything_runs(data, tmp_path, tiny_hf_checkpoint, capsys):
    shutil.rmtree(data.parent / "images" / "CAM_BACK")
    n_frames = len(list((data.parent / "images" / "CAM_FRONT").iterdir()))
    with pytest.raises(
        LiteVLMError, match=rf"{n_frames} of the {6 * n_frames} images .* are missing.*CAM_BACK.*--images"
    ):
        load_data(data)

    records, predictions = tmp_path / "records.json", tmp_path / "predictions.json"
    argv = ["eval", "--model", str(tiny_hf_checkpoint), "--data", str(data), "--max-new-tokens", "4"]
    assert main([*argv, "--records", str(records), "--predictions-out", str(predictions)]) == 2
    err = capsys.readouterr().err
    assert "error: image file not found" in err and "CAM_BACK" in err
    assert not records.exists() and not predictions.exists()


def test_an_unknown_camera_in_image_paths_is_named(data, tiny_hf_checkpoint, capsys):
    def rename(d):
        paths = first_frame(d)["image_paths"]
        paths["CAM_TOP"] = paths.pop("CAM_FRONT")

    edit_json(data, rename)
    with pytest.raises(LiteVLMError, match=r"unknown camera 'CAM_TOP'; expected one of CAM_FRONT"):
        load_data(data)
    assert main(["eval", "--model", str(tiny_hf_checkpoint), "--data", str(data), "--max-new-tokens", "4"]) == 2
    assert "unknown camera 'CAM_TOP'" in capsys.readouterr().err


# -- the checkpoint ---------------------------------------------------------------------------------------------
def test_a_checkpoint_without_a_tokenizer_is_refused(checkpoint):
    (checkpoint / "tokenizer.json").unlink()
    (checkpoint / "tokenizer_config.json").unlink()
    before = snapshot(checkpoint)
    with pytest.raises(LiteVLMError, match=r"has no tokenizer \(tokenizer.json"):
        Pipeline.from_pretrained(checkpoint)
    assert snapshot(checkpoint) == before


def test_a_tokenizer_bigger_than_the_embedding_is_refused(checkpoint):
    from tokenizers import Tokenizer as RawTokenizer

    raw = RawTokenizer.from_file(str(checkpoint / "tokenizer.json"))
    raw.add_tokens([f"<extra_{i}>" for i in range(8)])
    raw.save(str(checkpoint / "tokenizer.json"))
    rows = json.loads((checkpoint / "config.json").read_text())["text_config"]["vocab_size"]
    before = snapshot(checkpoint)
    with pytest.raises(
        LiteVLMError, match=rf"has {raw.get_vocab_size()} tokens but the model's embedding has {rows} rows"
    ):
        Pipeline.from_pretrained(checkpoint)
    assert snapshot(checkpoint) == before


def test_a_tokenizer_with_other_image_token_ids_is_refused(checkpoint, tiny_model_dir, tmp_path):
    # a transformers checkpoint whose config names another <IMG_CONTEXT> id than its tokenizer's
    edit_json(checkpoint / "config.json", lambda d: d.update(image_token_id=d["image_token_id"] + 1))
    before = snapshot(checkpoint)
    with pytest.raises(LiteVLMError, match=r"does not fit the checkpoint: <IMG_CONTEXT> is 5 in the tokenizer but 6"):
        Pipeline.from_pretrained(checkpoint)
    assert snapshot(checkpoint) == before

    # one of ours whose config names another <img> id than its tokenizer's
    ours = tmp_path / "ours"
    shutil.copytree(tiny_model_dir, ours)
    edit_json(ours / "config.json", lambda d: d["litevlm"].update(img_start_id=d["litevlm"]["img_start_id"] + 4))
    before = snapshot(ours)
    with pytest.raises(LiteVLMError, match=r"<img> is 3 in the tokenizer but 7 in the model's config"):
        Pipeline.from_pretrained(ours)
    assert snapshot(ours) == before


def test_a_chat_template_without_a_user_turn_is_refused(checkpoint):
    # writes the system turn and the assistant's opening, never the user's message
    template = (
        "<|im_start|>system\nDrive safely.<|im_end|>\n{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    edit_json(checkpoint / "tokenizer_config.json", lambda d: d.update(chat_template=template))
    before = snapshot(checkpoint)
    with pytest.raises(LiteVLMError, match=r"does not write the user's message into the prompt \(no user turn\?\)"):
        Pipeline.from_pretrained(checkpoint)
    assert snapshot(checkpoint) == before


# -- the question -----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("mark", ["<IMG_CONTEXT>", "<img>"])
def test_a_question_holding_the_image_token_is_refused(tiny_hf_checkpoint, tiny_drivelm, mark):
    sample = load_data(tiny_drivelm)[0]
    pipe = Pipeline.from_pretrained(tiny_hf_checkpoint, max_new_tokens=4)
    with pytest.raises(LiteVLMError, match=rf"the question contains the prompt's special token\(s\) {mark}"):
        pipe.answer(f"What is in {mark} this view?", sample.images)
    assert pipe.answer(sample.question, sample.images).tokens  # the pipeline still answers the next question
