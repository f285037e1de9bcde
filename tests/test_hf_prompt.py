"""The prompt is the checkpoint's own: on a transformers InternVL checkpoint with its own tokenizer and chat template,
the pipeline's prompt ids and tiles equal what transformers builds, and its greedy answer equals `generate`'s.

transformers' side is the user's: `AutoTokenizer.apply_chat_template` on the structured message (per view a text item
"CAM_X: " and an image item, then the question), then `InternVLProcessor` with InternVL's image processor
(GotOcr2ImageProcessorPil) configured to the same tiling, which expands each image into `<img>` + `<IMG_CONTEXT>` x
(image_seq_length x tiles) + `</img>` and cuts the pixel tiles. Three tilings: one fixed tile per view, two per view
(the paper's layout) and InternVL's dynamic tiling with a thumbnail.
"""

from __future__ import annotations

import shutil

import pytest
import torch

transformers = pytest.importorskip("transformers")

from conftest import user_model_script  # noqa: E402
from transformers.models.got_ocr2.image_processing_pil_got_ocr2 import GotOcr2ImageProcessorPil  # noqa: E402

from litevlm.cameras import CAMERAS  # noqa: E402
from litevlm.data.drivelm import load_images  # noqa: E402
from litevlm.data.source import load_data  # noqa: E402
from litevlm.model.vlm import IMAGENET_MEAN, IMAGENET_STD  # noqa: E402
from litevlm.models import load_model  # noqa: E402
from litevlm.pipeline import Pipeline  # noqa: E402
from litevlm.spec.draft import DraftConfig, DraftHead  # noqa: E402
from litevlm.train.draft import Sequence, collate, draft_loss, greedy_batch  # noqa: E402

USER = user_model_script()  # the tiny checkpoint's settings (benchmarks/tiny_user_model.py)
NEW_TOKENS = 24
CONTEXT = 32  # the draft head's window over the prompt
SUBSET = ["CAM_FRONT_LEFT", "CAM_BACK"]
# Both sides resize the same uint8 image with PIL's bicubic filter to the same sizes, so the tiles hold the same
# bytes; they then scale by 1/255 and normalise with the ImageNet mean and std, we in fp32 and transformers in
# numpy's float arithmetic. Values reach |x| ~ 2.7: a few fp32 roundings apart, ~1e-6; 1e-5 leaves room, while a
# one-level difference in a single pixel byte would already be 1/255/0.225 ~ 0.017.
PIXEL_ATOL = 1e-5
# The pipeline's default resize (torch's antialiased bicubic on uint8) is PIL's filter within one level of a byte.
FAST_ATOL = 1 / 255 / min(IMAGENET_STD) + PIXEL_ATOL


class NoThumbnail(GotOcr2ImageProcessorPil):
    """InternVL's image processor cutting the grid without the thumbnail tile (the processor always adds one)."""

    def crop_image_to_patches(self, *args, use_thumbnail=True, **kwargs):
        return super().crop_image_to_patches(*args, use_thumbnail=False, **kwargs)


class ImageProcessor(transformers.InternVLProcessor):
    """InternVLProcessor for images only: its video processor needs torchvision, which images do not."""

    def __init__(self, image_processor=None, tokenizer=None, image_seq_length: int = 256, chat_template=None):
        super().__init__(image_processor, tokenizer, None, image_seq_length, chat_template)


# name -> (the pipeline's tiling options, the image processor class and its settings). Fixed two tiles per view is
# a crop into a grid of exactly two tiles: for a landscape camera image (all of nuScenes') that grid is 2 x 1.
TILINGS = {
    "one-tile": (dict(), GotOcr2ImageProcessorPil, dict(crop_to_patches=False)),
    "two-tiles": (dict(tiles=2), NoThumbnail, dict(crop_to_patches=True, min_patches=2, max_patches=2)),
    "dynamic-thumbnail": (
        dict(max_tiles=12, thumbnail=True),
        GotOcr2ImageProcessorPil,
        dict(crop_to_patches=True, min_patches=1, max_patches=12),
    ),
    "two-tiles-thumbnail": (
        dict(tiles=2, thumbnail=True),
        GotOcr2ImageProcessorPil,
        dict(crop_to_patches=True, min_patches=2, max_patches=2),
    ),
    "dynamic": (dict(max_tiles=6), NoThumbnail, dict(crop_to_patches=True, min_patches=1, max_patches=6)),
}
# Visual tokens a 160 x 90 view makes (4 a tile): up to 12 tiles, 4 x 2 ties with 2 x 1 in aspect ratio and wins as
# the view covers more than half of it; up to 6, 2 x 1 is closest.
TOKENS_PER_VIEW = {"one-tile": 4, "two-tiles": 8, "dynamic-thumbnail": 36, "two-tiles-thumbnail": 12, "dynamic": 8}
GENERATED = ["one-tile", "two-tiles", "dynamic-thumbnail"]  # the tilings answers are generated in


@pytest.fixture(scope="module")
def samples(tiny_drivelm):
    """Three questions of the user's data: with a c-tag, a closed one and another, from different frames."""
    data = load_data(tiny_drivelm)
    tagged = next(s for s in data if "<c" in s.question)
    closed = next(s for s in data if s.closed and s.frame_id != tagged.frame_id)
    other = next(s for s in data if s.frame_id not in (tagged.frame_id, closed.frame_id))
    return [tagged, closed, other]


def fitted_draft(loaded, samples, steps: int = 120) -> DraftHead:
    """A draft head fitted in seconds to the target's own greedy answers to `samples` in every tiling (the recipe's
    loss; a window over the prompt's last pairs, as the recipe's heads have), so that speculative decoding accepts
    drafted tokens as well as rejecting them."""
    model, seqs = loaded.model, []
    with torch.no_grad():
        for options, _, _ in (TILINGS[t] for t in GENERATED):
            pipe = Pipeline(model, loaded.tokenizer, prompt_format=loaded.format.with_overrides(**options))
            for s in samples:
                embeds = pipe.prompt(s.question, load_images(s)).embeds[0]  # (T, C)
                ((answer, features),) = greedy_batch(model, [embeds], NEW_TOKENS, loaded.tokenizer.eos_id)
                answer_embeds = model.language_model.embed_tokens(torch.tensor(answer))
                seq = Sequence(torch.cat([embeds, answer_embeds]), features, embeds.shape[0], answer)
                seqs.append(seq.window(CONTEXT))
    torch.manual_seed(0)
    head = DraftHead(DraftConfig.for_target(model.cfg.text, context=CONTEXT), model).train()
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    batch = collate(seqs, "cpu")
    for _ in range(steps):
        loss, _ = draft_loss(head, batch)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
    return head.eval()


@pytest.fixture(scope="module")
def checkpoint(tiny_hf_checkpoint, samples, tmp_path_factory):
    """The user's checkpoint with a draft head in draft/ (any head keeps greedy speculative decoding lossless: the
    target verifies every token; a fitted one also gets drafts accepted)."""
    d = tmp_path_factory.mktemp("hf-prompt") / "InternVL-tiny-hf"
    shutil.copytree(tiny_hf_checkpoint, d)
    loaded = load_model(d)
    loaded.model.requires_grad_(False)
    fitted_draft(loaded, samples).save(d / "draft")
    return d


@pytest.fixture(scope="module")
def hf_model(checkpoint):
    return transformers.InternVLForConditionalGeneration.from_pretrained(checkpoint, attn_implementation="eager").eval()


def transformers_inputs(checkpoint, tiling: str, question: str, images: dict, views: list[str]):
    """input_ids (1, T) and pixel_values (tiles, 3, S, S) as transformers makes them for this question and these
    views: the tokenizer's chat template on the structured message, then InternVLProcessor's image expansion."""
    _, processor_class, settings = TILINGS[tiling]
    tokenizer = transformers.AutoTokenizer.from_pretrained(checkpoint)
    image_processor = processor_class(
        size={"height": USER.HF_IMAGE_SIZE, "width": USER.HF_IMAGE_SIZE},
        image_mean=list(IMAGENET_MEAN),
        image_std=list(IMAGENET_STD),
        **settings,
    )
    processor = ImageProcessor(image_processor, tokenizer, image_seq_length=USER.IMAGE_SEQ_LENGTH)
    content = [item for c in views for item in ({"type": "text", "text": f"{c}: "}, {"type": "image"})]
    messages = [{"role": "user", "content": [*content, {"type": "text", "text": question}]}]
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
    system = f"<|im_start|>system\n{USER.HF_SYSTEM}<|im_end|>\n"
    assert text.startswith(f"{system}<|im_start|>user\n{views[0]}: <IMG_CONTEXT>\n")  # the template's default system
    out = processor(
        text=text, images=[images[c] for c in views], return_tensors="pt", **{"crop_to_patches": False, **settings}
    )
    return out["input_ids"], out["pixel_values"]


@pytest.mark.parametrize("tiling", list(TILINGS))
def test_prompt_ids_and_tiles_equal_transformers(checkpoint, samples, tiling):
    pipe = Pipeline.from_pretrained(checkpoint, resample="pil", **TILINGS[tiling][0])
    fast = Pipeline.from_pretrained(checkpoint, warmup=False, **TILINGS[tiling][0])
    for s in samples:
        images = load_images(s)
        for views in (list(CAMERAS), SUBSET):
            ids, pixels = transformers_inputs(checkpoint, tiling, s.question, images, views)
            tiles, counts = pipe.tiles(images, views)
            prompt = pipe.embed_prompt(s.question, views, pipe.model.encode_tiles(tiles), counts)
            assert prompt.ids.tolist() == ids.tolist()
            assert tiles.shape == pixels.shape
            assert torch.allclose(tiles, pixels.float(), rtol=0, atol=PIXEL_ATOL)
            assert torch.allclose(fast.tiles(images, views)[0], pixels.float(), rtol=0, atol=FAST_ATOL)
            # each view's span covers exactly its <IMG_CONTEXT> run between <img> and </img>
            assert counts == [TOKENS_PER_VIEW[tiling]] * len(views)
            for (cam, a, b), n in zip(prompt.view_spans, counts):
                assert b - a == n and set(ids[0, a:b].tolist()) == {pipe.tokenizer.image_id}


@pytest.mark.parametrize("tiling", GENERATED)
@pytest.mark.parametrize("speculative", [False, True], ids=["plain", "speculative"])
def test_greedy_answer_equals_transformers_generate(checkpoint, hf_model, samples, tiling, speculative):
    pipe = Pipeline.from_pretrained(
        checkpoint, max_new_tokens=NEW_TOKENS, speculative=speculative, resample="pil", **TILINGS[tiling][0]
    )
    accepted = []
    for s in samples:
        images = load_images(s)
        ids, pixels = transformers_inputs(checkpoint, tiling, s.question, images, list(CAMERAS))
        with torch.no_grad():
            out = hf_model.generate(
                input_ids=ids,
                pixel_values=pixels,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=NEW_TOKENS,
            )
        expected = out[0, ids.shape[1] :].tolist()
        answer = pipe.answer(s.question, images)
        assert answer.input_tokens == ids.shape[1]
        assert len(set(expected)) >= 6  # a varied answer, not one token repeated
        assert answer.tokens == expected
        accepted += answer.accept_lengths
    if speculative:  # drafted tokens were accepted: more than one token committed by some target pass
        assert max(accepted) > 1
