"""A bundled model exported for transformers (`litevlm convert --to hf drive-tiny OUT`) is what transformers itself
saves for an InternVL model and its processor, and transformers' user path answers on it as litevlm does.

The user's path: `AutoProcessor.from_pretrained(export)`, `apply_chat_template` on the structured message (per view
a text item "CAM_X: " and the camera's image, then the question) with `tokenize=True`, which renders the prompt,
expands each image into `<img>` + `<IMG_CONTEXT>` x tokens + `</img>` and cuts the pixel tiles; then
`AutoModelForImageTextToText.from_pretrained(export).generate(...)`, greedy. Its prompt text, ids and pixel tiles
equal litevlm's, and its answer equals litevlm's token for token.

transformers loads InternVL's processor only with its video processor, which needs torchvision; without torchvision
the same processor class is opened from the same files without the video processor (`ImagesOnly`), and its image
processor is the PIL one (PIL's bicubic resize, which litevlm's `resample="pil"` reproduces byte for byte); with
torchvision, AutoProcessor itself, whose torch resize litevlm's default resize reproduces.
"""

from __future__ import annotations

import importlib.util
import json
import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402

from litevlm.cameras import CAMERAS  # noqa: E402
from litevlm.cli import main  # noqa: E402
from litevlm.data.synthetic import make_frame, render_views  # noqa: E402
from litevlm.model.hf import (  # noqa: E402
    IMAGE_TOKEN_NAMES,
    chat_template_for,
    hf_to_litevlm,
    litevlm_to_hf,
    processor_tiling_note,
)
from litevlm.model.prompt import PromptFormat, Tiling  # noqa: E402
from litevlm.models import WEIGHTS_DIR  # noqa: E402
from litevlm.pipeline import Pipeline  # noqa: E402

# litevlm.model.images silences this at import; pytest's per-test warning filters forget that
pytestmark = pytest.mark.filterwarnings("ignore:The given NumPy array is not writable")
HAS_TORCHVISION = importlib.util.find_spec("torchvision") is not None
RESAMPLE = "fast" if HAS_TORCHVISION else "pil"  # litevlm's resize that makes the processor's bytes
# The same uint8 tiles scaled and normalised in fp32 (litevlm) and in numpy or torch (transformers): a few fp32
# roundings apart, ~1e-7; a one-level difference in a single pixel byte would already be 1/255/0.225 ~ 0.017.
PIXEL_ATOL = 1e-5
NEW_TOKENS = 24
SUBSET = ["CAM_FRONT_LEFT", "CAM_BACK"]


class ImagesOnly(transformers.InternVLProcessor):
    """InternVLProcessor without its video processor (which needs torchvision), opened from the export's files."""

    def __init__(self, image_processor=None, tokenizer=None, image_seq_length: int = 256, chat_template=None, **kw):
        super().__init__(image_processor, tokenizer, None, image_seq_length, chat_template, **kw)


def open_processor(path):
    return transformers.AutoProcessor.from_pretrained(path) if HAS_TORCHVISION else ImagesOnly.from_pretrained(path)


@pytest.fixture(scope="module")
def export(tmp_path_factory):
    """drive-tiny converted by the command line, by its bundled name."""
    out = tmp_path_factory.mktemp("export") / "drive-tiny-hf"
    assert main(["convert", "--to", "hf", "drive-tiny", str(out)]) == 0
    return out


@pytest.fixture(scope="module")
def processor(export):
    return open_processor(export)


@pytest.fixture(scope="module")
def pipe():
    return Pipeline.from_pretrained("drive-tiny", resample=RESAMPLE, max_new_tokens=NEW_TOKENS)


@pytest.fixture(scope="module")
def scenes():
    """Two frames the model never saw, at the renderer's camera size (16:9, as nuScenes)."""
    frames = [make_frame(7, 0), make_frame(11, 3)]
    return [(f, render_views(f, size=(400, 225))) for f in frames]


def messages(question: str, images: dict, views: list[str]) -> list[dict]:
    """The user's message: per view its camera label and its image, then the question."""
    content = [x for c in views for x in ({"type": "text", "text": f"{c}: "}, {"type": "image", "image": images[c]})]
    return [{"role": "user", "content": [*content, {"type": "text", "text": question}]}]


def transformers_inputs(processor, question: str, images: dict, views: list[str]):
    return processor.apply_chat_template(
        messages(question, images, views),
        add_generation_prompt=True,
        tokenize=True,
        return_dict=True,
        return_tensors="pt",
    )


def _names(path) -> set[str]:
    with safe_open(str(path), framework="pt") as f:
        return set(f.keys())


def test_convert_takes_a_bundled_models_name(export, tmp_path, capsys):
    assert (export / "model.safetensors").is_file()
    assert main(["convert", "--to", "hf", "drive-huge", str(tmp_path / "x")]) == 2
    err = capsys.readouterr().err
    assert "no model at 'drive-huge'" in err and "drive-tiny" in err
    assert main(["convert", "--to", "litevlm", "drive-tiny", str(tmp_path / "y")]) == 2
    assert "litevlm checkpoint already" in capsys.readouterr().err
    assert not (tmp_path / "x").exists() and not (tmp_path / "y").exists()


@torch.no_grad()
def test_the_export_is_laid_out_as_transformers_saves_it(export, processor, tmp_path):
    model, info = transformers.AutoModelForImageTextToText.from_pretrained(export, output_loading_info=True)
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    model.save_pretrained(tmp_path / "resaved")
    processor.save_pretrained(tmp_path / "resaved")
    theirs = tmp_path / "resaved"
    # the same tensor names (transformers 5 writes the legacy family: vision_tower., language_model.model., ...)
    assert _names(export / "model.safetensors") == _names(theirs / "model.safetensors")
    ours_cfg, their_cfg = (json.loads((d / "config.json").read_text()) for d in (export, theirs))
    for cfg in (ours_cfg, their_cfg):  # architectures at the top only, as transformers writes them
        assert cfg["architectures"] == ["InternVLForConditionalGeneration"]
        assert "architectures" not in cfg["text_config"] and "architectures" not in cfg["vision_config"]
    # the processor transformers saves again is the one exported: the same image processor and tokens a tile
    ours_proc, their_proc = (json.loads((d / "processor_config.json").read_text()) for d in (export, theirs))
    assert ours_proc["image_processor"] == their_proc["image_processor"]
    assert ours_proc["image_seq_length"] == their_proc["image_seq_length"] == 16  # drive-tiny: 16 tokens a tile
    assert (theirs / "chat_template.jinja").read_text() == (export / "chat_template.jinja").read_text()
    tokenizer_config = json.loads((export / "tokenizer_config.json").read_text())
    assert tokenizer_config["extra_special_tokens"] == IMAGE_TOKEN_NAMES


@torch.no_grad()
def test_the_processor_builds_litevlms_prompt_and_tiles(processor, pipe, scenes):
    for frame, images in scenes:
        for qa in frame.qas[:3]:
            for views in (list(CAMERAS), SUBSET):
                text = processor.apply_chat_template(
                    messages(qa.question, images, views), add_generation_prompt=True, tokenize=False
                )
                assert text == pipe.format.render(qa.question, views)
                inputs = transformers_inputs(processor, qa.question, images, views)
                tiles, counts = pipe.tiles(images, views)
                prompt = pipe.embed_prompt(qa.question, views, pipe.model.encode_tiles(tiles), counts)
                assert inputs["input_ids"].tolist() == prompt.ids.tolist()
                assert inputs["pixel_values"].shape == tiles.shape == (len(views), 3, 112, 112)
                assert torch.allclose(inputs["pixel_values"].float(), tiles, rtol=0, atol=PIXEL_ATOL)


def asked(frame) -> list:
    """Three of a frame's questions: two closed ones and an open one with a short answer (transformers' generate
    takes a tenth of a second a token on a loaded CPU)."""
    closed = [qa for qa in frame.qas if qa.closed][:2]
    return closed + [next(qa for qa in frame.qas if not qa.closed and len(qa.answer) < 80)]


@torch.no_grad()
def test_generate_answers_as_litevlm_does_token_for_token(export, processor, pipe, scenes):
    model = transformers.AutoModelForImageTextToText.from_pretrained(export).eval()
    eos = json.loads((export / "generation_config.json").read_text())["eos_token_id"]
    ended = 0
    for (frame, images), questions in zip(scenes, (asked(scenes[0][0]), asked(scenes[1][0])[-1:])):
        for qa in questions:
            inputs = transformers_inputs(processor, qa.question, images, list(CAMERAS))
            out = model.generate(**inputs, do_sample=False, max_new_tokens=NEW_TOKENS)
            expected = out[0, inputs["input_ids"].shape[1] :].tolist()
            answer = pipe.answer(qa.question, images)
            assert answer.input_tokens == inputs["input_ids"].shape[1]
            assert answer.tokens == expected, qa.question
            ended += expected[-1] == eos
    assert ended >= 3  # answers that end within the budget, compared whole


def test_auto_processor_opens_the_export(export):
    pytest.importorskip("torchvision")  # transformers loads InternVL's processor only with its video processor
    processor = transformers.AutoProcessor.from_pretrained(export)
    assert type(processor).__name__ == "InternVLProcessor" and processor.image_seq_length == 16


@torch.no_grad()
def test_a_tiling_the_processor_cannot_cut_is_named_and_the_model_still_answers(scenes, tmp_path):
    """drive-hd cuts each view into two tiles side by side without a thumbnail; transformers' image processor adds
    one, so the conversion says so, and with litevlm's tiles fed to it transformers answers as litevlm does."""
    with pytest.warns(UserWarning, match="thumbnail"):
        litevlm_to_hf(WEIGHTS_DIR / "drive-hd", tmp_path / "hd")
    processor = json.loads((tmp_path / "hd" / "processor_config.json").read_text())
    assert processor["image_processor"]["min_patches"] == processor["image_processor"]["max_patches"] == 2
    assert processor["image_seq_length"] == 64
    assert (tmp_path / "hd" / "prompt.json").is_file()  # the prompt its modules were trained with, for litevlm
    model = transformers.AutoModelForImageTextToText.from_pretrained(tmp_path / "hd").eval()
    pipe = Pipeline.from_pretrained("drive-hd", max_new_tokens=NEW_TOKENS)
    frame, images = scenes[0]
    question = asked(frame)[0].question
    prompt = pipe.prompt(question, images)
    tiles, counts = pipe.tiles(images, prompt.views)
    assert counts == [128] * len(CAMERAS)
    out = model.generate(input_ids=prompt.ids, pixel_values=tiles, do_sample=False, max_new_tokens=NEW_TOKENS)
    assert out[0, prompt.ids.shape[1] :].tolist() == pipe.answer(question, images).tokens


@pytest.mark.parametrize(
    "tiling, exact",
    [
        (Tiling(), True),
        (Tiling(max_tiles=12, thumbnail=True), True),
        (Tiling(tiles=2, thumbnail=True), True),  # 2 x 1 for any landscape view
        (Tiling(tiles=2), False),
        (Tiling(max_tiles=6), False),
        (Tiling(tiles=4, thumbnail=True), False),  # a 16:9 view: transformers picks 2 x 2
    ],
)
def test_processor_tiling_note(tiling, exact):
    assert (processor_tiling_note(tiling) is None) == exact


def test_a_system_message_becomes_the_templates_default(export):
    """A prompt format with a system message: the exported template writes it where the conversation brings none,
    as litevlm does, quotes and line breaks included."""
    fmt = PromptFormat(system="Answer as a driver would.\nSay 'no' when unsure.")
    tokenizer = transformers.AutoTokenizer.from_pretrained(export)
    content = [{"type": "text", "text": "CAM_BACK: "}, {"type": "image"}, {"type": "text", "text": "Anything behind?"}]
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": content}],
        chat_template=chat_template_for(fmt),
        add_generation_prompt=True,
        tokenize=False,
    )
    assert text == fmt.render("Anything behind?", ["CAM_BACK"])
    assert text.startswith("<|im_start|>system\nAnswer as a driver would.\nSay 'no' when unsure.<|im_end|>\n")


def test_a_users_checkpoint_keeps_its_chat_template_through_both_conversions(tiny_hf_checkpoint, tmp_path):
    """A user's transformers checkpoint (its own template in tokenizer_config.json) converted to litevlm and back:
    the template is theirs, now in chat_template.jinja, and the tokenizer names InternVL's image tokens."""
    src = tmp_path / "user"
    shutil.copytree(tiny_hf_checkpoint, src)
    template = json.loads((src / "tokenizer_config.json").read_text())["chat_template"]
    hf_to_litevlm(src, tmp_path / "ours")
    litevlm_to_hf(tmp_path / "ours", tmp_path / "back")
    assert (tmp_path / "back" / "chat_template.jinja").read_text() == template
    tokenizer_config = json.loads((tmp_path / "back" / "tokenizer_config.json").read_text())
    assert "chat_template" not in tokenizer_config
    assert tokenizer_config["extra_special_tokens"] == IMAGE_TOKEN_NAMES
    processor = ImagesOnly.from_pretrained(tmp_path / "back")
    assert processor.image_seq_length == 4 and processor.chat_template == template
