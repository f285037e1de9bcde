"""The prompt format: drive-tiny's layout through the template path, tiling, saved formats, and the scene split."""

import random

import numpy as np
import pytest
from PIL import Image

from litevlm.cameras import CAMERAS
from litevlm.data.drivelm import Sample
from litevlm.data.source import scene_split
from litevlm.data.synthetic import question_corpus
from litevlm.data.tokenizer import Tokenizer
from litevlm.errors import LiteVLMError
from litevlm.model.prompt import PromptFormat, Tiling, build_prompt, closest_grid, read_format
from litevlm.models import WEIGHTS_DIR
from litevlm.train.vlm import pack_frame


@pytest.fixture(scope="module")
def tok():
    return Tokenizer.from_dir(WEIGHTS_DIR / "drive-tiny")


def test_the_default_format_is_the_layout_drive_tiny_was_trained_on(tok):
    """Rendering ChatML and tokenising the whole text gives, for every question, the ids of drive-tiny's training
    layout (the prefix and question block that `pack_frame` writes piece by piece)."""
    rng = random.Random(0)
    for q in list(question_corpus(n_frames=60, seed=3))[:600]:
        views = [c for c in CAMERAS if rng.random() < 0.6] or ["CAM_BACK"]
        ids, _, _, _ = pack_frame(tok, views, 16, [(tok.encode(q), [])])
        layout = build_prompt(tok, q, views, 16)
        assert layout.ids == ids[:-1]  # pack_frame ends the block with the answer's EOS
        assert [c for c, _, _ in layout.view_spans] == views
        for _, a, b in layout.view_spans:
            assert layout.ids[a - 1] == tok.img_start_id and layout.ids[b] == tok.img_end_id
            assert set(layout.ids[a:b]) == {tok.image_id}


def test_a_chat_template_with_a_system_turn_and_labels(tok):
    template = (
        "{% if messages[0]['role'] != 'system' %}<|im_start|>system\nBe brief.<|im_end|>\n{% endif %}"
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    fmt = PromptFormat(chat_template=template, camera_label="Image-{index} ({camera}): ")
    text = fmt.render("Is it red?", ["CAM_FRONT", "CAM_BACK"])
    assert text == (
        "<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nImage-1 (CAM_FRONT): <IMG_CONTEXT>\n"
        "Image-2 (CAM_BACK): <IMG_CONTEXT>\nIs it red?<|im_end|>\n<|im_start|>assistant\n"
    )
    own = PromptFormat(chat_template=template, system="Drive.").render("Is it red?", [])
    assert own.startswith("<|im_start|>system\nDrive.<|im_end|>\n<|im_start|>user\nIs it red?")
    layout = fmt.build(tok, "Is it red?", ["CAM_FRONT", "CAM_BACK"], [4, 8])
    assert [(c, b - a) for c, a, b in layout.view_spans] == [("CAM_FRONT", 4), ("CAM_BACK", 8)]


def test_a_prompt_is_the_tokenization_of_its_fully_written_text(tok):
    """`build` tokenizes one placeholder per image and widens it: the ids are those of the text with every placeholder
    written out, for any counts, labels and system turn."""
    from litevlm.model.prompt import IMAGE_MARK

    rng = random.Random(1)
    formats = [PromptFormat(), PromptFormat(system="Drive.", camera_label="Image-{index} ({camera}): ")]
    for q in list(question_corpus(n_frames=20, seed=5))[:120]:
        fmt = rng.choice(formats)
        views = [c for c in CAMERAS if rng.random() < 0.5] or ["CAM_FRONT"]
        counts = [rng.choice([1, 16, 64, 257]) for _ in views]
        pieces = fmt.render(q, views).split(IMAGE_MARK)
        text = pieces[0] + "".join(f"<img>{IMAGE_MARK * n}</img>" + p for n, p in zip(counts, pieces[1:]))
        layout = fmt.build(tok, q, views, counts)
        assert layout.ids == tok.encode(text)
        assert [(c, b - a) for c, a, b in layout.view_spans] == list(zip(views, counts))


def test_a_chat_template_without_a_user_turn_is_refused(tok):
    fmt = PromptFormat(chat_template="<|im_start|>assistant\n")
    with pytest.raises(LiteVLMError, match="no user turn"):
        fmt.build(tok, "Is it red?", ["CAM_FRONT"], 4)
    with pytest.raises(LiteVLMError, match="does not parse"):
        PromptFormat(chat_template="{% for m in messages %}").render("q", [])
    with pytest.raises(LiteVLMError, match="camera label"):
        PromptFormat(camera_label="{view}: ")


def test_fixed_tiling_cuts_left_to_right_and_dynamic_tiling_follows_internvl():
    img = Image.fromarray(np.arange(32 * 64 * 3, dtype=np.uint8).reshape(32, 64, 3) % 251)
    two = Tiling(tiles=2).cut(img, 32)
    assert two.shape == (2, 3, 32, 32)
    assert np.array_equal(two[1], np.asarray(img)[:, 32:].transpose(2, 0, 1))
    # InternVL's grid choices (its model card's dynamic_preprocess, max 12): a nuScenes frame is 4x2, a square 1x1
    assert closest_grid(1600, 900, 448, 12) == (4, 2)
    assert closest_grid(448, 448, 448, 12) == (1, 1)
    assert closest_grid(1344, 896, 448, 12) == (3, 2)
    dyn = Tiling(max_tiles=12, thumbnail=True)
    assert dyn.count(1600, 900, 448) == 9 and dyn.most() == 13
    assert dyn.cut(img, 32).shape == (2 + 1, 3, 32, 32)  # a 2x1 grid + the thumbnail
    assert dyn.cut(img, 16).shape == (8 + 1, 3, 16, 16)  # a tie goes to the larger grid when the image fills it


def test_a_saved_format_is_read_back(tmp_path):
    fmt = PromptFormat(chat_template="{{ messages }}", system="s", camera_label="{camera}:", tiling=Tiling(2, 0, True))
    fmt.save(tmp_path)
    assert read_format(tmp_path) == fmt


def _samples(scenes):
    return [Sample(f"{s}_f_{i}", "q", "a", "", 0, True, (), {}, "f", {}, s) for s in scenes for i in range(3)]


def test_the_scene_split_holds_whole_scenes_out_by_seed_not_by_order():
    samples = _samples([f"scene{i}" for i in range(20)])
    kept, held = scene_split(samples, 0.2, seed=7)
    assert {s.scene_id for s in kept}.isdisjoint({s.scene_id for s in held})
    assert len({s.scene_id for s in held}) == 4 and len(kept) + len(held) == len(samples)
    again = scene_split(list(reversed(samples)), 0.2, seed=7)[1]
    assert {s.scene_id for s in again} == {s.scene_id for s in held}
    assert {s.scene_id for s in scene_split(samples, 0.2, seed=8)[1]} != {s.scene_id for s in held}
    assert len({s.scene_id for s in scene_split(_samples(["a", "b"]), 0.01)[1]}) == 1  # at least one, never all
    assert scene_split(_samples(["a"]), 0.5)[1] == []


def test_a_checkpoint_exported_by_save_hf_loads_as_a_transformers_one(tiny_model_dir, tmp_path):
    """save_hf keeps our special ids in config.json under "litevlm"; that must not make it look like our format."""
    from litevlm.model.hf import load_native, save_hf
    from litevlm.models import load_model

    native = load_native(tiny_model_dir)
    save_hf(native, tmp_path / "hf", Tokenizer.from_dir(tiny_model_dir))
    loaded = load_model(tmp_path / "hf")
    assert loaded.model.cfg.text == native.cfg.text and loaded.format == read_format(tiny_model_dir)
