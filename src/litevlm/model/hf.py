"""Checkpoint I/O: transformers-native InternVL checkpoints (and the original remote-code layout) to and
from our `VLM`, plus litevlm's own checkpoint directory format.

Our module names are transformers' in-memory names with the leading ``model.`` removed, so converting
is a matter of mapping key prefixes (transformers' InternVL conversion mapping): on disk, `save_pretrained`
writes the legacy family (``vision_tower.``, ``multi_modal_projector.``, ``language_model.model.``,
``language_model.lm_head.``), newer files may use ``model.vision_tower.`` ... ``lm_head.``, and the
original OpenGVLab checkpoints use ``vision_model.`` / ``mlp1.`` with a fused ViT qkv (and, for
InternLM2, a fused ``wqkv``). The family is read from the safetensors header, never guessed. Loading
is strict: every missing, unexpected or mis-shaped tensor is named in one `LiteVLMError`.

Dynamic RoPE (``rope_type="dynamic"``, as in real InternVL3 text configs) is accepted and run as plain
RoPE: transformers rescales only beyond ``max_position_embeddings``, so the two are identical below it.

An export holds what transformers' own `save_pretrained` writes for an InternVL model and its processor: the
weights under the legacy names (transformers 5 saves those, and reads both families), config.json,
generation_config.json, and the processor: processor_config.json (InternVL's image processor cutting tiles of the
vision tower's size the way the model was trained, ImageNet normalisation, `image_seq_length` visual tokens a
tile), chat_template.jinja (the prompt litevlm writes: per view its camera label and the image, then the question)
and the image tokens' names in tokenizer_config.json, so `AutoProcessor` and `apply_chat_template` build the same
prompt ids and pixels as litevlm.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import os
import shutil
import uuid
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from litevlm.config import PRESETS, TextConfig, VisionConfig, VLMConfig
from litevlm.errors import LiteVLMError
from litevlm.model.prompt import IMAGE_MARK, PROMPT_FILE, PromptFormat, Tiling, read_format
from litevlm.model.vlm import IMAGENET_MEAN, IMAGENET_STD, VLM

SUPPORTED_ACTS = ("gelu", "quick_gelu", "gelu_pytorch_tanh")
SPECIAL_TOKEN_FIELDS = ("img_start_id", "img_end_id", "eos_token_id", "pad_token_id")
# Token strings that identify our special ids in a tokenizer's added tokens.
TOKEN_STRINGS = {
    "img_start_id": "<img>",
    "img_end_id": "</img>",
    "eos_token_id": "<|im_end|>",
    "image_token_id": "<IMG_CONTEXT>",
}
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "vocab.json",
    "merges.txt",
    "tokenizer.model",
    "chat_template.jinja",
    "chat_template.json",
)
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
NATIVE_FORMAT = "litevlm"


# ================================================================================================
# Config
# ================================================================================================
def _fail(field: str, value, why: str) -> None:
    raise LiteVLMError(f"unsupported checkpoint config: {field}={value!r} ({why})")


def _square(field: str, v) -> int:
    if isinstance(v, (list, tuple)):
        if len(v) != 2 or v[0] != v[1]:
            _fail(field, v, "only square images/patches are supported")
        return int(v[0])
    return int(v)


def _rope_theta(t: dict, field: str) -> float:
    """rope_theta from transformers 5 `rope_parameters`, 4.x `rope_scaling` + `rope_theta`, or the default."""
    rope = t.get("rope_parameters") or t.get("rope_scaling") or {}
    if not isinstance(rope, dict) or any(isinstance(v, dict) for v in rope.values()):
        _fail(f"{field}.rope_parameters", rope, "per-layer-type RoPE is not supported")
    kind = rope.get("rope_type", rope.get("type", "default"))
    if kind not in ("default", "dynamic"):
        _fail(f"{field}.rope_parameters.rope_type", kind, "only default and dynamic RoPE are supported")
    # dynamic: identical to plain RoPE below max_position_embeddings (module docstring).
    if rope.get("partial_rotary_factor", t.get("partial_rotary_factor", 1.0)) not in (1, 1.0, None):
        _fail(f"{field}.partial_rotary_factor", rope.get("partial_rotary_factor"), "only full rotary is supported")
    return float(rope.get("rope_theta", t.get("rope_theta", 10000.0)))


def _text_from_hf(t: dict, field: str = "text_config") -> TextConfig:
    arch = t.get("model_type", "qwen2")
    if arch not in ("qwen2", "llama"):
        _fail(f"{field}.model_type", arch, "the text model must be qwen2 or llama")
    if t.get("hidden_act", "silu") != "silu":
        _fail(f"{field}.hidden_act", t["hidden_act"], "the decoder MLP is SwiGLU with silu")
    if arch == "qwen2":
        qkv_bias = True  # transformers' Qwen2 always has q/k/v biases
        if t.get("use_sliding_window", False):
            _fail(f"{field}.use_sliding_window", True, "sliding-window attention is not supported")
    else:
        qkv_bias = bool(t.get("attention_bias", False))
        if qkv_bias:
            _fail(
                f"{field}.attention_bias", True, "transformers' Llama then also has an o_proj bias, which litevlm lacks"
            )
        if t.get("mlp_bias", False):
            _fail(f"{field}.mlp_bias", True, "the decoder MLP has no biases")
    layer_types = t.get("layer_types") or []
    if any(lt != "full_attention" for lt in layer_types):
        _fail(f"{field}.layer_types", layer_types, "only full attention is supported")
    heads = int(t["num_attention_heads"])
    return TextConfig(
        vocab_size=int(t["vocab_size"]),
        hidden_size=int(t["hidden_size"]),
        num_layers=int(t["num_hidden_layers"]),
        num_heads=heads,
        num_kv_heads=int(t.get("num_key_value_heads") or heads),
        intermediate_size=int(t["intermediate_size"]),
        head_dim=int(t.get("head_dim") or 0),
        rope_theta=_rope_theta(t, field),
        norm_eps=float(t.get("rms_norm_eps", 1e-6)),
        qkv_bias=qkv_bias,
        tie_embeddings=False,  # decided at the top level by the caller
        max_position_embeddings=int(t.get("max_position_embeddings", 32768)),
        arch=arch,
    )


def _vision_from_hf(v: dict) -> VisionConfig:
    if not v.get("use_mean_pooling", True):
        _fail("vision_config.use_mean_pooling", False, "InternViT has no final LayerNorm; litevlm has none either")
    if not v.get("use_absolute_position_embeddings", True):
        _fail("vision_config.use_absolute_position_embeddings", False, "InternViT uses absolute position embeddings")
    if v.get("num_channels", 3) != 3:
        _fail("vision_config.num_channels", v["num_channels"], "images must be RGB")
    act = v.get("hidden_act", "gelu")
    if act not in SUPPORTED_ACTS:
        _fail("vision_config.hidden_act", act, f"supported: {', '.join(SUPPORTED_ACTS)}")
    return VisionConfig(
        hidden_size=int(v.get("hidden_size", 1024)),
        num_layers=int(v.get("num_hidden_layers", 24)),
        num_heads=int(v.get("num_attention_heads", 16)),
        intermediate_size=int(v.get("intermediate_size", 4096)),
        image_size=_square("vision_config.image_size", v.get("image_size", 448)),
        patch_size=_square("vision_config.patch_size", v.get("patch_size", 14)),
        qkv_bias=bool(v.get("attention_bias", False)),  # transformers' default is False
        qk_norm=bool(v.get("use_qk_norm", False)),
        norm_type=v.get("norm_type", "layer_norm"),
        norm_eps=float(v.get("layer_norm_eps", 1e-6)),
        layer_scale_init=float(v.get("layer_scale_init_value", 0.1)),
        hidden_act=act,
    )


def _check_connector(
    downsample_ratio, select_layer, strategy: str, projector_act: str, names: tuple[str, str, str, str]
) -> None:
    if float(downsample_ratio) not in (0.5, 1.0):
        _fail(names[0], downsample_ratio, "only pixel shuffle 0.5 (or 1.0, no shuffle) is supported")
    if select_layer != -1:
        _fail(names[1], select_layer, "only the last vision layer (-1) is supported")
    if strategy != "default":
        _fail(names[2], strategy, "only 'default' (drop the CLS token) is supported")
    if projector_act not in SUPPORTED_ACTS:
        _fail(names[3], projector_act, f"supported: {', '.join(SUPPORTED_ACTS)}")


def _default_ids(text: TextConfig) -> dict[str, int]:
    """Special ids of the preset with the same vocabulary, else VLMConfig's defaults (Qwen2 tokenizer)."""
    for make in PRESETS.values():
        p = make()
        if p.text.vocab_size == text.vocab_size and p.text.arch == text.arch:
            break
    else:
        p = VLMConfig.__new__(VLMConfig)  # class defaults without validation against this vocab
        for f in dataclasses.fields(VLMConfig):
            if f.default is not dataclasses.MISSING:
                setattr(p, f.name, f.default)
    return {f: getattr(p, f) for f in (*SPECIAL_TOKEN_FIELDS, "image_token_id")}


def _first_id(v) -> int | None:
    if isinstance(v, (list, tuple)):
        return int(v[0]) if v else None
    return None if v is None else int(v)


def _resolve_ids(text: TextConfig, extras: dict, tokenizer_ids: dict, config_ids: dict) -> dict[str, int]:
    """Our own export's ids > tokenizer files > config eos/pad > preset defaults (see module docstring)."""
    defaults = _default_ids(text)
    out, guessed = {}, []
    for f in SPECIAL_TOKEN_FIELDS:
        if f == "pad_token_id":  # the tokenizer's pad token is the weaker source for pad
            order = (extras.get(f), config_ids.get(f), tokenizer_ids.get(f))
        else:
            order = (extras.get(f), tokenizer_ids.get(f), config_ids.get(f))
        v = next((x for x in order if x is not None), None)
        if v is None:
            v = defaults[f]
            if not 0 <= v < text.vocab_size:
                guessed.append(f)
                v = 0
        out[f] = int(v)
    if guessed:
        warnings.warn(
            f"the checkpoint names no {', '.join(guessed)} (no tokenizer.json with <img>, </img>, <|im_end|>); "
            "they were set to 0. Put the tokenizer files beside config.json to fix this.",
            stacklevel=2,
        )
    return out


def config_from_hf(d: dict, tokenizer_ids: dict | None = None, generation: dict | None = None) -> VLMConfig:
    """A transformers InternVLConfig dict (config.json; or the original remote-code InternVLChatConfig) -> VLMConfig.

    `tokenizer_ids` maps our field names (img_start_id, img_end_id, eos_token_id, pad_token_id,
    image_token_id) to ids found in tokenizer files; `generation` is generation_config.json. Special
    ids come from, in order: our own export's "litevlm" entry, the tokenizer, the config's eos/pad,
    the preset with the same vocabulary. Unsupported settings raise LiteVLMError naming the field.
    """
    tokenizer_ids, generation = tokenizer_ids or {}, generation or {}
    try:
        if d.get("model_type") == "internvl_chat" or "llm_config" in d:
            return _config_from_original(d, tokenizer_ids, generation)
        return _config_from_transformers(d, tokenizer_ids, generation)
    except LiteVLMError:
        raise
    except (ValueError, TypeError, KeyError) as e:  # a config dataclass check, or a required field missing
        raise LiteVLMError(f"the checkpoint config is inconsistent or incomplete: {e!r}") from None


def _config_from_transformers(d: dict, tokenizer_ids: dict, generation: dict) -> VLMConfig:
    if d.get("model_type") != "internvl":
        _fail("model_type", d.get("model_type"), "expected a transformers InternVL checkpoint ('internvl')")
    t = d.get("text_config") or {}
    if not t:
        _fail("text_config", t, "the config must spell out its text model")
    _check_connector(
        d.get("downsample_ratio", 0.5),
        d.get("vision_feature_layer", -1),
        d.get("vision_feature_select_strategy", "default"),
        d.get("projector_hidden_act", "gelu"),
        ("downsample_ratio", "vision_feature_layer", "vision_feature_select_strategy", "projector_hidden_act"),
    )
    text = _text_from_hf(t)
    # transformers 5 ties on the top-level flag only; 4.x configs lack it and tie on text_config's.
    text.tie_embeddings = bool(d.get("tie_word_embeddings", t.get("tie_word_embeddings", False)))
    config_ids = {
        "eos_token_id": _first_id(
            next(
                (
                    x
                    for x in (generation.get("eos_token_id"), t.get("eos_token_id"), d.get("eos_token_id"))
                    if x is not None
                ),
                None,
            )
        ),
        "pad_token_id": _first_id(
            next(
                (
                    x
                    for x in (generation.get("pad_token_id"), t.get("pad_token_id"), d.get("pad_token_id"))
                    if x is not None
                ),
                None,
            )
        ),
    }
    extras = d.get("litevlm") or {}
    ids = _resolve_ids(text, extras, tokenizer_ids, config_ids)
    return VLMConfig(
        vision=_vision_from_hf(d.get("vision_config") or {}),
        text=text,
        downsample_ratio=float(d.get("downsample_ratio", 0.5)),
        projector_act=d.get("projector_hidden_act", "gelu"),
        image_token_id=int(d.get("image_token_id", 151667)),
        tiles_per_view=int(extras.get("tiles_per_view", 1)),
        name=str(extras.get("name", d.get("_name_or_path") or "hf-import")),
        **ids,
    )


def _config_from_original(d: dict, tokenizer_ids: dict, generation: dict) -> VLMConfig:
    """The original OpenGVLab `InternVLChatConfig` (vision_config + llm_config, InternViT field names)."""
    v, llm = d.get("vision_config") or {}, d.get("llm_config") or {}
    if d.get("ps_version", "v2") != "v2":
        _fail("ps_version", d.get("ps_version"), "only pixel shuffle v2 (all InternVL2+ checkpoints) is supported")
    _check_connector(
        d.get("downsample_ratio", 0.5),
        d.get("select_layer", -1),
        "default",
        "gelu",
        ("downsample_ratio", "select_layer", "", ""),
    )
    arch = (llm.get("architectures") or [""])[0]
    if arch == "Qwen2ForCausalLM":
        t = dict(llm, model_type="qwen2")
    elif arch == "InternLM2ForCausalLM":
        t = dict(llm, model_type="llama", attention_bias=bool(llm.get("bias", False)))
    else:
        _fail("llm_config.architectures", arch, "only Qwen2ForCausalLM and InternLM2ForCausalLM are supported")
    text = _text_from_hf(t, "llm_config")
    text.tie_embeddings = bool(d.get("tie_word_embeddings", llm.get("tie_word_embeddings", False)))
    image_size = d.get("force_image_size") or v.get("image_size", 448)
    vision = _vision_from_hf(
        {
            "hidden_size": v.get("hidden_size", 1024),
            "num_hidden_layers": v.get("num_hidden_layers", 24),
            "num_attention_heads": v.get("num_attention_heads", 16),
            "intermediate_size": v.get("intermediate_size", 4096),
            "image_size": image_size,
            "patch_size": v.get("patch_size", 14),
            "attention_bias": v.get("qkv_bias", True),
            "use_qk_norm": v.get("qk_normalization", False),
            "norm_type": v.get("norm_type", "layer_norm"),
            "layer_norm_eps": v.get("layer_norm_eps", 1e-6),
            "hidden_act": v.get("hidden_act", "gelu"),
        }
    )
    image_token_id = tokenizer_ids.get("image_token_id", _default_ids(text)["image_token_id"])
    if not 0 <= image_token_id < text.vocab_size:
        raise LiteVLMError(
            "the original InternVL config does not store the <IMG_CONTEXT> id and no tokenizer.json names it; "
            "put the checkpoint's tokenizer files beside config.json"
        )
    config_ids = {
        "eos_token_id": _first_id(generation.get("eos_token_id", llm.get("eos_token_id"))),
        "pad_token_id": _first_id(generation.get("pad_token_id", llm.get("pad_token_id"))),
    }
    ids = _resolve_ids(text, {}, tokenizer_ids, config_ids)
    return VLMConfig(
        vision=vision,
        text=text,
        downsample_ratio=float(d.get("downsample_ratio", 0.5)),
        image_token_id=int(image_token_id),
        name="original-import",
        **ids,
    )


def config_to_hf(cfg: VLMConfig) -> dict:
    """VLMConfig -> a config.json dict that transformers' InternVLForConditionalGeneration loads as is."""
    v, t = cfg.vision, cfg.text
    if t.arch == "qwen2" and not t.qkv_bias:
        raise LiteVLMError(
            "transformers' Qwen2 always has q/k/v biases: export a qkv_bias=False decoder with arch='llama'"
        )
    if t.arch == "llama" and t.qkv_bias:
        raise LiteVLMError(
            "transformers' Llama attention_bias also adds an o_proj bias: "
            "export a qkv_bias=True decoder with arch='qwen2'"
        )
    text = {
        "model_type": t.arch,
        "vocab_size": t.vocab_size,
        "hidden_size": t.hidden_size,
        "intermediate_size": t.intermediate_size,
        "num_hidden_layers": t.num_layers,
        "num_attention_heads": t.num_heads,
        "num_key_value_heads": t.num_kv_heads,
        "head_dim": t.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": t.max_position_embeddings,
        "rms_norm_eps": t.norm_eps,
        "rope_theta": t.rope_theta,  # 4.x readers
        "rope_parameters": {"rope_type": "default", "rope_theta": t.rope_theta},  # transformers 5
        "tie_word_embeddings": t.tie_embeddings,
        "eos_token_id": cfg.eos_token_id,
        "pad_token_id": cfg.pad_token_id,
        "bos_token_id": None,
    }
    if t.arch == "llama":
        text.update(attention_bias=t.qkv_bias, mlp_bias=False)
    else:
        text.update(use_sliding_window=False, sliding_window=None)
    return {
        "architectures": ["InternVLForConditionalGeneration"],
        "model_type": "internvl",
        "dtype": "float32",  # save_hf writes the model's actual dtype
        "vision_config": {
            "model_type": "internvl_vision",
            "hidden_size": v.hidden_size,
            "num_hidden_layers": v.num_layers,
            "num_attention_heads": v.num_heads,
            "intermediate_size": v.intermediate_size,
            "hidden_act": v.hidden_act,
            "image_size": [v.image_size, v.image_size],
            "patch_size": [v.patch_size, v.patch_size],
            "num_channels": 3,
            "attention_bias": v.qkv_bias,
            "use_qk_norm": v.qk_norm,
            "norm_type": v.norm_type,
            "layer_norm_eps": v.norm_eps,
            "layer_scale_init_value": v.layer_scale_init,
            "use_mean_pooling": True,
            "use_absolute_position_embeddings": True,
            "use_mask_token": False,
        },
        "text_config": text,
        "image_token_id": cfg.image_token_id,
        "image_seq_length": cfg.tokens_per_tile,
        "downsample_ratio": cfg.downsample_ratio,
        "projector_hidden_act": cfg.projector_act,
        "vision_feature_layer": -1,
        "vision_feature_select_strategy": "default",
        "tie_word_embeddings": t.tie_embeddings,
        "litevlm": {f: getattr(cfg, f) for f in (*SPECIAL_TOKEN_FIELDS, "tiles_per_view", "name")},
    }


# ================================================================================================
# Processor: tiling, normalisation and the chat template, as transformers' InternVLProcessor reads them
# ================================================================================================
PROCESSOR_CLASS = "InternVLProcessor"
VIDEO_TOKEN = "<video>"  # InternVLProcessor needs the name; tokenizers without it get it added when they load
# The names InternVLProcessor reads from the tokenizer (tokenizer_config.json's extra_special_tokens).
IMAGE_TOKEN_NAMES = {
    "start_image_token": "<img>",
    "end_image_token": "</img>",
    "context_image_token": IMAGE_MARK,
    "video_token": VIDEO_TOKEN,
}
# transformers' InternVL chat template with ChatML turns: an image item is written as <IMG_CONTEXT> and a line
# break, a text item as its text, a string content as it is (litevlm's own prompts), no default system turn.
CHAT_TEMPLATE = (
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)


def chat_template_for(fmt: PromptFormat) -> str:
    """The chat template that renders `fmt`'s prompts: the checkpoint's own (else `CHAT_TEMPLATE`), with `fmt`'s
    system message as the system turn of a conversation that brings none."""
    template = fmt.chat_template if fmt.chat_template is not None else CHAT_TEMPLATE
    if fmt.system is None:
        return template
    # repr() is a valid Jinja string literal (Jinja reads Python's escapes)
    system = "{'role': 'system', 'content': " + repr(fmt.system) + "}"
    default = "{% if messages[0]['role'] != 'system' %}{% set messages = [" + system + "] + messages %}{% endif %}"
    return default + template


def image_processor_config(cfg: VLMConfig, tiling: Tiling) -> dict:
    """InternVL's image processor (transformers' GotOcr2ImageProcessor) set to cut a view as `tiling` does: tiles of
    the vision tower's size, PIL's bicubic resize, scaled to [0, 1] and normalised by ImageNet's mean and std."""
    size = cfg.vision.image_size
    if tiling.max_tiles:  # InternVL's dynamic tiling: the closest grid of 1 .. max tiles
        crop, low, high = True, 1, tiling.max_tiles
    else:  # a fixed count: the grid of exactly that many tiles (one tile: a plain resize)
        crop, low, high = tiling.tiles > 1, tiling.tiles, tiling.tiles
    return {
        "crop_to_patches": crop,
        "do_convert_rgb": True,
        "do_normalize": True,
        "do_rescale": True,
        "do_resize": True,
        "image_mean": list(IMAGENET_MEAN),
        "image_processor_type": "GotOcr2ImageProcessor",
        "image_std": list(IMAGENET_STD),
        "max_patches": high,
        "min_patches": low,
        "resample": 3,  # PIL's bicubic
        "rescale_factor": 1 / 255,
        "size": {"height": size, "width": size},
    }


def processor_tiling_note(tiling: Tiling) -> str | None:
    """Where transformers' image processor cannot cut a view as `tiling` does, why (None where it can).

    GotOcr2's processor adds a thumbnail tile to every image it cuts into more than one tile, and for a fixed count
    it picks the grid of that many tiles closest to the image's aspect ratio, where litevlm cuts them side by side."""
    if not tiling.max_tiles and tiling.tiles == 1:
        return None
    problems = []
    if not tiling.thumbnail:
        problems.append("transformers' image processor adds a thumbnail tile to every view it cuts into more tiles")
    if not tiling.max_tiles and tiling.tiles > 2:
        problems.append(
            f"it picks the grid of {tiling.tiles} tiles closest to the image's shape where litevlm cuts "
            f"{tiling.tiles} side by side"
        )
    if not problems:
        return None
    kind = f"dynamic tiling up to {tiling.max_tiles}" if tiling.max_tiles else f"{tiling.tiles} tiles a view"
    return (
        f"the model was trained on {kind}{', with' if tiling.thumbnail else ', without'} a thumbnail, and "
        + " and ".join(problems)
        + ": with transformers, give generate the pixel_values litevlm cuts (Pipeline.tiles) and as many "
        "<IMG_CONTEXT> a view as it makes"
    )


def _write_processor(d: Path, cfg: VLMConfig, fmt: PromptFormat) -> None:
    """The processor's files as transformers 5 saves them: processor_config.json (the image processor nested in it,
    and a video processor, without which AutoProcessor does not load), preprocessor_config.json (the image processor
    alone, for older readers), chat_template.jinja, and the image tokens' names in tokenizer_config.json if there is
    one (its own chat template moved to chat_template.jinja)."""
    image = image_processor_config(cfg, fmt.tiling)
    video = {k: image[k] for k in ("do_convert_rgb", "do_normalize", "do_rescale", "do_resize", "image_mean")}
    video |= {"image_std": image["image_std"], "resample": 3, "rescale_factor": 1 / 255, "size": image["size"]}
    video |= {"initial_shift": True, "video_processor_type": "InternVLVideoProcessor"}
    _write_json(
        d / "processor_config.json",
        {
            "image_processor": image,
            "image_seq_length": cfg.tokens_per_tile,
            "processor_class": PROCESSOR_CLASS,
            "video_processor": video,
        },
    )
    _write_json(d / "preprocessor_config.json", image | {"processor_class": PROCESSOR_CLASS})
    (d / "chat_template.jinja").write_text(chat_template_for(fmt), encoding="utf-8")
    (d / "chat_template.json").unlink(missing_ok=True)  # superseded by chat_template.jinja
    tc_path = d / "tokenizer_config.json"
    if tc_path.is_file():
        tc = _read_json(tc_path)
        tc.pop("chat_template", None)
        named = tc.get("extra_special_tokens")
        if isinstance(named, list):  # transformers 5's list of unnamed special tokens: kept as such
            extra = tc.get("additional_special_tokens") or []
            tc["additional_special_tokens"] = extra + [t for t in named if t not in extra]
        tc["extra_special_tokens"] = (named if isinstance(named, dict) else {}) | IMAGE_TOKEN_NAMES
        tc["processor_class"] = PROCESSOR_CLASS
        _write_json(tc_path, tc)


# ================================================================================================
# Files
# ================================================================================================
def _read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except json.JSONDecodeError as e:
        raise LiteVLMError(f"{path} is not valid JSON: {e}") from None


def _checkpoint_dir(path) -> Path:
    p = Path(path)
    if not p.is_dir():
        raise LiteVLMError(f"checkpoint directory not found: {p}")
    if not (p / "config.json").is_file():
        raise LiteVLMError(f"{p} has no config.json: point at the checkpoint directory (the one holding config.json)")
    return p


def _weight_files(d: Path) -> list[Path]:
    """The safetensors files of a checkpoint: index.json's shards, model.safetensors, or every *.safetensors."""
    index = d / "model.safetensors.index.json"
    if index.is_file():
        shards = sorted(set(_read_json(index).get("weight_map", {}).values()))
        missing = [s for s in shards if not (d / s).is_file()]
        if not shards or missing:
            raise LiteVLMError(f"{index} names shard files that are not there: {missing or 'none listed'}")
        return [d / s for s in shards]
    if (d / "model.safetensors").is_file():
        return [d / "model.safetensors"]
    files = sorted(d.glob("*.safetensors"))
    if files:
        return files
    pickles = sorted(p.name for p in d.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise LiteVLMError(
            f"{d} holds only pickle checkpoints ({', '.join(pickles)}); litevlm refuses them because unpickling can "
            "run arbitrary code. Convert once, in an environment where you trust the file: load it with transformers "
            "(InternVLForConditionalGeneration.from_pretrained(dir)) and call .save_pretrained(out_dir), which writes "
            "model.safetensors."
        )
    raise LiteVLMError(f"{d} has no model.safetensors (nor a model.safetensors.index.json with shards)")


def _header_keys(files: list[Path]) -> dict[str, Path]:
    """Tensor name -> file, from the safetensors headers only."""
    where: dict[str, Path] = {}
    for f in files:
        try:
            with safe_open(str(f), framework="pt") as h:
                for k in h.keys():
                    if k in where:
                        raise LiteVLMError(f"tensor {k} appears in both {where[k].name} and {f.name}")
                    where[k] = f
        except (SafetensorError, OSError) as e:
            raise LiteVLMError(f"cannot read the safetensors header of {f}: {e}") from None
    return where


def _special_ids_from_tokenizer(d: Path) -> dict[str, int]:
    """Ids of <img>, </img>, <|im_end|>, <IMG_CONTEXT> and the pad token from tokenizer.json / tokenizer_config.json."""
    by_text: dict[str, int] = {}
    pad_text = None
    if (d / "tokenizer.json").is_file():
        tok = _read_json(d / "tokenizer.json")
        for t in tok.get("added_tokens", []):
            by_text[t["content"]] = int(t["id"])
        vocab = (tok.get("model") or {}).get("vocab")
        if isinstance(vocab, dict):
            for s in TOKEN_STRINGS.values():
                if s in vocab and s not in by_text:
                    by_text[s] = int(vocab[s])
    if (d / "tokenizer_config.json").is_file():
        tc = _read_json(d / "tokenizer_config.json")
        for i, t in (tc.get("added_tokens_decoder") or {}).items():
            by_text.setdefault(t["content"], int(i))
        pad_text = tc.get("pad_token")
        pad_text = pad_text.get("content") if isinstance(pad_text, dict) else pad_text
    if (d / "added_tokens.json").is_file():
        for s, i in _read_json(d / "added_tokens.json").items():
            by_text.setdefault(s, int(i))
    out = {f: by_text[s] for f, s in TOKEN_STRINGS.items() if s in by_text}
    if pad_text in by_text:
        out["pad_token_id"] = by_text[pad_text]
    return out


@contextlib.contextmanager
def _atomic_dir(out_dir) -> Iterator[Path]:
    """Yield a temp dir beside `out_dir`; on success it replaces `out_dir`, on failure it is removed."""
    out = Path(out_dir).resolve()
    if out.exists():
        if not out.is_dir():
            raise LiteVLMError(f"{out} exists and is not a directory")
        if any(out.iterdir()) and not ((out / "config.json").exists() or any(out.glob("*.safetensors"))):
            raise LiteVLMError(f"{out} is a non-empty directory that is not a checkpoint; refusing to replace it")
    out.parent.mkdir(parents=True, exist_ok=True)
    tag = uuid.uuid4().hex[:8]
    tmp = out.parent / f".{out.name}.tmp-{tag}"
    tmp.mkdir()
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    old = out.parent / f".{out.name}.old-{tag}"
    had_old = out.exists()
    if had_old:
        os.replace(out, old)
    try:
        os.replace(tmp, out)
    except OSError:
        if had_old:
            os.replace(old, out)
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    shutil.rmtree(old, ignore_errors=True)


_DTYPES = {"F64": torch.float64, "F32": torch.float32, "F16": torch.float16, "BF16": torch.bfloat16}


def _stored_dtype(where: dict[str, Path]) -> torch.dtype:
    """The floating dtype the checkpoint's tensors are stored in (from the headers), float32 if none."""
    for f in sorted(set(where.values())):
        with safe_open(str(f), framework="pt") as h:
            for k in h.keys():
                kind = h.get_slice(k).get_dtype()
                if kind in _DTYPES:
                    return _DTYPES[kind]
    return torch.float32


def _write_json(path: Path, d: dict) -> None:
    path.write_text(json.dumps(d, indent=2, sort_keys=False) + "\n", encoding="utf-8")


def _copy_tokenizer_files(src: Path | None, dst: Path) -> None:
    if src is None:
        return
    for name in TOKENIZER_FILES:
        if (src / name).is_file():
            shutil.copy2(src / name, dst / name)


def _save_tensors(tensors: dict[str, torch.Tensor], path: Path, metadata: dict | None = None) -> None:
    # Own contiguous copies: safetensors refuses views and shared storage.
    save_file(
        {k: v.detach().to("cpu").contiguous().clone() for k, v in tensors.items()},
        str(path),
        metadata={"format": "pt", **(metadata or {})},
    )


# ================================================================================================
# Key mapping and strict loading
# ================================================================================================
# A checkpoint key maps to (our key, transform) where transform turns the file's tensor into ours;
# fused tensors (ViT qkv, InternLM2 wqkv) map to several of our keys.
Mapping = dict[str, list[tuple[str, Callable[[torch.Tensor], torch.Tensor]]]]


def _same(x: torch.Tensor) -> torch.Tensor:
    return x


def _rows(i: int, n: int) -> Callable[[torch.Tensor], torch.Tensor]:
    """The i-th of n equal row blocks (an unfused q, k or v)."""

    def take(x: torch.Tensor) -> torch.Tensor:
        c = x.shape[0] // n
        return x[i * c : (i + 1) * c]

    return take


def _wqkv(cfg: TextConfig, part: str) -> Callable[[torch.Tensor], torch.Tensor]:
    """InternLM2's fused wqkv: rows grouped per KV head as [q_0 .. q_{g-1}, k, v] (research section 4.4)."""
    g, d = cfg.num_heads // cfg.num_kv_heads, cfg.head_dim

    def take(w: torch.Tensor) -> torch.Tensor:
        if w.ndim != 2 or w.shape[0] != cfg.num_kv_heads * (g + 2) * d:
            return w  # wrong size: reported by the shape check, naming the tensor
        w = w.reshape(cfg.num_kv_heads, g + 2, d, w.shape[-1])  # (Hkv, g+2, D, C)
        sel = {"q": w[:, :g], "k": w[:, g : g + 1], "v": w[:, g + 1 :]}[part]
        return sel.reshape(-1, w.shape[-1])  # (Hkv*g*D or Hkv*D, C)

    return take


def _family(keys) -> str:
    """Which naming a checkpoint uses, read from its tensor names."""
    ks = list(keys)
    found = {
        "new": any(k.startswith(("model.language_model.", "model.vision_tower.")) for k in ks),
        "legacy": any(k.startswith(("language_model.model.", "vision_tower.", "multi_modal_projector.")) for k in ks)
        and not any(k.startswith(("vision_model.", "mlp1.")) for k in ks),
        "original": any(k.startswith(("vision_model.", "mlp1.")) for k in ks),
    }
    hits = [f for f, ok in found.items() if ok]
    if len(hits) != 1:
        sample = ", ".join(sorted(ks)[:5])
        raise LiteVLMError(
            f"cannot tell the checkpoint's naming ({'mixed: ' + ', '.join(hits) if hits else 'none recognised'}); "
            f"first tensors: {sample}. Expected transformers InternVL names "
            "(vision_tower., language_model.model., ...) "
            "or the original OpenGVLab names (vision_model., mlp1., language_model.)"
        )
    return hits[0]


def _map_hf(key: str, family: str) -> str:
    """One on-disk transformers name -> our name (unknown prefixes pass through and end up 'unexpected')."""
    if family == "new":
        if key.startswith("model."):
            return key[len("model.") :]
        return key  # lm_head.weight
    if key.startswith("language_model.model."):
        return "language_model." + key[len("language_model.model.") :]
    if key == "language_model.lm_head.weight":
        return "lm_head.weight"
    return key


_ORIG_VIT = (
    ("vision_model.embeddings.class_embedding", "vision_tower.embeddings.cls_token"),
    ("vision_model.embeddings.position_embedding", "vision_tower.embeddings.position_embeddings"),
    ("vision_model.embeddings.patch_embedding.", "vision_tower.embeddings.patch_embeddings.projection."),
    ("vision_model.encoder.layers.", "vision_tower.encoder.layer."),
    ("mlp1.0.", "multi_modal_projector.layer_norm."),
    ("mlp1.1.", "multi_modal_projector.linear_1."),
    ("mlp1.3.", "multi_modal_projector.linear_2."),
)
_ORIG_VIT_LAYER = (
    (".attn.proj.", ".attention.projection_layer."),
    (".attn.q_norm.", ".attention.q_norm."),
    (".attn.k_norm.", ".attention.k_norm."),
    (".norm1.", ".layernorm_before."),
    (".norm2.", ".layernorm_after."),
    (".ls1", ".lambda_1"),
    (".ls2", ".lambda_2"),
)
_INTERNLM2 = (
    (".attention.wo.", ".self_attn.o_proj."),
    (".feed_forward.w1.", ".mlp.gate_proj."),
    (".feed_forward.w3.", ".mlp.up_proj."),
    (".feed_forward.w2.", ".mlp.down_proj."),
    (".attention_norm.", ".input_layernorm."),
    (".ffn_norm.", ".post_attention_layernorm."),
)


def _map_original(key: str, cfg: VLMConfig) -> list[tuple[str, Callable]]:
    """One original remote-code name -> our names (several for fused q/k/v)."""
    out = key
    for a, b in _ORIG_VIT:
        if out.startswith(a):
            out = b + out[len(a) :]
            break
    if out.startswith("vision_tower.encoder.layer."):
        if ".attn.qkv." in out:
            return [(out.replace(".attn.qkv.", f".attention.{p}_proj."), _rows(i, 3)) for i, p in enumerate("qkv")]
        for a, b in _ORIG_VIT_LAYER:
            out = out.replace(a, b)
        return [(out, _same)]
    if key in ("language_model.lm_head.weight", "language_model.output.weight"):
        return [("lm_head.weight", _same)]
    if key.startswith("language_model.model."):
        out = "language_model." + key[len("language_model.model.") :]
        out = out.replace("language_model.tok_embeddings.", "language_model.embed_tokens.")
        if ".attention.wqkv." in out:
            return [(out.replace(".attention.wqkv.", f".self_attn.{p}_proj."), _wqkv(cfg.text, p)) for p in "qkv"]
        for a, b in _INTERNLM2:
            out = out.replace(a, b)
    return [(out, _same)]


def _build_mapping(where: dict[str, Path], cfg: VLMConfig) -> Mapping:
    family = _family(where)
    mapping: Mapping = {}
    for k in where:
        if family == "original":
            mapping[k] = _map_original(k, cfg)
        else:
            mapping[k] = [(_map_hf(k, family), _same)]
    return mapping


def _shape(s) -> str:
    return "(" + ", ".join(str(int(x)) for x in s) + (",)" if len(s) == 1 else ")")


def _listing(names: list[str], limit: int = 12) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f", ... ({len(names) - limit} more)" if len(names) > limit else "")


def _load_strict(cfg: VLMConfig, where: dict[str, Path], mapping: Mapping, dtype, device, src: Path) -> VLM:
    """Build the model without allocating random weights, then fill every tensor from the files, strictly."""
    with torch.device("meta"):
        model = VLM(cfg)
    expected = {k: tuple(v.shape) for k, v in model.state_dict().items()}
    tied = cfg.text.tie_embeddings
    if tied:
        expected.pop("lm_head.weight", None)
    ignorable = {"vision_tower.embeddings.mask_token"}  # transformers' use_mask_token: unused at inference

    targets: dict[str, tuple[str, Callable]] = {}
    unexpected, dup = [], []
    for ck, outs in mapping.items():
        for ours, fn in outs:
            if ours in ignorable:
                continue
            if ours == "lm_head.weight" and tied:
                targets.setdefault("__tied_head__", (ck, fn))
                continue
            if ours not in expected:
                unexpected.append(ck)
            elif ours in targets:
                dup.append(f"{ours} (from {targets[ours][0]} and {ck})")
            else:
                targets[ours] = (ck, fn)
    missing = sorted(set(expected) - set(targets))
    problems = []
    if missing:
        hint = (
            " (a checkpoint without lm_head.weight has a tied head: set tie_word_embeddings true)"
            if missing == ["lm_head.weight"]
            else ""
        )
        problems.append(f"missing tensors ({len(missing)}): {_listing(missing)}{hint}")
    if unexpected:
        problems.append(f"unexpected tensors ({len(unexpected)}): {_listing(sorted(unexpected))}")
    if dup:
        problems.append(f"tensors given twice: {_listing(dup)}")
    if problems:
        raise LiteVLMError(
            f"checkpoint {src} does not match its config ({cfg.text.arch}, {cfg.text.num_layers} text layers, "
            f"{cfg.vision.num_layers} vision layers, tied head={tied}): " + "; ".join(problems)
        )

    state, bad = {}, []
    handles: dict[Path, object] = {}
    with contextlib.ExitStack() as stack:
        for f in set(where.values()):
            handles[f] = stack.enter_context(safe_open(str(f), framework="pt", device="cpu"))
        for ours, (ck, fn) in targets.items():
            t = fn(handles[where[ck]].get_tensor(ck))
            if ours == "__tied_head__":
                state[ours] = t
                continue
            if tuple(t.shape) != expected[ours]:
                name = ours if ours == ck else f"{ours} (checkpoint key {ck})"
                bad.append(
                    f"tensor {name} has shape {_shape(t.shape)} in the checkpoint "
                    f"but the config expects {_shape(expected[ours])}"
                )
                continue
            state[ours] = t.to(device=device, dtype=dtype if t.is_floating_point() else t.dtype).contiguous()
    if bad:
        raise LiteVLMError(f"checkpoint {src} does not match its config: " + "; ".join(bad))
    head = state.pop("__tied_head__", None)
    if head is not None and not torch.equal(head.to(dtype), state["language_model.embed_tokens.weight"].to("cpu")):
        raise LiteVLMError(
            f"checkpoint {src}: the config ties lm_head to embed_tokens (tie_word_embeddings=true) "
            "but the file holds a different lm_head.weight; set tie_word_embeddings to false in config.json to keep it"
        )
    if tied:
        state["lm_head.weight"] = state["language_model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if tied:  # assign=True replaced both Parameters: make them one again
        model.lm_head.weight = model.language_model.embed_tokens.weight
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise RuntimeError(f"internal error: tensors left uninitialised after loading: {left}")
    return model.eval()


# ================================================================================================
# Public API
# ================================================================================================
def load_hf(path, dtype: torch.dtype = torch.float32, device="cpu") -> tuple[VLM, Path | None]:
    """Load a transformers-native (or original remote-code) InternVL checkpoint directory.

    Returns the model (eval mode) and the directory holding tokenizer.json, or None if there is none.
    """
    d = _checkpoint_dir(path)
    where = _header_keys(_weight_files(d))
    tok_ids = _special_ids_from_tokenizer(d)
    gen = _read_json(d / "generation_config.json") if (d / "generation_config.json").is_file() else {}
    raw = _read_json(d / "config.json")
    cfg = config_from_hf(raw, tok_ids, gen)
    if cfg.name in ("hf-import", "original-import"):
        cfg.name = d.name
    model = _load_strict(cfg, where, _build_mapping(where, cfg), dtype, device, d)
    return model, (d if (d / "tokenizer.json").is_file() else None)


def save_hf(model: VLM, out_dir, tokenizer=None, prompt_format: PromptFormat | None = None) -> Path:
    """Write a transformers-loadable checkpoint: config.json, model.safetensors (legacy on-disk names, as
    save_pretrained writes them), generation_config.json and, if given, the tokenizer (`tokenizer.save(dir)`);
    with `prompt_format` (the prompt the model was trained with), also the processor's files (module docstring),
    warning where transformers' image processor cannot cut its tiles (`processor_tiling_note`).

    The directory is written beside `out_dir` and renamed into place, so a failure never leaves a
    half-written checkpoint over an existing one.
    """
    with _atomic_dir(out_dir) as tmp:
        _save_hf_into(model, tmp, tokenizer, prompt_format)
    return Path(out_dir)


def _save_hf_into(model: VLM, d: Path, tokenizer=None, prompt_format: PromptFormat | None = None) -> None:
    cfg = model.cfg
    hf_cfg = config_to_hf(cfg)
    hf_cfg["dtype"] = str(model.dtype).removeprefix("torch.")
    tensors = {}
    for k, v in model.state_dict().items():
        if k == "lm_head.weight":
            if cfg.text.tie_embeddings:
                continue
            tensors["language_model.lm_head.weight"] = v
        elif k.startswith("language_model."):
            tensors["language_model.model." + k[len("language_model.") :]] = v  # (Qwen2|Llama)ForCausalLM layout
        else:
            tensors[k] = v
    _save_tensors(tensors, d / "model.safetensors")
    _write_json(d / "config.json", hf_cfg)
    _write_json(d / "generation_config.json", {"eos_token_id": cfg.eos_token_id, "pad_token_id": cfg.pad_token_id})
    if tokenizer is not None:
        tokenizer.save(d)
    if prompt_format is not None:
        _write_processor(d, cfg, prompt_format)
        note = processor_tiling_note(prompt_format.tiling)
        if note:
            warnings.warn(note, stacklevel=3)


def transformers_view(model: VLM):
    """transformers' InternVLForConditionalGeneration holding `model`'s own tensors, no copy: the model a checkpoint
    written by `save_hf` would load as, for comparisons at sizes where a second copy of the weights does not fit (a 2B
    model in fp32 is 9 GB). Its parameters are allocated uninitialised and never touched, then replaced by ours."""
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    try:
        from transformers.initialization import no_init_weights
    except ImportError:  # older 5.x
        from transformers.modeling_utils import no_init_weights

    cfg = config_to_hf(model.cfg)
    cfg["dtype"] = str(model.dtype).removeprefix("torch.")
    ours = model.state_dict()
    with no_init_weights(), torch.device(model.device):
        hf = InternVLForConditionalGeneration(InternVLConfig.from_dict(cfg))
    names = hf.state_dict().keys()
    missing = [k for k in names if _map_hf(k, "new") not in ours]
    if missing:
        raise LiteVLMError(f"transformers' InternVL has tensors this model lacks: {', '.join(missing[:5])}")
    hf.load_state_dict({k: ours[_map_hf(k, "new")] for k in names}, strict=True, assign=True)
    return hf.eval()


def save_native(model: VLM, out_dir, extra_meta: dict | None = None, dtype: torch.dtype | None = None) -> Path:
    """Our checkpoint: config.json = {"litevlm": VLMConfig.to_dict(), "format": "litevlm", **extra_meta} and
    model.safetensors with our parameter names (a tied lm_head is not stored), floating tensors cast
    to `dtype` when given (the model itself is left as it is). Written atomically."""
    with _atomic_dir(out_dir) as tmp:
        _save_native_into(model, tmp, extra_meta, dtype)
    return Path(out_dir)


def _save_native_into(model: VLM, d: Path, extra_meta: dict | None = None, dtype: torch.dtype | None = None) -> None:
    extra_meta = dict(extra_meta or {})
    clash = {"litevlm", "format"} & set(extra_meta)
    if clash:
        raise LiteVLMError(f"extra_meta may not use the reserved keys {sorted(clash)}")
    meta = {"litevlm": model.cfg.to_dict(), "format": NATIVE_FORMAT, **extra_meta}
    text = json.dumps(meta, indent=2)  # fails before any tensor is written if extra_meta is not JSON
    tied = model.cfg.text.tie_embeddings
    tensors = {k: v for k, v in model.state_dict().items() if not (tied and k == "lm_head.weight")}
    if dtype is not None:
        tensors = {k: v.to(dtype) if v.is_floating_point() else v for k, v in tensors.items()}
    _save_tensors(tensors, d / "model.safetensors")
    (d / "config.json").write_text(text + "\n", encoding="utf-8")


def read_native_meta(path) -> dict:
    """config.json of a litevlm checkpoint (the "litevlm" config dict plus whatever extra_meta was saved)."""
    d = _checkpoint_dir(path)
    meta = _read_json(d / "config.json")
    if "litevlm" not in meta:
        raise LiteVLMError(
            f"{d} is not a litevlm checkpoint (its config.json has no 'litevlm' entry); "
            "for a transformers InternVL checkpoint use load_hf, or convert it with hf_to_litevlm"
        )
    return meta


def load_native(path, dtype: torch.dtype | None = None, device="cpu") -> VLM:
    """Load our own checkpoint directory (save_native), with the same strict, named checks as load_hf."""
    d = Path(path)
    meta = read_native_meta(d)
    if "fp8" in meta:
        raise LiteVLMError(
            f"{d} is an FP8 checkpoint ({meta['fp8']['recipe']['name']}): load it with "
            "litevlm.quant.fp8.load_fp8 (Pipeline.from_pretrained does)"
        )
    try:
        cfg = VLMConfig.from_dict(meta["litevlm"])
    except (TypeError, ValueError) as e:
        raise LiteVLMError(f"{d}/config.json holds an invalid litevlm config: {e}") from None
    files = _weight_files(d)
    where = _header_keys(files)
    if dtype is None:
        dtype = _stored_dtype(where)
    mapping: Mapping = {k: [(k, _same)] for k in where}
    return _load_strict(cfg, where, mapping, dtype, device, d)


def hf_to_litevlm(src, dst) -> Path:
    """Convert a transformers InternVL checkpoint to our format (dtype kept), carrying the tokenizer files along."""
    d = _checkpoint_dir(src)
    if _read_json(d / "config.json").get("format") == NATIVE_FORMAT:
        raise LiteVLMError(f"{d} is a litevlm checkpoint already; litevlm_to_hf converts it to transformers'")
    model, _ = load_hf(d, dtype=_stored_dtype(_header_keys(_weight_files(d))))
    with _atomic_dir(dst) as tmp:
        _save_native_into(model, tmp, {"converted_from": str(d.resolve())})
        _copy_tokenizer_files(d, tmp)
    return Path(dst)


def litevlm_to_hf(src, dst) -> Path:
    """Convert our checkpoint to a transformers InternVL checkpoint as transformers saves one (module docstring):
    the weights, the tokenizer files, and the processor set to the prompt format the model was trained with (its
    prompt.json, kept beside for litevlm; else its chat template and fixed tiles a view)."""
    model = load_native(src)
    src = Path(src)
    fmt = read_format(src, tiles=model.cfg.tiles_per_view)
    with _atomic_dir(dst) as tmp:
        _copy_tokenizer_files(src, tmp)
        _save_hf_into(model, tmp, prompt_format=fmt)
        if (src / PROMPT_FILE).is_file():
            shutil.copy2(src / PROMPT_FILE, tmp / PROMPT_FILE)
    return Path(dst)
