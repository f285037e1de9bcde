"""Training recipe for the VLM itself: an InternVL-architecture model from scratch on synthetic frames.

Frames come from `litevlm.data.synthetic` (seeded, never repeated across splits). A frame's views
are encoded once per step and several of its questions are trained on them: the frame's prompt
prefix (user turn with the view blocks) is followed by K question/answer blocks packed into one
sequence, each block attending to the prefix and to itself only, with positions restarting after
the prefix, which is exactly what K separate prompts would compute, at a fraction of the cost.
A share `view_subset_prob` of the frames keeps only the views one anchor question needs (plus each
other view with probability 0.15) and trains only the questions those views answer, so the model
learns to answer from a selected subset of views, each with its camera marker, as the pipeline's
view selection later feeds it.

A from-scratch VLM learns the language of its answers long before it learns to read its images:
trained on answers alone, drive-tiny's decoder settled on priors and its visual tokens carried
nothing it used (the same answers with empty roads). So the visual tokens get their own dense
objective from the scene's 2D boxes, as detection pre-training gives a real ViT: a probe on every
visual token (the projector's output, what the decoder reads) predicts what its cell holds
(class, colour, moving, vehicle motion, light state, sign kind) by the token's cosine with the
decoder's own embeddings of those words, and one on the front view predicts the ego car's
steering. Visual tokens are kept near text-embedding scale (`visual_norm`). The probe heads are
training-only and never saved. A first `vision_warmup` steps train the vision side on that objective
alone; a probe on validation frames (seed + 2) reports closed-question accuracy with the real images
and with empty roads at every checkpoint (all six views, and only the views each question needs), so
a run that stops looking is seen while it trains.

Two settings decide whether the decoder learns to read at all (drive-tiny's model card traces them): the learning
rate (at 1e-3 and above a fresh decoder stays on the question-type prior even when handed the true
contents of every cell; at 3e-4 it reads them), and a stage where every frame shows only the views
its questions need (`view_subset_prob=1`): with 16 tokens per needed view instead of 96 the answer's
evidence is not drowned among the other cameras' tokens, and the gap between images and empty roads
opens there first.

Token selection hands the decoder a thinned prompt, so a share `token_drop_prob` of the frames is thinned too: at
random (a share of the visual tokens drawn from [token_drop_min_keep, 0.95]), or with `token_drop_selector` as a
trained TokenSelector that prunes before the decoder thins it at inference (one question a frame, at an r drawn from
`token_drop_ratios`, `SelectorThinning`). A selector's choice is concentrated where random thinning is spread out;
pruned before the decoder, no layer reads what it drops, so the model is taught to answer from what it keeps.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import re
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.nn as nn
import torch.nn.functional as F
from tqdm import tqdm

from litevlm.cameras import CAMERAS
from litevlm.config import TextConfig, VisionConfig, VLMConfig, flag
from litevlm.errors import LiteVLMError
from litevlm.model.vlm import VLM, image_to_tiles, image_to_uint8_tiles, normalize_tiles
from litevlm.train.lineage import recipe_sources, same_stage, source_of

IGNORE = -100


def drive_tiny_config(tokenizer) -> VLMConfig:
    """The embedded default model's shapes: a few million parameters, 16 visual tokens per 112 px tile."""
    return VLMConfig(
        vision=VisionConfig(
            hidden_size=192, num_layers=4, num_heads=6, intermediate_size=576, image_size=112, patch_size=14
        ),
        text=TextConfig(
            vocab_size=tokenizer.vocab_size,
            hidden_size=256,
            num_layers=4,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=640,
            rope_theta=10000.0,
            qkv_bias=True,
            tie_embeddings=True,
            max_position_embeddings=4096,
        ),
        image_token_id=tokenizer.image_id,
        img_start_id=tokenizer.img_start_id,
        img_end_id=tokenizer.img_end_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
        tiles_per_view=1,
        name="drive-tiny",
    )


# What `VLMRecipe.store_dtype` may name: the dtype of the saved weights.
STORE_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}


def family_weight(text: str) -> tuple[str, float]:
    """One `FAMILY=WEIGHT` item of `VLMRecipe.family_weights` as the command line spells it."""
    name, sep, value = text.partition("=")
    try:
        weight = float(value)
    except ValueError:
        weight = -1.0
    if not sep or not name or weight < 0:
        raise argparse.ArgumentTypeError(f"expected FAMILY=WEIGHT with a weight >= 0, got {text!r}")
    return name, weight


@dataclass
class VLMRecipe:
    """How `litevlm train vlm` trains a model; each field with a help text is also a flag of that command."""

    frames: int = flag(6000, "distinct synthetic training frames, rendered once")
    seed: int = flag(0, "frames (seed, first-frame + i); the held-out split is seed 1")
    minutes: float = flag(40.0, "wall-clock budget; the schedule is planned to fit it")
    steps: int = flag(100000, "at most this many steps")
    batch_frames: int = flag(8, "frames per step (several questions each)")
    questions_per_frame: int = 6
    lr: float = flag(3e-4, "peak learning rate (above about 1e-3 the decoder stops reading the images)")
    min_lr_ratio: float = 0.05
    warmup: int = flag(200, "linear warm-up steps")
    weight_decay: float = 0.05
    view_subset_prob: float = flag(0.5, "share of frames shown only some questions' views")
    token_drop_prob: float = flag(0.35, "share of frames whose visual tokens are thinned (keep MIN-95%)")
    token_drop_min_keep: float = flag(0.3, "MIN: the smallest share of a thinned frame's visual tokens kept")
    token_drop_selector: str | None = flag(
        None,
        "thin a frame's visual tokens as this TokenSelector prunes them (a folder holding token_selector/, or the "
        "folder itself) instead of at random: one question a thinned frame, its prompt pruned before the decoder "
        "at an r drawn from --token-drop-ratios, so the decoder learns to answer from the tokens the selector keeps",
        metavar="DIR",
    )
    token_drop_ratios: tuple[float, ...] = flag(
        (0.1, 0.2, 0.3), "with --token-drop-selector: the keep ratios r a thinned frame draws from"
    )
    render_size: tuple[int, int] = (400, 225)
    vocab_size: int = 1024
    tokenizer_frames: int = 2000  # frames whose questions and answers train the tokenizer
    threads: int = flag(2, "torch threads")
    first_frame: int = flag(0, "training frames are (seed, first-frame + i)")
    closed_weight: float = flag(1.0, "sampling weight of closed (yes/no, multiple choice) questions vs open ones")
    family_weights: dict[str, float] = flag(
        {},
        "extra sampling weight of one QA family (repeatable), e.g. vehicle_colour_mc=4",
        flag="--family-weight",
        parse=family_weight,
        metavar="FAMILY=W",
    )
    attn_weight: float = flag(
        0.0, "weight of the tag-attention objective: head 0 of --attn-layer looks where a question's c-tags point"
    )
    attn_layer: int = flag(2, "decoder layer of the tag-attention objective")
    option_weight: float = flag(
        0.0,
        "weight of the option-attention objective: head 0 of --option-layer looks at a multiple-choice "
        "question's right option",
    )
    option_layer: int = flag(3, "decoder layer of the option-attention objective")
    letter_weight: float = flag(
        0.0,
        "weight of the letter-attention objective: head 0 of --letter-layer looks from an option's text at its letter",
    )
    letter_layer: int = flag(1, "decoder layer of the letter-attention objective")
    readout_weight: float = flag(
        0.0,
        "weight of the answer-readout objective: at a multiple-choice answer row, the input of --readout-layer "
        "names the right option's first word",
    )
    readout_layer: int = flag(3, "decoder layer of the answer-readout objective")
    answer_mean: bool = True  # loss = mean over answers of each answer's mean token loss (else mean over tokens)
    init: str | None = flag(None, "continue training from this checkpoint (its tokenizer and weights)")
    reinit_vision: bool = flag(False, "with --init: keep the decoder, start the vision side afresh")
    reinit_language: bool = flag(False, "with --init: keep the vision side, start the decoder afresh")
    grow_after: tuple[int, ...] = flag(
        (),
        "with --init: insert a new decoder layer after each of these layers (a copy with zeroed output "
        "projections, so training starts from the same function); the layer options count the grown model",
        metavar="LAYER",
    )
    unshuffle: bool = flag(
        False,
        "with --init: drop the pixel shuffle (downsample ratio 1.0, one visual token a patch, 4x the tokens), "
        "the projector folded so that a uniform 2x2 block maps to the token it made before",
    )
    tiles: int = flag(0, "with --init: cut each view into this many tiles (0: keep the checkpoint's)")
    name: str = flag("", "with --init: the model's new name (empty: keep the checkpoint's)")
    store_dtype: str = flag(
        "float32", "dtype of the saved weights (training runs in fp32)", choices=tuple(STORE_DTYPES)
    )
    aux_weight: float = flag(0.5, "weight of the dense visual-token objective (0: answers only)")
    aux_scale: float = flag(4.0, "cosine-to-logit scale of the visual-token objective")
    patch_aux_weight: float = flag(
        0.0,
        "weight of the patch objective: a linear probe on the vision tower's patch features names each "
        "patch's contents (motion, light state, ...), before pixel shuffle can average small cues away",
    )
    token_probe_weight: float = flag(
        0.0,
        "weight of the token probe: a linear probe on the projected visual tokens names each token's "
        "contents, so the projector keeps what the tower sees (it and the patch objective mark motion-trail "
        "cells as moving)",
    )
    vision_warmup: int = flag(0, "first steps on the visual-token objective alone")
    probe_frames: int = flag(24, "validation frames for the with/without-images probe (0: none)")
    visual_norm: float = flag(4.0, "cap on a visual token's L2 norm, a squared-hinge penalty (0: none)")
    light_contrast: bool = flag(
        False,
        "ask each 'is the traffic light X?' question with the other two colours too (same light, same view), "
        "so Yes and No differ only in the asked colour",
    )


# ------------------------------------------------------------------------------------------------
# The dense visual-token objective
# ------------------------------------------------------------------------------------------------
def aux_fields() -> list[str]:
    """Names of the per-cell binary targets, in order."""
    from litevlm.data.synthetic import CLASSES, COLOURS, LIGHT_STATES, MOVING_STATUSES, SIGN_KINDS

    return (
        [f"class:{c}" for c in CLASSES]
        + [f"colour:{c}" for c in COLOURS]
        + ["moving"]
        + [f"motion:{m}" for m in MOVING_STATUSES]
        + [f"light:{state}" for state in LIGHT_STATES]
        + [f"sign:{k}" for k in SIGN_KINDS]
    )


def object_fields(o) -> list[str]:
    from litevlm.data.synthetic import VEHICLES

    out = [f"class:{o.cls}"]
    if o.colour:
        out.append(f"colour:{o.colour}")
    if o.moving:
        out.append("moving")
    if o.cls in VEHICLES:
        out.append(f"motion:{o.motion}")
    if o.light:
        out.append(f"light:{o.light}")
    if o.sign:
        out.append(f"sign:{o.sign}")
    return out


def cells_of(box, grid: int, tiles_per_view: int) -> set[int]:
    """Token cells of a view that a box covers (>= 2% of a cell), plus the cell holding its centre."""
    from litevlm.cameras import IMAGE_HEIGHT, IMAGE_WIDTH
    from litevlm.select.tokens import box_cells, cell_index

    u0, v0, u1, v1 = box
    cells = set(box_cells(box, grid, tiles_per_view))
    cols = grid * tiles_per_view
    uc, vc = (u0 + u1) / 2, (v0 + v1) / 2
    if 0 <= uc < IMAGE_WIDTH and 0 <= vc < IMAGE_HEIGHT:
        cells.add(cell_index(int(uc / (IMAGE_WIDTH / cols)), int(vc / (IMAGE_HEIGHT / grid)), grid))
    return cells


def tag_cells(question: str, grid: int, tiles_per_view: int) -> tuple[tuple[str, int], ...]:
    """(camera, token cell within its view) of every DriveLM c-tag <cK,CAM,x,y> in a question."""
    from litevlm.select.tokens import cell_index, tag_points

    return tuple(
        (cam, cell_index(col, row, grid))
        for cam, col, row in tag_points(question, grid, tiles_per_view)
        if cam in CAMERAS
    )


_OPTIONS_RE = re.compile(r"(?:^|\s)A\. (.+?) B\. (.+?) C\. (.+?) D\. (.+?)\s*$")


def option_spans(question: str, tokenizer) -> list[tuple[int, int, int]] | None:
    """Per option A-D of a multiple-choice question: (its letter's token, first and end token of its
    text, the closing full stop left out) in the question's token ids; None for a question that does
    not end in four lettered options "A. ... B. ... C. ... D. ..."."""
    m = _OPTIONS_RE.search(question)
    if m is None:
        return None
    spans = tokenizer.offsets(question)
    out = []
    for k in range(4):
        lo, hi = m.start(k + 1), m.end(k + 1)
        if question[hi - 1] == "." and hi - 1 > lo:
            hi -= 1
        letter = next(i for i, (_, e) in enumerate(spans) if e > lo - 3)  # the token holding "X."
        inside = [i for i, (s, e) in enumerate(spans) if s < hi and e > lo]
        if not inside:
            return None
        out.append((letter, inside[0], inside[-1] + 1))
    return out


# Objectives on one head or one row of the decoder, each with a recipe weight `<name>_weight` and layer `<name>_layer`.
HEAD_OBJECTIVES = ("attn", "option", "letter", "readout")


def right_option(answer: str) -> int | None:
    """Index (0-3) of a multiple-choice answer's letter "A"-"D"; None for any other answer."""
    letter = answer.strip().rstrip(".")
    return "ABCD".index(letter) if letter in ("A", "B", "C", "D") else None


def aux_targets(frame, grid: int, tiles_per_view: int, trails: bool = False) -> torch.Tensor:
    """(6, cells_per_view, F) uint8: what each cell of a grid x grid view holds, per camera (CAMERAS order).

    trails: the cells a moving object's motion trail covers are marked too, with its motion fields only
    ("moving" and, for a vehicle, its "motion:" status): motion shows there, beside the object's box."""
    from litevlm.data.synthetic import clip_box, trail_boxes
    from litevlm.select.tokens import box_cells

    fields = {f: i for i, f in enumerate(aux_fields())}
    out = torch.zeros(len(CAMERAS), grid * grid * tiles_per_view, len(fields), dtype=torch.uint8)
    for o in frame.objects:
        names = object_fields(o)
        idx = [fields[f] for f in names]
        motion = [fields[f] for f in names if f == "moving" or f.startswith("motion:")]
        for cam, box in o.views.items():
            v = CAMERAS.index(cam)
            for cell in cells_of(box.clipped(), grid, tiles_per_view):
                out[v, cell, idx] = 1
            if trails and motion:
                for trail in map(clip_box, trail_boxes(o, box, cam)):
                    if trail[2] > trail[0]:  # some of it in the image
                        for cell in box_cells(trail, grid, tiles_per_view):
                            out[v, cell, motion] = 1
    return out


class FrameBank:
    """Rendered, tiled views of the training frames as uint8, plus their QA, prepared once."""

    def __init__(self, recipe: VLMRecipe, cfg: VLMConfig, tokenizer, progress: bool = True):
        from litevlm.data.synthetic import STEERS, make_frame, render_views

        s, tpv = cfg.vision.image_size, cfg.tiles_per_view
        self.tiles = torch.empty(recipe.frames, len(CAMERAS) * tpv, 3, s, s, dtype=torch.uint8)
        # per QA: question ids, answer ids, needed views, closed, family, (camera, cell) of each c-tag,
        # index of the right option or None, (letter token, first and end token) of every option or None
        self.qas: list[list[tuple]] = []
        self.aux = torch.empty(
            recipe.frames, len(CAMERAS), cfg.tokens_per_tile * tpv, len(aux_fields()), dtype=torch.uint8
        )
        patches = cfg.vision.grid * cfg.vision.grid * tpv
        self.patch_aux = (
            torch.empty(recipe.frames, len(CAMERAS), patches, len(aux_fields()), dtype=torch.uint8)
            if recipe.patch_aux_weight > 0
            else None
        )
        self.token_aux = torch.empty_like(self.aux) if recipe.token_probe_weight > 0 else None
        self.steer = torch.empty(recipe.frames, dtype=torch.long)
        for i in tqdm(range(recipe.frames), desc="rendering frames", disable=not progress):
            frame = make_frame(recipe.seed, recipe.first_frame + i)
            views = render_views(frame, size=recipe.render_size)
            self.tiles[i] = torch.from_numpy(np.concatenate([image_to_uint8_tiles(views[c], s, tpv) for c in CAMERAS]))
            pairs = [(q, q.question, q.answer) for q in frame.qas]
            if recipe.light_contrast:
                pairs += [
                    (q, question, answer)
                    for q in frame.qas
                    if q.family == "light_is"
                    for question, answer in light_contrasts(frame, q)
                ]
            self.qas.append(
                [
                    (
                        tokenizer.encode(question),
                        tokenizer.encode(answer),
                        tuple(q.views),
                        q.closed,
                        q.family,
                        tag_cells(question, cfg.token_grid, tpv),
                        right_option(answer),
                        option_spans(question, tokenizer),
                    )
                    for q, question, answer in pairs
                ]
            )
            self.aux[i] = aux_targets(frame, cfg.token_grid, tpv)
            if self.patch_aux is not None:
                self.patch_aux[i] = aux_targets(frame, cfg.vision.grid, tpv, trails=True)
            if self.token_aux is not None:
                self.token_aux[i] = aux_targets(frame, cfg.token_grid, tpv, trails=True)
            self.steer[i] = STEERS.index(frame.ego.steer)
        self.tpv = tpv

    def pixels(self, frame: int, views: list[str]) -> torch.Tensor:
        idx = [CAMERAS.index(c) * self.tpv + j for c in views for j in range(self.tpv)]
        return normalize_tiles(self.tiles[frame, idx])


def light_contrasts(frame, qa) -> list[tuple[str, str]]:
    """A "light_is" question asked with the other two colours -> [(question, answer)]: the same light in the same
    view, answered from its true state. drive-tiny names a light's colour when asked what it shows, yet answered
    "Is it X?" with Yes for nearly every X; these siblings make Yes and No differ only in the asked colour."""
    from litevlm.data.synthetic import LIGHT_STATES, _visible

    lights = _visible(frame, qa.views[0], lambda o: o.cls == "traffic light") if qa.views else []
    asked = [s for s in LIGHT_STATES if qa.question.endswith(f" {s}?")]
    if len(lights) != 1 or len(asked) != 1:
        return []
    stem = qa.question[: -len(asked[0]) - 1]
    return [(f"{stem}{s}?", "Yes." if s == lights[0].light else "No.") for s in LIGHT_STATES if s != asked[0]]


def view_prefix(tokenizer, views: list[str], tokens_per_view: int) -> list[int]:
    """drive-tiny's user turn up to the question (ChatML, `{camera}: ` labels): the view blocks with their markers."""
    ids = [tokenizer.im_start_id] + tokenizer.encode("user\n")
    for cam in views:
        ids += tokenizer.encode(f"{cam}: ") + [tokenizer.img_start_id]
        ids += [tokenizer.image_id] * tokens_per_view + [tokenizer.img_end_id] + tokenizer.encode("\n")
    return ids


def question_suffix(tokenizer, question_ids: list[int]) -> list[int]:
    """The question, the end of the user turn and the start of the assistant's."""
    im_end, assistant = [tokenizer.eos_id], [tokenizer.im_start_id] + tokenizer.encode("assistant\n")
    return question_ids + im_end + tokenizer.encode("\n") + assistant


def pack_frame(tokenizer, views: list[str], tokens_per_view: int, blocks: list[tuple[list[int], list[int]]]):
    """One frame's prefix + K question/answer blocks -> ids, labels, positions, block id per token; a block is
    laid out as `litevlm.model.prompt.build_prompt` lays out a question (a test checks they agree)."""
    prefix = view_prefix(tokenizer, views, tokens_per_view)
    ids, labels, pos, block = list(prefix), [IGNORE] * len(prefix), list(range(len(prefix))), [0] * len(prefix)
    for b, (q, a) in enumerate(blocks, start=1):
        seg = question_suffix(tokenizer, q)
        ans = a + [tokenizer.eos_id]
        ids += seg + ans
        labels += [IGNORE] * (len(seg) - 1) + ans + [IGNORE]
        pos += list(range(len(prefix), len(prefix) + len(seg) + len(ans)))
        block += [b] * (len(seg) + len(ans))
    return ids, labels, pos, block


def block_mask(block: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """(B, T) block ids -> (B, 1, T, T) bool: causal, and a block sees the prefix (0) and itself only."""
    t = block.shape[1]
    causal = torch.ones(t, t, dtype=torch.bool).tril()
    same = (block[:, :, None] == block[:, None, :]) | (block[:, None, :] == 0)
    m = causal & same & valid[:, None, :]
    m |= torch.eye(t, dtype=torch.bool)  # padding rows attend to themselves (no empty softmax rows)
    return m[:, None]


def make_batch(
    bank: FrameBank,
    tokenizer,
    cfg: VLMConfig,
    recipe: VLMRecipe,
    rng: random.Random,
    thin: SelectorThinning | None = None,
):
    """One step's frames packed with their questions; `thin` (with --token-drop-selector) chooses a thinned frame's
    visual tokens in place of the random thinning."""
    frames = rng.sample(range(len(bank.qas)), recipe.batch_frames)
    tpv_tokens = cfg.tokens_per_tile * cfg.tiles_per_view
    seqs, pixels, keeps, aux, front, steer, looks, options, letters, patch_aux, token_aux = (
        [],
        [],
        [],
        [],
        [],
        [],
        [],
        [],
        [],
        [],
        [],
    )
    for f in frames:
        qas = bank.qas[f]
        views = list(CAMERAS)
        pool = qas
        if rng.random() < recipe.view_subset_prob:
            anchor = rng.choice(qas)
            keep = set(anchor[2]) | {c for c in CAMERAS if rng.random() < 0.15}
            views = [c for c in CAMERAS if c in keep]
            pool = [qa for qa in qas if set(qa[2]) <= keep]
        weights = [(recipe.closed_weight if qa[3] else 1.0) * recipe.family_weights.get(qa[4], 1.0) for qa in pool]
        chosen = _weighted_sample(pool, weights, min(recipe.questions_per_frame, len(pool)), rng)
        thinned = rng.random() < recipe.token_drop_prob
        by_selector = thinned and thin is not None
        if by_selector:  # the selector's choice depends on the question: one a frame
            chosen = chosen[:1]
        seq = pack_frame(tokenizer, views, tpv_tokens, [(qa[0], qa[1]) for qa in chosen])
        keep = torch.ones(len(views) * tpv_tokens, dtype=torch.bool)
        if by_selector:
            keep = thin(bank.pixels(f, views), views, chosen[0][0], rng.choice(recipe.token_drop_ratios))
            seq = keep_visual_tokens(seq, tokenizer.image_id, keep)
        elif thinned:
            seq, keep = drop_visual_tokens(
                seq, tokenizer.image_id, len(views), tpv_tokens, rng, recipe.token_drop_min_keep
            )
        else:
            looks += [
                (len(seqs), *target) for target in tag_targets(seq, chosen, views, tokenizer.image_id, tpv_tokens)
            ]
        options += [(len(seqs), *target) for target in option_targets(seq, chosen)]
        letters += [(len(seqs), *target) for target in letter_targets(seq, chosen)]
        seqs.append(seq)
        keeps.append(keep)
        pixels.append(bank.pixels(f, views))
        cams = [CAMERAS.index(c) for c in views]
        aux.append(bank.aux[f, cams].reshape(-1, bank.aux.shape[-1]))
        if bank.patch_aux is not None:
            patch_aux.append(bank.patch_aux[f, cams].reshape(-1, bank.patch_aux.shape[-1]))
        if bank.token_aux is not None:
            token_aux.append(bank.token_aux[f, cams].reshape(-1, bank.token_aux.shape[-1]))
        if "CAM_FRONT" in views:  # the front view's tokens (offset into this batch's visual tokens)
            front.append(sum(len(p) for p in pixels[:-1]) * cfg.tokens_per_tile + views.index("CAM_FRONT") * tpv_tokens)
            steer.append(int(bank.steer[f]))
    t = max(len(s[0]) for s in seqs)
    b = len(seqs)
    ids = torch.full((b, t), tokenizer.pad_id)
    labels = torch.full((b, t), IGNORE)
    pos = torch.zeros((b, t), dtype=torch.long)
    block = torch.full((b, t), -1)
    valid = torch.zeros((b, t), dtype=torch.bool)
    for i, (a, lab, p, bl) in enumerate(seqs):
        n = len(a)
        ids[i, :n], labels[i, :n], pos[i, :n], block[i, :n] = (
            torch.tensor(a),
            torch.tensor(lab),
            torch.tensor(p),
            torch.tensor(bl),
        )
        valid[i, :n] = True
    return Batch(
        ids,
        labels,
        pos,
        block_mask(block, valid),
        torch.cat(pixels),
        torch.cat(keeps),
        torch.cat(aux).float(),
        torch.tensor(front, dtype=torch.long),
        torch.tensor(steer, dtype=torch.long),
        answer_weights(labels, block),
        looks,
        options,
        letters,
        torch.cat(patch_aux).float() if patch_aux else None,
        torch.cat(token_aux).float() if token_aux else None,
    )


def tag_targets(
    seq, chosen, views: list[str], image_id: int, tokens_per_view: int
) -> list[tuple[int, list[int], list[int]]]:
    """For each packed question with a c-tag in a shown view: (the row that predicts its first answer
    token, the sequence positions of every visual token, those of the tagged cells)."""
    ids, labels, _, block = seq
    visual = [i for i, t in enumerate(ids) if t == image_id]
    out = []
    for b, qa in enumerate(chosen, start=1):
        cells = [visual[views.index(cam) * tokens_per_view + cell] for cam, cell in qa[5] if cam in views]
        if cells:
            row = next(i for i, (lb, bl) in enumerate(zip(labels, block)) if bl == b and lb != IGNORE)
            out.append((row, visual, sorted(set(cells))))
    return out


def option_targets(seq, chosen) -> list[tuple[int, list[int], list[int]]]:
    """For each packed multiple-choice question: (the row that predicts its answer letter, the sequence
    positions of its options, those of the right option's text, its first token that tells it from the
    other options first)."""
    _, labels, _, block = seq
    out = []
    for b, qa in enumerate(chosen, start=1):
        if qa[6] is None or qa[7] is None:
            continue
        start = block.index(b)  # the block opens with the question's ids
        _, lo, hi = qa[7][qa[6]]
        row = next(i for i, (lb, bl) in enumerate(zip(labels, block)) if bl == b and lb != IGNORE)
        target = list(range(start + lo, start + hi))
        j = _first_difference(qa[0], (lo, hi), [s[1:] for s in qa[7]])
        out.append(
            (
                row,
                list(range(start + qa[7][0][0], start + len(qa[0]))),
                target[j : j + 1] + target[:j] + target[j + 1 :],
            )
        )
    return out


def _first_difference(ids: list[int], right: tuple[int, int], spans: list[tuple[int, int]]) -> int:
    """Offset of the first token of the right option's text that some other option does not share
    there ("The ego vehicle is steering ..." options differ only after their common start)."""
    lo, hi = right
    for j in range(hi - lo):
        if any(s_lo + j >= s_hi or ids[s_lo + j] != ids[lo + j] for s_lo, s_hi in spans if (s_lo, s_hi) != (lo, hi)):
            return j
    return 0


def letter_targets(seq, chosen, per_option: int = 3) -> list[tuple[int, list[int], list[int]]]:
    """For the first `per_option` text tokens of every option of each packed multiple-choice question:
    (that token's row, the positions from the first option's letter up to it, its option's letter)."""
    block = seq[3]
    out = []
    for b, qa in enumerate(chosen, start=1):
        if qa[7] is None:
            continue
        start = block.index(b)
        first = start + qa[7][0][0]
        for letter, lo, hi in qa[7]:
            for row in range(start + lo, start + min(hi, lo + per_option)):
                out.append((row, list(range(first, row + 1)), [start + letter]))
    return out


def readout_loss(model: VLM, layer_input: torch.Tensor, batch: Batch) -> tuple[torch.Tensor, float]:
    """Cross-entropy of the LM head read straight off the residual stream entering a layer (a logit
    lens), at each multiple-choice answer row, toward the right option's first distinguishing token
    (the first of `option_targets`' targets): the row must hold the answer's content before it names
    its letter -> (loss, share of rows right)."""
    rows = torch.tensor([[b, r] for b, r, *_ in batch.options])
    target = torch.stack([batch.ids[b, t[0]] for b, _, _, t in batch.options])
    logits = model.lm_head(model.language_model.norm(layer_input[rows[:, 0], rows[:, 1]]))
    return F.cross_entropy(logits, target), float((logits.argmax(-1) == target).float().mean())


def tag_attention_loss(
    model: VLM, layer_input: torch.Tensor, batch: Batch, layer: int, looks=None
) -> tuple[torch.Tensor, float]:
    """Cross-entropy of head 0 of decoder layer `layer`, from each tagged question's answer row, over
    the frame's visual tokens toward the cells its c-tags point at -> (loss, share of rows whose
    argmax is a tagged cell). layer_input: that layer's input (B, T, C). `looks` (default
    batch.looks) may name other rows, domains and targets: (row in batch, answer row, domain, target)."""
    looks = batch.looks if looks is None else looks
    from litevlm.model.layers import apply_rope, rope_cos_sin

    dec = model.language_model.layers[layer]
    d = model.cfg.text.head_dim
    xn = dec.input_layernorm(layer_input)
    cos, sin = rope_cos_sin(batch.pos, d, model.cfg.text.rope_theta, xn.dtype)  # (B, 1, T, D)
    k = apply_rope(dec.self_attn.k_proj(xn)[..., :d], cos[:, 0], sin[:, 0])  # (B, T, D): kv head 0
    b_idx = torch.tensor([b for b, *_ in looks])
    r_idx = torch.tensor([r for _, r, *_ in looks])
    q = apply_rope(
        dec.self_attn.q_proj(xn[b_idx, r_idx])[:, :d], cos[b_idx, 0, r_idx], sin[b_idx, 0, r_idx]
    )  # (M, D): head 0
    losses, hits = [], 0
    for m, (b, _, visual, cells) in enumerate(looks):
        logits = (k[b, visual] @ q[m]) * d**-0.5  # (N,)
        target = torch.tensor([visual.index(c) for c in cells])
        losses.append(torch.logsumexp(logits, 0) - torch.logsumexp(logits[target], 0))
        hits += int(int(logits.argmax()) in set(target.tolist()))
    return torch.stack(losses).mean(), hits / len(looks)


def answer_weights(labels: torch.Tensor, block: torch.Tensor) -> torch.Tensor:
    """(B, T) weight of each label token: 1 / its answer's length (0 where there is no label), so a
    one-word closed answer counts as much as a sentence."""
    sel = labels != IGNORE
    key = block + (block.max() + 1) * torch.arange(block.shape[0])[:, None]  # answers are unique per row and block
    counts = torch.zeros(int(key.max()) + 1).index_add_(0, key[sel], torch.ones(int(sel.sum())))
    w = torch.zeros(labels.shape)
    w[sel] = 1.0 / counts[key[sel]]
    return w


@dataclass
class Batch:
    ids: torch.Tensor
    labels: torch.Tensor
    pos: torch.Tensor
    mask: torch.Tensor
    pixels: torch.Tensor
    keep: torch.Tensor  # (N,) visual tokens that stay in the sequence
    aux: torch.Tensor  # (N, F) per-token targets of the dense objective
    front: torch.Tensor  # (M,) first visual-token index of each CAM_FRONT view in the batch
    steer: torch.Tensor  # (M,) its frame's steering class
    weight: torch.Tensor  # (B, T) per-label-token weight: 1 / the length of its answer
    looks: list = field(default_factory=list)  # (row in batch, answer row, visual positions, tagged positions)
    options: list = field(
        default_factory=list
    )  # (row in batch, answer row, option positions, right option's positions)
    letters: list = field(
        default_factory=list
    )  # (row in batch, option-text row, positions up to it, its letter's position)
    patch_aux: torch.Tensor | None = None  # (P, F) per-patch targets of the patch objective, or None when it is off
    token_aux: torch.Tensor | None = (
        None  # (N, F) per-token targets of the token probe (trails marked), or None when it is off
    )


class AuxHeads(nn.Module):
    """Training-only probes on the visual tokens: per-cell contents and the front view's steering.

    The per-cell probe speaks the decoder's vocabulary: field f scores a token by its cosine with
    the (shared, trained) text embedding of f's words (" bus", " green", " turning left", ...), so
    a cell holding a green bus points where the question's own words " green" and " bus" point,
    and matching a question against the image is the easy kind of attention (like finds like).
    """

    def __init__(self, width: int, word_ids: list[list[int]], n_steer: int, tokens_per_view: int, scale: float = 4.0):
        super().__init__()
        self.word_ids = word_ids
        # A fixed, modest scale: a cell must point well toward its words' embeddings to score, so an
        # object's token stands out from the road's instead of differing by a sliver of direction.
        self.register_buffer("scale", torch.tensor(scale), persistent=False)
        self.bias = nn.Parameter(torch.full((len(word_ids),), -4.0))
        self.steer = nn.Linear(width * tokens_per_view, n_steer)
        self.tokens_per_view = tokens_per_view

    def loss(self, visual: torch.Tensor, batch: Batch, embed: nn.Embedding) -> torch.Tensor:
        words = torch.stack([embed.weight[ids].mean(0) for ids in self.word_ids])  # (F, C)
        logits = self.scale * F.normalize(visual, dim=-1) @ F.normalize(words, dim=-1).T + self.bias
        cell = F.binary_cross_entropy_with_logits(logits, batch.aux, reduction="none").sum(-1).mean()
        if not len(batch.front):
            return cell
        idx = batch.front[:, None] + torch.arange(self.tokens_per_view)
        return cell + F.cross_entropy(self.steer(F.rms_norm(visual[idx], (visual.shape[-1],)).flatten(1)), batch.steer)


def patch_loss(head: nn.Linear, patches: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """The patch objective (and the token probe): a linear probe names every cell's contents from its
    features patches (..., C), one row per cell of targets (cells, F), `aux_targets` at the features'
    resolution. Summed over fields, averaged over cells."""
    logits = head(patches.reshape(-1, patches.shape[-1]))
    return F.binary_cross_entropy_with_logits(logits, targets, reduction="none").sum(-1).mean()


def field_words(tokenizer) -> list[list[int]]:
    """Token ids of the words that name each aux field, as answers phrase them."""
    from litevlm.data.synthetic import SIGN_NAMES, STATUS_WORD

    out = []
    for f in aux_fields():
        kind, _, value = f.partition(":")
        phrase = {
            "class": value,
            "colour": value,
            "moving": "moving",
            "motion": STATUS_WORD.get(value, value),
            "light": f"{value} light",
            "sign": SIGN_NAMES.get(value, value),
        }[kind]
        out.append(tokenizer.encode(" " + phrase))
    return out


def _weighted_sample(items: list, weights: list[float], k: int, rng: random.Random) -> list:
    """k distinct items, drawn with probability proportional to weight (without replacement)."""
    keys = [rng.random() ** (1.0 / w) for w in weights]  # Efraimidis-Spirakis
    order = sorted(range(len(items)), key=lambda i: -keys[i])
    return [items[i] for i in order[:k]]


def drop_visual_tokens(
    seq, image_id: int, n_views: int, per_view: int, rng: random.Random, min_keep: float = 0.3
) -> tuple:
    """Remove a random fraction of a frame's visual tokens, keeping a share drawn from [min_keep, 0.95] (at least one
    token per view); the rest keep their positions, as token selection at inference leaves them. Teaches the model
    pruned inputs."""
    ratio = rng.uniform(min_keep, 0.95)
    keep = torch.rand(n_views * per_view, generator=torch.Generator().manual_seed(rng.randrange(1 << 30))) < ratio
    for v in range(n_views):
        keep[v * per_view + rng.randrange(per_view)] = True
    return keep_visual_tokens(seq, image_id, keep), keep


def keep_visual_tokens(seq, image_id: int, keep: torch.Tensor) -> tuple:
    """A packed frame (ids, labels, positions, blocks) with only the visual tokens `keep` marks (one flag per visual
    token, in prompt order); every other token and every position stays as it was."""
    ids, labels, pos, block = seq
    out, k = ([], [], [], []), 0
    for i, tok in enumerate(ids):
        if tok == image_id:
            k += 1
            if not keep[k - 1]:
                continue
        for lst, src in zip(out, (ids, labels, pos, block)):
            lst.append(src[i])
    return out


class SelectorThinning:
    """A frame's visual tokens as a TokenSelector keeps them for one question: the frame's view tiles through the model
    being trained (no gradient), the question's prompt in the inference layout (`litevlm.train.tokens.prompt_embeds`:
    fixed tiles), the selector's top-r choice before the decoder. Only a selector that prunes before the decoder
    (`--reads embeds` or `prompt`) can: one reading layer 0's output prunes inside it."""

    def __init__(self, folder: str | Path, model: VLM, tokenizer):
        from litevlm.select.tokens import TokenSelector

        self.selector = TokenSelector.load(folder, model)
        if self.selector.prunes_inside:
            raise LiteVLMError(
                f"the TokenSelector in {folder} reads decoder layer 0's output and prunes inside the decoder; "
                "thinning the training prompts needs one that prunes before it (--reads embeds or prompt)"
            )
        self.model, self.tokenizer = model, tokenizer

    @torch.no_grad()
    def __call__(
        self, pixels: torch.Tensor, views: list[str], question_ids: list[int], keep_ratio: float
    ) -> torch.Tensor:
        """(N,) bool over the views' visual tokens in prompt order, from their normalised tiles (tiles, 3, S, S)."""
        from litevlm.model.prompt import Tiling
        from litevlm.select.tokens import visual_index
        from litevlm.train.tokens import prompt_embeds

        model, cfg = self.model, self.model.cfg
        question = self.tokenizer.decode(question_ids)
        visual = model.encode_tiles(pixels.to(model.device)).split(cfg.tiles_per_view)  # one (tiles, n, C) a view
        _, embeds, positions, spans = prompt_embeds(model, self.tokenizer, dict(zip(views, visual)), question, views)
        tiling = Tiling(tiles=cfg.tiles_per_view)
        _, _, kept = self.selector.select(
            model, embeds, positions, spans, keep_ratio=keep_ratio, question=question, tiling=tiling
        )
        return torch.isin(visual_index(spans, model.device), kept).cpu()


def lr_at(step: int, total: int, recipe: VLMRecipe) -> float:
    if step < recipe.warmup:
        return recipe.lr * (step + 1) / recipe.warmup
    frac = min(1.0, (step - recipe.warmup) / max(1, total - recipe.warmup))
    return recipe.lr * (recipe.min_lr_ratio + (1 - recipe.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * frac)))


def init_weights(model: VLM, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        _init_param(name, p, g)


def init_vision(model: VLM, seed: int) -> None:
    """Fresh vision tower and projector; the projector's last layer starts small, so visual tokens
    enter the decoder at the scale of its text embeddings instead of swamping them."""
    g = torch.Generator().manual_seed(seed + 1)
    for name, p in [
        *model.vision_tower.named_parameters(prefix="vision_tower"),
        *model.multi_modal_projector.named_parameters(prefix="multi_modal_projector"),
    ]:
        _init_param(name, p, g)
    model.multi_modal_projector.linear_2.weight.data.mul_(0.25)


def init_language(model: VLM, seed: int) -> None:
    """A fresh decoder (embeddings, layers, final norm; the LM head is tied or re-drawn too)."""
    g = torch.Generator().manual_seed(seed + 2)
    for name, p in [
        *model.language_model.named_parameters(prefix="language_model"),
        *model.lm_head.named_parameters(prefix="lm_head"),
    ]:
        _init_param(name, p, g)


@torch.no_grad()
def grow_decoder(model: VLM, after: tuple[int, ...]) -> VLM:
    """Depth growth by block expansion (LLaMA Pro): a new decoder layer after each layer in `after`, a
    copy of that layer with its two output projections (o_proj, down_proj) zeroed. A zeroed layer adds
    nothing to the residual stream, so the grown model computes exactly what the original did, and
    training starts from everything the original had learned."""
    n = model.cfg.text.num_layers
    bad = sorted({i for i in after if not 0 <= i < n})
    if bad or len(set(after)) != len(after):
        raise LiteVLMError(f"grow_after must name distinct decoder layers 0-{n - 1}, got {list(after)}")
    cfg = dataclasses.replace(model.cfg, text=dataclasses.replace(model.cfg.text, num_layers=n + len(after)))
    grown = VLM(cfg).to(next(model.parameters()).dtype)
    old = model.language_model.layers
    order = [(i, False) for i in range(n)]
    for i in sorted(after, reverse=True):
        order.insert(i + 1, (i, True))
    state = {k: v for k, v in model.state_dict().items() if not k.startswith("language_model.layers.")}
    for j, (i, fresh) in enumerate(order):
        for k, v in old[i].state_dict().items():
            zero = fresh and k in (
                "self_attn.o_proj.weight",
                "self_attn.o_proj.bias",
                "mlp.down_proj.weight",
                "mlp.down_proj.bias",
            )
            state[f"language_model.layers.{j}.{k}"] = torch.zeros_like(v) if zero else v.clone()
    grown.load_state_dict(state)
    return grown


def unshuffle_projector(model: VLM, tiles_per_view: int = 0, name: str = "") -> VLM:
    """The same model without the pixel shuffle: one visual token a ViT patch instead of one a 2x2 block.

    The shuffled projector reads [p00, p01, p10, p11] (4C) through LayerNorm(4C) and linear_1. For a block
    of four equal patches p, LayerNorm(4C) of [p, p, p, p] is four copies of LayerNorm(C)(p) (same mean and
    variance), so linear_1 becomes sum_k W_k diag(g_k) over the four column blocks, its bias b + sum_k W_k b_k,
    and a plain LayerNorm(C): each new token starts as the token its block would make were it uniform."""
    if model.cfg.shuffle != 2:
        raise LiteVLMError(
            f"unshuffle needs a model with pixel shuffle 0.5, got downsample ratio {model.cfg.downsample_ratio}"
        )
    cfg = dataclasses.replace(
        model.cfg,
        downsample_ratio=1.0,
        tiles_per_view=tiles_per_view or model.cfg.tiles_per_view,
        name=name or model.cfg.name,
    )
    new = VLM(cfg).to(next(model.parameters()).dtype)
    state = {k: v.clone() for k, v in model.state_dict().items() if not k.startswith("multi_modal_projector.")}
    old = model.multi_modal_projector
    c = model.cfg.vision.hidden_size
    with torch.no_grad():
        g = old.layer_norm.weight.reshape(4, c)
        b = old.layer_norm.bias.reshape(4, c)
        w = old.linear_1.weight.reshape(-1, 4, c)  # (H, 4, C): the column block of each of the four patches
        state["multi_modal_projector.layer_norm.weight"] = torch.ones(c)
        state["multi_modal_projector.layer_norm.bias"] = torch.zeros(c)
        state["multi_modal_projector.linear_1.weight"] = (w * g[None]).sum(1)
        state["multi_modal_projector.linear_1.bias"] = old.linear_1.bias + torch.einsum("hkc,kc->h", w, b)
        state["multi_modal_projector.linear_2.weight"] = old.linear_2.weight.clone()
        state["multi_modal_projector.linear_2.bias"] = old.linear_2.bias.clone()
    new.load_state_dict(state)
    return new


def _init_param(name: str, p: torch.Tensor, g: torch.Generator) -> None:
    if name.endswith("lambda_1") or name.endswith("lambda_2"):
        p.data.fill_(0.1)
    elif p.ndim >= 2:  # drawn on the CPU (g is a CPU generator): the same weights on every device
        p.data.copy_(torch.empty(p.shape).normal_(0, 0.02, generator=g))
    elif "norm" in name and name.endswith("weight"):
        p.data.fill_(1.0)
    else:
        p.data.zero_()


@torch.no_grad()
def rescale_visual(model: VLM, bank: FrameBank, norm: float) -> None:
    """Scale the projector's last layer so visual tokens leave it with at most `norm` mean L2 norm.

    The decoder's first norm makes its input blind to this scale, but the residual stream is not:
    visual tokens far larger than the text embeddings (drive-tiny's grew to 40-60 against 1.5)
    cannot take in anything the attention layers add, such as which camera they came from.
    """
    frames = list(range(min(8, len(bank.qas))))
    pixels = torch.cat([bank.pixels(f, list(CAMERAS)) for f in frames])
    current = float(model.encode_tiles(pixels).norm(dim=-1).mean())
    if current > norm:
        lin = model.multi_modal_projector.linear_2
        lin.weight.mul_(norm / current)
        lin.bias.mul_(norm / current)


class LooksProbe:
    """Teacher-forced closed-question accuracy on validation frames, with the real images and with
    empty roads: the gap says whether the model reads its images (exact match of every answer token).

    Measured twice: with all six views in the prompt (`images`, `empty`), and with only the views
    each question needs (`images_needed`, `empty_needed`), as the pipeline's view selection feeds it.
    """

    def __init__(self, recipe: VLMRecipe, cfg: VLMConfig, tokenizer):
        from litevlm.data.synthetic import make_frame, render_empty_road, render_views

        s, tpv = cfg.vision.image_size, cfg.tiles_per_view
        empty = render_empty_road(size=recipe.render_size)
        self.blank = torch.cat([image_to_tiles(empty[c], s, tpv) for c in CAMERAS])  # six views, CAMERAS order
        self.frames = []  # (six real views' tiles, [(suffix, view indices, ids, labels, pos, mask, block)])
        for i in range(recipe.probe_frames):
            frame = make_frame(recipe.seed + 2, i)
            rendered = render_views(frame, size=recipe.render_size)
            closed = [q for q in frame.qas if q.closed]
            groups = [("", list(CAMERAS), closed)]
            for vs in sorted({q.views for q in closed}):
                groups.append(("_needed", [c for c in CAMERAS if c in vs], [q for q in closed if q.views == vs]))
            prompts = []
            for suffix, views, qs in groups:
                blocks = [(tokenizer.encode(q.question), tokenizer.encode(q.answer)) for q in qs]
                ids, labels, pos, block = pack_frame(tokenizer, views, cfg.tokens_per_tile * tpv, blocks)
                t = torch.tensor
                prompts.append(
                    (
                        suffix,
                        t([CAMERAS.index(c) for c in views]),
                        t(ids)[None],
                        t(labels)[None],
                        t(pos)[None],
                        block_mask(t(block)[None], torch.ones(1, len(ids), dtype=torch.bool)),
                        t(block),
                    )
                )
            self.frames.append((torch.cat([image_to_tiles(rendered[c], s, tpv) for c in CAMERAS]), prompts))

    @torch.no_grad()
    def __call__(self, model: VLM) -> dict:
        model.eval()
        width = model.cfg.text.hidden_size

        def encode(pixels):  # six views -> (6, tokens per view, C), each view encoded once per probe
            return model.encode_tiles(pixels).reshape(len(CAMERAS), -1, width)

        blank = encode(self.blank)
        hits, total = {}, {}
        for real, prompts in self.frames:
            real = encode(real)
            for suffix, views, ids, labels, pos, mask, block in prompts:
                for name, tokens in (("images", real), ("empty", blank)):
                    key = name + suffix
                    x = model.embed(ids, tokens[views].reshape(-1, width))
                    pred = model.lm_head(model.language_model(x, pos, mask=mask)).argmax(-1)[0]
                    lab = labels[0]
                    for b in block.unique().tolist():
                        sel = (block == b) & (lab != IGNORE)
                        if b > 0 and sel.any():
                            hits[key] = hits.get(key, 0) + bool((pred[sel] == lab[sel]).all())
                            total[key] = total.get(key, 0) + 1
        model.train()
        return {k: round(hits[k] / total[k], 3) for k in sorted(total)}


def replan(max_steps: int, timed_steps: int, timed_seconds: float, seconds_left: float, step: int) -> int:
    """Total steps of the schedule: `step` done plus what the time left allows at the mean pace of the
    `timed_steps` full steps so far, capped at `max_steps` (never fewer than the steps already done)."""
    per_step = timed_seconds / max(timed_steps, 1)
    return max(step, min(max_steps, int(step + max(seconds_left, 0.0) / max(per_step, 1e-9))))


def train_vlm(out_dir: str | Path, recipe: VLMRecipe, progress: bool = True) -> Path:
    from litevlm.data.synthetic import FAMILIES, STEERS, question_corpus
    from litevlm.data.tokenizer import train_default

    unknown = sorted(set(recipe.family_weights) - set(FAMILIES))
    if unknown:
        raise LiteVLMError(
            f"unknown QA family {', '.join(map(repr, unknown))} in family weights (known: {', '.join(FAMILIES)})"
        )
    if recipe.store_dtype not in STORE_DTYPES:  # checked here, not at the first save minutes into training
        raise LiteVLMError(f"store_dtype must be one of {', '.join(STORE_DTYPES)}, got {recipe.store_dtype!r}")
    if not 0.0 < recipe.token_drop_min_keep <= 0.95:
        raise LiteVLMError(f"token_drop_min_keep must lie in (0, 0.95], got {recipe.token_drop_min_keep}")
    if not recipe.token_drop_ratios or not all(0.0 < r <= 1.0 for r in recipe.token_drop_ratios):
        raise LiteVLMError(f"token_drop_ratios must be keep ratios in (0, 1], got {recipe.token_drop_ratios}")
    # What it reads, named before training: `out` may be the folder it continues from.
    sources = recipe_sources(init=recipe.init, token_drop_selector=recipe.token_drop_selector)
    earlier = lineage_of(recipe.init) if recipe.init else []
    torch.manual_seed(recipe.seed)
    torch.set_num_threads(recipe.threads)
    out = Path(out_dir)
    t_start = time.time()
    if recipe.init:
        from litevlm.data.tokenizer import Tokenizer
        from litevlm.model.hf import load_native

        tokenizer = Tokenizer.from_dir(recipe.init)
        model = load_native(recipe.init)
        cfg = model.cfg
        if recipe.reinit_vision:
            init_vision(model, recipe.seed)
        if recipe.reinit_language:
            init_language(model, recipe.seed)
        if recipe.grow_after:
            model = grow_decoder(model, tuple(recipe.grow_after))
            cfg = model.cfg
        if recipe.unshuffle or recipe.tiles or recipe.name:
            if recipe.unshuffle:
                model = unshuffle_projector(model, recipe.tiles, recipe.name)
            else:
                model.cfg = dataclasses.replace(
                    model.cfg,
                    tiles_per_view=recipe.tiles or model.cfg.tiles_per_view,
                    name=recipe.name or model.cfg.name,
                )
            cfg = model.cfg
    elif recipe.grow_after or recipe.unshuffle or recipe.tiles or recipe.name:
        raise LiteVLMError(
            "grow_after, unshuffle, tiles and name change a model: each needs a checkpoint to change (init)"
        )
    else:
        tokenizer = train_default(
            question_corpus(n_frames=recipe.tokenizer_frames, seed=recipe.seed), vocab_size=recipe.vocab_size
        )
        cfg = drive_tiny_config(tokenizer)
        model = VLM(cfg)
        init_weights(model, recipe.seed)
        init_vision(model, recipe.seed)
    model.float()
    for name in HEAD_OBJECTIVES:
        if getattr(recipe, f"{name}_weight") > 0 and not 0 <= getattr(recipe, f"{name}_layer") < cfg.text.num_layers:
            raise LiteVLMError(
                f"{name}_layer must name one of the {cfg.text.num_layers} decoder layers "
                f"(0-{cfg.text.num_layers - 1}), got {getattr(recipe, f'{name}_layer')}"
            )
    thin = SelectorThinning(recipe.token_drop_selector, model, tokenizer) if recipe.token_drop_selector else None
    bank = FrameBank(recipe, cfg, tokenizer, progress)
    if recipe.visual_norm > 0:
        rescale_visual(model, bank, recipe.visual_norm)
    probe = LooksProbe(recipe, cfg, tokenizer) if recipe.probe_frames else None
    heads = AuxHeads(
        cfg.text.hidden_size,
        field_words(tokenizer),
        len(STEERS),
        cfg.tokens_per_tile * cfg.tiles_per_view,
        recipe.aux_scale,
    )
    params = [*model.named_parameters(), *heads.named_parameters(prefix="aux")]
    patch_head = None  # the patch objective's probe: training-only, like the heads
    if recipe.patch_aux_weight > 0:
        patch_head = nn.Linear(cfg.vision.hidden_size, len(aux_fields()))
        nn.init.constant_(
            patch_head.bias, -4.0
        )  # start at "nothing here" (most patches are road), like the token heads
        params += list(patch_head.named_parameters(prefix="patch"))
    token_head = None  # the token probe: training-only too
    if recipe.token_probe_weight > 0:
        token_head = nn.Linear(cfg.text.hidden_size, len(aux_fields()))
        nn.init.constant_(token_head.bias, -4.0)
        params += list(token_head.named_parameters(prefix="token_probe"))
    decay = [p for n, p in params if p.ndim >= 2]
    no_decay = [p for n, p in params if p.ndim < 2]
    opt = torch.optim.AdamW(
        [{"params": decay, "weight_decay": recipe.weight_decay}, {"params": no_decay, "weight_decay": 0.0}],
        lr=recipe.lr,
        betas=(0.9, 0.95),
    )
    rng = random.Random(recipe.seed)
    deadline = time.time() + recipe.minutes * 60
    total = recipe.steps  # re-planned to the time budget after a short timing
    bar = tqdm(total=recipe.steps, desc="training vlm", disable=not progress)
    log = {
        "loss": [],
        "aux": [],
        "patch": [],
        "token_probe": [],
        "probe": [],
        **{k: [] for name in HEAD_OBJECTIVES for k in (name, f"{name}_hit")},
    }
    step, t_loop, last_save = 0, time.time(), time.time()
    model.train()
    while step < total and time.time() < deadline:
        batch = make_batch(bank, tokenizer, cfg, recipe, rng, thin)
        for g in opt.param_groups:
            g["lr"] = lr_at(step, total, recipe)
        visual, patches = model.encode_tiles_and_patches(batch.pixels)
        visual = visual.reshape(-1, cfg.text.hidden_size)
        aux = heads.loss(visual, batch, model.language_model.embed_tokens) if recipe.aux_weight > 0 else torch.zeros(())
        patch = patch_loss(patch_head, patches, batch.patch_aux) if patch_head is not None else torch.zeros(())
        token_probe = patch_loss(token_head, visual, batch.token_aux) if token_head is not None else torch.zeros(())
        if recipe.visual_norm > 0:
            aux = aux + F.relu(visual.norm(dim=-1) - recipe.visual_norm).pow(2).mean()
        if step < recipe.vision_warmup:
            loss = aux + patch + token_probe
        else:
            embeds = model.embed(batch.ids, visual[batch.keep])
            # The attention objectives read the residual stream entering their layers.
            probes = {}
            if recipe.attn_weight > 0 and batch.looks:
                probes.setdefault(recipe.attn_layer, []).append(("attn", batch.looks))
            if recipe.option_weight > 0 and batch.options:
                probes.setdefault(recipe.option_layer, []).append(("option", batch.options))
            if recipe.letter_weight > 0 and batch.letters:
                probes.setdefault(recipe.letter_layer, []).append(("letter", batch.letters))
            if recipe.readout_weight > 0 and batch.options:
                probes.setdefault(recipe.readout_layer, []).append(("readout", None))
            lm_model, x, at = model.language_model, embeds, 0
            attn = {name: torch.zeros(()) for name in HEAD_OBJECTIVES}
            for layer in sorted(probes):
                x, at = lm_model(x, batch.pos, mask=batch.mask, start_layer=at, end_layer=layer), layer
                for name, looks in probes[layer]:
                    attn[name], hit = (
                        readout_loss(model, x, batch)
                        if name == "readout"
                        else tag_attention_loss(model, x, batch, layer, looks)
                    )
                    log[name].append(attn[name].item())
                    log[f"{name}_hit"].append(hit)
            hidden = lm_model(x, batch.pos, mask=batch.mask, start_layer=at)
            sel = batch.labels != IGNORE
            if recipe.answer_mean:
                w = batch.weight[sel]
                lm = (
                    F.cross_entropy(model.lm_head(hidden[sel]), batch.labels[sel], reduction="none") * w
                ).sum() / w.sum()
            else:
                lm = F.cross_entropy(model.lm_head(hidden[sel]), batch.labels[sel])
            loss = (
                lm + recipe.aux_weight * aux + recipe.patch_aux_weight * patch + recipe.token_probe_weight * token_probe
            )
            for name in HEAD_OBJECTIVES:
                loss = loss + getattr(recipe, f"{name}_weight") * attn[name]
            log["loss"].append(lm.item())
        log["aux"].append(aux.item())
        if patch_head is not None:
            log["patch"].append(patch.item())
        if token_head is not None:
            log["token_probe"].append(token_probe.item())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        # Clipped apart: the dense objective's gradients must not shrink the decoder's step.
        torch.nn.utils.clip_grad_norm_(model.language_model.parameters(), 1.0)
        torch.nn.utils.clip_grad_norm_(
            [*model.vision_tower.parameters(), *model.multi_modal_projector.parameters(), *heads.parameters()], 1.0
        )
        opt.step()
        step += 1
        if step == recipe.vision_warmup + 20:  # plan the schedule to the time budget (full steps)
            total = bar.total = replan(
                recipe.steps, step - recipe.vision_warmup, time.time() - t_loop, deadline - time.time(), step
            )
        if step == recipe.vision_warmup:
            t_loop = time.time()
        bar.update(1)
        if time.time() - last_save > 300:  # a usable checkpoint survives an interrupted run
            if probe:
                log["probe"].append({"step": step, **probe(model)})
                bar.write(f"step {step}: closed accuracy (teacher-forced) {log['probe'][-1]}")
            _save(model, tokenizer, out, recipe, step, log, t_start, sources, earlier)
            model.train()
            last_save = time.time()
            if step > recipe.vision_warmup + 20:  # re-plan at the mean pace so far: machine load changes
                total = bar.total = replan(
                    recipe.steps, step - recipe.vision_warmup, last_save - t_loop, deadline - last_save, step
                )
        if step % 10 == 0:
            post = {
                "loss": f"{np.mean(log['loss'][-50:]) if log['loss'] else float('nan'):.3f}",
                "aux": f"{np.mean(log['aux'][-50:]):.3f}",
            }
            if log["attn"]:
                post.update(attn=f"{np.mean(log['attn'][-50:]):.3f}", hit=f"{np.mean(log['attn_hit'][-50:]):.2f}")
            if log["option"]:
                post.update(
                    opt=f"{np.mean(log['option'][-50:]):.3f}", opt_hit=f"{np.mean(log['option_hit'][-50:]):.2f}"
                )
            if log["letter"]:
                post.update(let_hit=f"{np.mean(log['letter_hit'][-50:]):.2f}")
            if log["patch"]:
                post.update(patch=f"{np.mean(log['patch'][-50:]):.3f}")
            if log["token_probe"]:
                post.update(tok=f"{np.mean(log['token_probe'][-50:]):.3f}")
            if log["readout"]:
                post.update(
                    read=f"{np.mean(log['readout'][-50:]):.3f}", read_hit=f"{np.mean(log['readout_hit'][-50:]):.2f}"
                )
            bar.set_postfix(**post)
    bar.close()
    if probe:
        log["probe"].append({"step": step, **probe(model)})
        print(f"step {step}: closed accuracy (teacher-forced) {log['probe'][-1]}")
    return _save(model, tokenizer, out, recipe, step, log, t_start, sources, earlier)


def lineage_of(checkpoint: str | Path) -> list[dict]:
    """The training stages behind a checkpoint, oldest first: what `--init` chains accumulate. Each names the folder
    it was read from as given (`checkpoint`) and as found again (`source`, `litevlm.train.lineage`)."""
    path = Path(checkpoint) / "config.json"
    if not path.is_file():
        return []
    meta = json.loads(path.read_text())
    recipe = meta.get("recipe", {})
    if "lineage" in meta:
        earlier = meta["lineage"]
    else:  # written before lineage was recorded: follow its --init while the folders exist
        earlier = lineage_of(recipe["init"]) if recipe.get("init") else []
    stage = {
        "checkpoint": str(checkpoint),
        "source": source_of(checkpoint),  # the path may be a scratch folder, gone by the time anyone reads this
        "steps": meta.get("steps"),
        "train_seconds": meta.get("train_seconds"),
        "recipe": recipe,
        "looks_probe": meta.get("looks_probe"),
    }
    if "averaged" in meta:  # `average_checkpoints`: the mean of these stages, each continued from `earlier`
        stage["averaged"] = meta["averaged"]
    return [*earlier, stage]


def _save(
    model,
    tokenizer,
    out: Path,
    recipe: VLMRecipe,
    step: int,
    log: dict,
    t_start: float,
    sources: dict[str, str],
    lineage: list[dict],
) -> Path:
    """The checkpoint and its record: the recipe with `sources` (the folders it read, named as
    `litevlm.train.lineage` names them), the run's figures and the `lineage` of the stages before it."""
    from litevlm.model.hf import save_native

    model.eval()
    losses = log["loss"]
    meta = {
        "recipe": {**asdict(recipe), **({"sources": sources} if sources else {})},
        "steps": step,
        "train_seconds": round(time.time() - t_start, 1),
        "final_loss": float(np.mean(losses[-100:])) if losses else None,
        "looks_probe": log["probe"][-1:] or None,
        "lineage": lineage,
    }
    save_native(model, out, extra_meta=meta, dtype=STORE_DTYPES[recipe.store_dtype])
    tokenizer.save(out)
    curves = {"loss": losses[::10], "aux": log["aux"][::10], "probe": log["probe"]}
    for name in ("patch", "token_probe"):
        if log[name]:
            curves[name] = log[name][::10]
    for name in HEAD_OBJECTIVES:
        if log.get(name):
            curves.update({name: log[name][::10], f"{name}_hit": log[f"{name}_hit"][::10]})
    (out / "train_log.json").write_text(json.dumps({**curves, **meta}, indent=1))
    return out


def average_checkpoints(out: str | Path, checkpoints: list[str | Path]) -> Path:
    """The element-wise mean of checkpoints of one shape (a "model soup"), saved at `out` with the tokenizer of the
    first.

    Stages continued from one checkpoint stay close enough in weight space for their mean to work; the mean of unrelated
    models does not. The card records the averaged stages (`averaged`) after the lineage they share.
    """
    from litevlm.model.hf import load_native, read_native_meta, save_native

    if len(checkpoints) < 2:
        raise LiteVLMError(f"averaging needs at least two checkpoints, got {len(checkpoints)}")
    metas = [read_native_meta(c) for c in checkpoints]
    for c, m in zip(checkpoints[1:], metas[1:]):
        if m["litevlm"] != metas[0]["litevlm"]:
            diff = sorted(
                k for k in {*m["litevlm"], *metas[0]["litevlm"]} if m["litevlm"].get(k) != metas[0]["litevlm"].get(k)
            )
            raise LiteVLMError(
                f"{c} has another model config than {checkpoints[0]} (differs in {', '.join(diff)}): "
                "only checkpoints of one shape average"
            )
    tokenizers = [
        (Path(c) / "tokenizer.json").read_bytes() if (Path(c) / "tokenizer.json").is_file() else None
        for c in checkpoints
    ]
    if any(t != tokenizers[0] for t in tokenizers):
        raise LiteVLMError("the checkpoints' tokenizer.json files differ: the same ids would mean other tokens in each")
    models = [
        load_native(c) for c in checkpoints
    ]  # in their stored dtype: the mean is stored in it (fp32 where they differ)
    stored = {next(m.parameters()).dtype for m in models}
    dtype = stored.pop() if len(stored) == 1 else torch.float32
    models = [m.float() for m in models]
    sums = {k: v.clone() for k, v in models[0].state_dict().items()}
    for m in models[1:]:
        for k, v in m.state_dict().items():
            sums[k] += v
    models[0].load_state_dict({k: v / len(models) for k, v in sums.items()})
    stages = [lineage_of(c) for c in checkpoints]
    shared = []  # the stages all inputs have in common, oldest first
    for earlier in zip(*(s[:-1] for s in stages)):
        if not all(same_stage(e, earlier[0]) for e in earlier[1:]):  # a stage read from two folders is one stage
            break
        shared.append(earlier[0])
    meta = {
        "averaged": [s[-1] for s in stages],
        "lineage": shared,
        "steps": sum(m.get("steps") or 0 for m in metas),
        "train_seconds": sum(m.get("train_seconds") or 0 for m in metas),
    }
    save_native(models[0], out, extra_meta=meta, dtype=dtype)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        src = Path(checkpoints[0]) / name
        if src.is_file():
            (Path(out) / name).write_bytes(src.read_bytes())
    return Path(out)
