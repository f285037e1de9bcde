"""Our VLM against transformers' InternVLForConditionalGeneration on tiny random configs (fp32, CPU).

Each config is built in transformers, every parameter re-randomised (HF zero-initialises cls/position
embeddings and sets norms to 1), saved with `save_pretrained` (the on-disk layout real `-hf`
checkpoints use) and loaded with `load_hf`. Logits and greedy generations must match; our export
must load back into transformers; the other key layouts, shards and broken checkpoints are checked too.
"""

from __future__ import annotations

import copy
import json

import pytest
import torch

transformers = pytest.importorskip("transformers")

from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402

from litevlm.config import PRESETS  # noqa: E402
from litevlm.errors import LiteVLMError  # noqa: E402
from litevlm.model.generate import generate  # noqa: E402
from litevlm.model.hf import (  # noqa: E402
    config_from_hf,
    config_to_hf,
    hf_to_litevlm,
    litevlm_to_hf,
    load_hf,
    load_native,
    read_native_meta,
    save_hf,
    save_native,
)

# Tiny HF checkpoints carry no tokenizer, so load_hf warns that <img>/</img>/eos/pad ids are unknown.
pytestmark = pytest.mark.filterwarnings("ignore:the checkpoint names no")

IMG = 319  # image_token_id in every tiny config: the last id of a 320-token vocabulary
NEW_TOKENS = 32
# Ours against transformers' modules (eager attention, other kernels): fp32 sums of up to 256 terms in another order
# through a few layers, ~256 eps ~ 3e-5 of the largest logit; 1e-4 leaves room, a mapping error is O(1).
REL_TOL = 1e-4

VISION = dict(
    hidden_size=64,
    num_hidden_layers=2,
    num_attention_heads=4,
    intermediate_size=128,
    image_size=56,
    patch_size=14,
    layer_norm_eps=1e-6,
    layer_scale_init_value=0.1,
    use_mean_pooling=True,
)
TEXT = dict(
    vocab_size=320,
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    max_position_embeddings=256,
)

# Three configs that differ the way real checkpoints do.
CONFIGS = {
    # InternVL3-like: Qwen2 with qkv bias and GQA, untied head; InternViT-300M-like vision.
    "qwen2_gqa": dict(
        vision=dict(VISION, attention_bias=True, use_qk_norm=False, norm_type="layer_norm", hidden_act="gelu"),
        text=dict(
            TEXT,
            model_type="qwen2",
            num_key_value_heads=2,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
        ),
        tie=False,
        projector_act="gelu",
        tiles=2,
    ),
    # InternVL2.5-2B-like: InternLM2 converted to Llama (no bias, eps 1e-5), tied head; 6B-ViT-like qk-norm + RMSNorm.
    "llama_tied": dict(
        vision=dict(VISION, attention_bias=False, use_qk_norm=True, norm_type="rms_norm", hidden_act="gelu"),
        text=dict(
            TEXT,
            model_type="llama",
            num_key_value_heads=4,
            rope_theta=1e4,
            rms_norm_eps=1e-5,
            attention_bias=False,
            tie_word_embeddings=True,
        ),
        tie=True,
        projector_act="gelu",
        tiles=2,
    ),
    # Qwen2 with head_dim != hidden/heads, other activations, dynamic RoPE (as real InternVL3 configs), 3 tiles.
    "qwen2_headdim": dict(
        vision=dict(VISION, attention_bias=True, use_qk_norm=False, norm_type="layer_norm", hidden_act="quick_gelu"),
        text=dict(
            TEXT,
            model_type="qwen2",
            num_key_value_heads=1,
            head_dim=24,
            rms_norm_eps=1e-6,
            tie_word_embeddings=False,
            rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 1e6},
        ),
        tie=False,
        projector_act="gelu_pytorch_tanh",
        tiles=3,
    ),
}


def hf_config(spec: dict):
    return transformers.InternVLConfig(
        vision_config=spec["vision"],
        text_config=spec["text"],
        image_token_id=IMG,
        image_seq_length=4,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act=spec["projector_act"],
        tie_word_embeddings=spec["tie"],
    )


def randomise(model: torch.nn.Module, seed: int) -> None:
    """Every parameter random: norm weights 1 + N(0, 0.1), everything else N(0, 0.2).

    std 0.2 keeps greedy decoding from collapsing into one repeated token (at 0.08 the tied model
    repeats a single token), so the generation test compares a varied sequence.
    """
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name and name.endswith("weight") else 0.2 * noise)


def prompt(n_image_tokens: int, seed: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    head, tail = torch.randint(0, IMG, (5,), generator=g), torch.randint(0, IMG, (7,), generator=g)
    return torch.cat([head, torch.full((n_image_tokens,), IMG), tail])[None]  # (1, L)


def pixels(tiles: int, seed: int) -> torch.Tensor:
    return torch.randn(tiles, 3, 56, 56, generator=torch.Generator().manual_seed(seed))


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a - b).abs().max() / a.abs().max())


@pytest.fixture(scope="module", params=list(CONFIGS))
def pair(request, tmp_path_factory):
    """(spec, HF model, our model, HF checkpoint dir) for one config."""
    spec = CONFIGS[request.param]
    torch.manual_seed(0)
    hf = transformers.InternVLForConditionalGeneration._from_config(
        copy.deepcopy(hf_config(spec)), attn_implementation="eager"
    )
    randomise(hf, seed=list(CONFIGS).index(request.param))
    hf.eval()
    ckpt = tmp_path_factory.mktemp(f"hf_{request.param}")
    hf.save_pretrained(ckpt)
    with pytest.warns(UserWarning, match="img_start_id, img_end_id"):
        ours, tok_dir = load_hf(ckpt)
    assert tok_dir is None
    return spec, hf, ours, ckpt


def _logits_cases(spec):
    per_tile = 4
    return [
        (prompt(per_tile, 1), pixels(1, 1)),
        (prompt(per_tile * spec["tiles"], 2), pixels(spec["tiles"], 2)),
        (prompt(0, 3), None),
    ]


@torch.no_grad()
def test_logits_match(pair):
    spec, hf, ours, _ = pair
    assert ours.cfg.text.tie_embeddings == spec["tie"]
    assert (ours.lm_head.weight is ours.language_model.embed_tokens.weight) == spec["tie"]
    for ids, pix in _logits_cases(spec):
        ref = hf(input_ids=ids, pixel_values=pix).logits
        assert rel_err(ref, ours(ids, pix)) <= REL_TOL


@torch.no_grad()
def test_vision_features_match(pair):
    spec, hf, ours, _ = pair
    pix = pixels(spec["tiles"], 4)
    ref = hf.model.get_image_features(pixel_values=pix).pooler_output  # (T, tokens, C)
    assert rel_err(ref.reshape(-1, ref.shape[-1]), ours.encode_tiles(pix).reshape(-1, ref.shape[-1])) <= REL_TOL


@pytest.mark.parametrize("cache", ["dynamic", "static"])
@torch.no_grad()
def test_greedy_generation_matches(pair, cache):
    spec, hf, ours, _ = pair
    ids, pix = prompt(4 * spec["tiles"], 5), pixels(spec["tiles"], 5)
    kw = {"cache_implementation": "static"} if cache == "static" else {}
    out = hf.generate(
        input_ids=ids,
        pixel_values=pix,
        attention_mask=torch.ones_like(ids),
        do_sample=False,
        max_new_tokens=NEW_TOKENS,
        min_new_tokens=NEW_TOKENS,
        pad_token_id=0,
        **kw,
    )
    ref = out[0, ids.shape[1] :].tolist()

    ours.language_model.setup_cache(1, ids.shape[1] + NEW_TOKENS)
    embeds = ours.embed(ids, ours.encode_tiles(pix))  # (1, L, C)
    positions = torch.arange(ids.shape[1])[None]  # (1, L)
    got = generate(ours, embeds, positions, NEW_TOKENS, eos_id=None).tokens
    assert len(ref) == NEW_TOKENS and len(set(ref)) >= 8  # a varied sequence, not one token repeated
    assert got == ref


@torch.no_grad()
def test_export_loads_in_transformers(pair, tmp_path):
    spec, _, ours, _ = pair
    save_hf(ours, tmp_path / "export")
    back, info = transformers.InternVLForConditionalGeneration.from_pretrained(
        tmp_path / "export", attn_implementation="eager", output_loading_info=True
    )
    assert not any(info[k] for k in ("missing_keys", "unexpected_keys", "mismatched_keys")), info
    back.eval()
    assert back.config.tie_word_embeddings == spec["tie"]
    for ids, pix in _logits_cases(spec):
        assert rel_err(back(input_ids=ids, pixel_values=pix).logits, ours(ids, pix)) <= REL_TOL
    # Our special ids ride along in config.json and come back unchanged.
    again, _ = load_hf(tmp_path / "export")
    assert again.cfg == ours.cfg


@torch.no_grad()
def test_the_transformers_view_holds_our_tensors_and_equals_the_export(pair, tmp_path):
    """`transformers_view` (the bench's transformers rows at a preset's shapes, where a second copy of the weights
    does not fit): every tensor is ours, the same storage, and its logits are those of the exported checkpoint."""
    from litevlm.model.hf import transformers_view

    spec, _, ours, _ = pair
    view = transformers_view(ours)
    our_ptrs = {t.data_ptr() for t in ours.state_dict().values()}
    assert all(t.data_ptr() in our_ptrs for t in view.state_dict().values())
    save_hf(ours, tmp_path / "export")
    back = transformers.InternVLForConditionalGeneration.from_pretrained(tmp_path / "export").eval()
    for ids, pix in _logits_cases(spec):
        assert torch.equal(view(input_ids=ids, pixel_values=pix).logits, back(input_ids=ids, pixel_values=pix).logits)


# -- key layouts, shards and broken checkpoints -------------------------------------------------------------
def _tensors(path) -> dict[str, torch.Tensor]:
    with safe_open(str(path), framework="pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def _copy_config(src, dst, **changes) -> None:
    dst.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((src / "config.json").read_text())
    cfg.update(changes)
    (dst / "config.json").write_text(json.dumps(cfg))


def _new_prefix(k: str) -> str:
    if k.startswith("language_model.model."):
        return "model.language_model." + k[len("language_model.model.") :]
    if k == "language_model.lm_head.weight":
        return "lm_head.weight"
    return "model." + k


@torch.no_grad()
def test_new_prefix_family_loads(pair, tmp_path):
    spec, _, ours, ckpt = pair
    _copy_config(ckpt, tmp_path)
    save_file(
        {_new_prefix(k): v for k, v in _tensors(ckpt / "model.safetensors").items()},
        str(tmp_path / "model.safetensors"),
    )
    model, _ = load_hf(tmp_path)
    ids, pix = _logits_cases(spec)[1]
    # the same weights read from another file layout, the same code: equality.
    assert torch.equal(model(ids, pix), ours(ids, pix))


@torch.no_grad()
def test_sharded_checkpoint_loads(pair, tmp_path):
    spec, _, ours, ckpt = pair
    _copy_config(ckpt, tmp_path)
    tensors = _tensors(ckpt / "model.safetensors")
    names = sorted(tensors)
    shards = {
        "model-00001-of-00002.safetensors": names[: len(names) // 2],
        "model-00002-of-00002.safetensors": names[len(names) // 2 :],
    }
    for fname, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, str(tmp_path / fname))
    index = {"metadata": {}, "weight_map": {k: f for f, keys in shards.items() for k in keys}}
    (tmp_path / "model.safetensors.index.json").write_text(json.dumps(index))
    model, _ = load_hf(tmp_path)
    ids, pix = _logits_cases(spec)[0]
    # the same weights read from another file layout, the same code: equality.
    assert torch.equal(model(ids, pix), ours(ids, pix))


def test_wrong_shape_names_tensor_and_shapes(pair, tmp_path):
    _, _, _, ckpt = pair
    _copy_config(ckpt, tmp_path)
    tensors = _tensors(ckpt / "model.safetensors")
    key = "language_model.model.layers.0.self_attn.q_proj.weight"
    right = tuple(tensors[key].shape)
    tensors[key] = torch.zeros(right[0], right[1] // 2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(LiteVLMError) as e:
        load_hf(tmp_path)
    msg = str(e.value)
    assert "language_model.layers.0.self_attn.q_proj.weight" in msg
    assert f"({right[0]}, {right[1] // 2})" in msg and f"({right[0]}, {right[1]})" in msg


def test_missing_and_unexpected_tensors_are_listed(pair, tmp_path):
    _, _, _, ckpt = pair
    _copy_config(ckpt, tmp_path)
    tensors = _tensors(ckpt / "model.safetensors")
    del tensors["vision_tower.encoder.layer.1.mlp.fc2.bias"]
    tensors["language_model.model.layers.9.mlp.up_proj.weight"] = torch.zeros(2, 2)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    with pytest.raises(
        LiteVLMError,
        match=r"missing tensors \(1\): vision_tower.encoder.layer.1.mlp.fc2.bias.*"
        r"unexpected tensors \(1\): language_model.model.layers.9.mlp.up_proj.weight",
    ):
        load_hf(tmp_path)


def test_pickle_only_checkpoint_is_refused(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(config_to_hf(PRESETS["internvl3-1b"]())))
    (tmp_path / "pytorch_model.bin").write_bytes(b"not read")
    with pytest.raises(LiteVLMError, match="pickle.*save_pretrained"):
        load_hf(tmp_path)


def test_tokenizer_files_give_special_ids(pair, tmp_path):
    _, _, _, ckpt = pair
    _copy_config(ckpt, tmp_path)
    (tmp_path / "model.safetensors").symlink_to(ckpt / "model.safetensors")
    added = [
        {"id": 300, "content": "<img>"},
        {"id": 301, "content": "</img>"},
        {"id": 302, "content": "<|im_end|>"},
        {"id": 303, "content": "<|endoftext|>"},
        {"id": IMG, "content": "<IMG_CONTEXT>"},
    ]
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": added, "model": {"vocab": {}}}))
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"pad_token": "<|endoftext|>"}))
    model, tok_dir = load_hf(tmp_path)
    assert tok_dir == tmp_path
    c = model.cfg
    assert (c.img_start_id, c.img_end_id, c.eos_token_id, c.pad_token_id, c.image_token_id) == (300, 301, 302, 303, IMG)


# -- original remote-code layout (OpenGVLab InternVLChatModel) ----------------------------------------------
def _to_original(tensors: dict, spec: dict) -> dict:
    """Rename a transformers checkpoint into the original layout: fused ViT qkv, mlp1, InternLM2 names for llama."""
    out, text = {}, spec["text"]
    vit_renames = [
        ("vision_tower.embeddings.cls_token", "vision_model.embeddings.class_embedding"),
        ("vision_tower.embeddings.position_embeddings", "vision_model.embeddings.position_embedding"),
        ("vision_tower.embeddings.patch_embeddings.projection.", "vision_model.embeddings.patch_embedding."),
        ("vision_tower.encoder.layer.", "vision_model.encoder.layers."),
        ("multi_modal_projector.layer_norm.", "mlp1.0."),
        ("multi_modal_projector.linear_1.", "mlp1.1."),
        ("multi_modal_projector.linear_2.", "mlp1.3."),
    ]
    layer_renames = [
        (".attention.projection_layer.", ".attn.proj."),
        (".attention.q_norm.", ".attn.q_norm."),
        (".attention.k_norm.", ".attn.k_norm."),
        (".layernorm_before.", ".norm1."),
        (".layernorm_after.", ".norm2."),
        (".lambda_1", ".ls1"),
        (".lambda_2", ".ls2"),
    ]
    lm_renames = [
        (".self_attn.o_proj.", ".attention.wo."),
        (".mlp.gate_proj.", ".feed_forward.w1."),
        (".mlp.up_proj.", ".feed_forward.w3."),
        (".mlp.down_proj.", ".feed_forward.w2."),
        (".input_layernorm.", ".attention_norm."),
        (".post_attention_layernorm.", ".ffn_norm."),
        ("model.embed_tokens.", "model.tok_embeddings."),
    ]
    internlm2 = text["model_type"] == "llama"
    for k, v in tensors.items():
        if (
            ".attention.k_proj." in k
            or ".attention.v_proj." in k
            or ".self_attn.k_proj." in k
            or ".self_attn.v_proj." in k
        ):
            continue  # fused below together with q
        n = k
        for a, b in vit_renames:
            n = n.replace(a, b) if n.startswith(a) else n
        if ".attention.q_proj." in k:  # ViT: rows [q; k; v]
            out[n.replace(".attention.q_proj.", ".attn.qkv.")] = torch.cat(
                [v, tensors[k.replace("q_proj", "k_proj")], tensors[k.replace("q_proj", "v_proj")]]
            )
            continue
        for a, b in layer_renames:
            n = n.replace(a, b) if n.startswith("vision_model.") else n
        if internlm2 and n.startswith("language_model."):
            if ".self_attn.q_proj." in k:  # InternLM2 wqkv: per kv head [q_0 .. q_{g-1}, k, v]
                hkv, d = text["num_key_value_heads"], text["hidden_size"] // text["num_attention_heads"]
                q = v.view(hkv, -1, d, v.shape[-1])  # (Hkv, g, D, C)
                kk = tensors[k.replace("q_proj", "k_proj")].view(hkv, 1, d, -1)
                vv = tensors[k.replace("q_proj", "v_proj")].view(hkv, 1, d, -1)
                out[n.replace(".self_attn.q_proj.", ".attention.wqkv.")] = torch.cat([q, kk, vv], 1).reshape(
                    -1, v.shape[-1]
                )
                continue
            for a, b in lm_renames:
                n = n.replace(a, b)
            n = n.replace("language_model.lm_head.", "language_model.output.")
        elif ".self_attn.q_proj." in k:
            out[n] = v
            out[n.replace("q_proj", "k_proj")] = tensors[k.replace("q_proj", "k_proj")]
            out[n.replace("q_proj", "v_proj")] = tensors[k.replace("q_proj", "v_proj")]
            continue
        out[n] = v
    return out


@torch.no_grad()
def test_original_remote_code_layout_loads(pair, tmp_path):
    spec, _, ours, ckpt = pair
    if "head_dim" in spec["text"]:
        pytest.skip("original checkpoints always have head_dim = hidden / heads")
    v, t = spec["vision"], spec["text"]
    original_cfg = {
        "model_type": "internvl_chat",
        "downsample_ratio": 0.5,
        "select_layer": -1,
        "ps_version": "v2",
        "force_image_size": v["image_size"],
        "tie_word_embeddings": spec["tie"],
        "vision_config": {
            "hidden_size": v["hidden_size"],
            "num_hidden_layers": v["num_hidden_layers"],
            "num_attention_heads": v["num_attention_heads"],
            "intermediate_size": v["intermediate_size"],
            "image_size": v["image_size"],
            "patch_size": v["patch_size"],
            "qkv_bias": v["attention_bias"],
            "qk_normalization": v["use_qk_norm"],
            "norm_type": v["norm_type"],
            "layer_norm_eps": v["layer_norm_eps"],
            "hidden_act": v["hidden_act"],
        },
        "llm_config": {
            "architectures": ["InternLM2ForCausalLM" if t["model_type"] == "llama" else "Qwen2ForCausalLM"],
            "vocab_size": t["vocab_size"],
            "hidden_size": t["hidden_size"],
            "intermediate_size": t["intermediate_size"],
            "num_hidden_layers": t["num_hidden_layers"],
            "num_attention_heads": t["num_attention_heads"],
            "num_key_value_heads": t["num_key_value_heads"],
            "rms_norm_eps": t["rms_norm_eps"],
            "rope_theta": t["rope_theta"],
            "max_position_embeddings": t["max_position_embeddings"],
            "rope_scaling": {"type": "dynamic", "factor": 2.0},
            "bias": False,
        },
    }
    (tmp_path / "config.json").write_text(json.dumps(original_cfg))
    save_file(_to_original(_tensors(ckpt / "model.safetensors"), spec), str(tmp_path / "model.safetensors"))
    (tmp_path / "tokenizer.json").write_text(json.dumps({"added_tokens": [{"id": IMG, "content": "<IMG_CONTEXT>"}]}))
    model, _ = load_hf(tmp_path)
    for ids, pix in _logits_cases(spec):
        # our engine twice, on the same weights read from two key layouts: the same code; 1e-6 (~8 eps of the largest
        # logit) allows a fused projection split into its parts to be summed in its own blocking.
        assert rel_err(ours(ids, pix), model(ids, pix)) <= 1e-6


# -- configs ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_preset_config_round_trip(name):
    cfg = PRESETS[name]()
    d = config_to_hf(cfg)
    assert config_from_hf(json.loads(json.dumps(d))) == cfg
    hf_cfg = transformers.InternVLConfig(**{k: v for k, v in d.items() if k != "litevlm"})
    assert hf_cfg.tie_word_embeddings is False and hf_cfg.text_config.model_type == cfg.text.arch


@pytest.mark.parametrize(
    "field, value",
    [
        ("vision_feature_layer", -2),
        ("vision_feature_select_strategy", "full"),
        ("downsample_ratio", 0.25),
        ("projector_hidden_act", "relu"),
        ("model_type", "llava"),
    ],
)
def test_unsupported_config_names_field(field, value):
    d = config_to_hf(PRESETS["internvl3-1b"]())
    d[field] = value
    with pytest.raises(LiteVLMError, match=field):
        config_from_hf(d)


def test_unsupported_text_settings_are_refused():
    d = config_to_hf(PRESETS["internvl2.5-2b"]())
    d["text_config"]["attention_bias"] = True
    with pytest.raises(LiteVLMError, match="text_config.attention_bias"):
        config_from_hf(d)
    d = config_to_hf(PRESETS["internvl3-1b"]())
    d["text_config"]["rope_parameters"] = {"rope_type": "yarn", "factor": 4.0, "rope_theta": 1e6}
    with pytest.raises(LiteVLMError, match="rope_type"):
        config_from_hf(d)


# -- our own checkpoint format ------------------------------------------------------------------------------
@torch.no_grad()
def test_native_round_trip_and_conversions(pair, tmp_path):
    spec, _, ours, ckpt = pair
    save_native(ours, tmp_path / "native", extra_meta={"recipe": {"steps": 3}})
    assert read_native_meta(tmp_path / "native")["recipe"] == {"steps": 3}
    back = load_native(tmp_path / "native")
    assert back.cfg == ours.cfg
    ids, pix = _logits_cases(spec)[1]
    # a save/load round trip of the same code and weights: equality.
    assert torch.equal(back(ids, pix), ours(ids, pix))

    hf_to_litevlm(ckpt, tmp_path / "conv")
    litevlm_to_hf(tmp_path / "conv", tmp_path / "conv_hf")
    again, _ = load_hf(tmp_path / "conv_hf")
    # a conversion round trip of the same code and weights: equality.
    assert torch.equal(again(ids, pix), ours(ids, pix))


def test_native_strict_errors(pair, tmp_path):
    _, _, ours, ckpt = pair
    save_native(ours, tmp_path / "n")
    tensors = _tensors(tmp_path / "n" / "model.safetensors")
    tensors["multi_modal_projector.linear_1.weight"] = tensors["multi_modal_projector.linear_1.weight"][
        :, :8
    ].contiguous()
    save_file(tensors, str(tmp_path / "n" / "model.safetensors"))
    with pytest.raises(LiteVLMError, match=r"multi_modal_projector.linear_1.weight has shape \(64, 8\)"):
        load_native(tmp_path / "n")
    with pytest.raises(LiteVLMError, match="not a litevlm checkpoint"):
        load_native(ckpt)  # a transformers checkpoint


def test_failed_export_keeps_existing_checkpoint(pair, tmp_path):
    _, _, ours, _ = pair
    out = tmp_path / "ck"
    save_native(ours, out)
    before = (out / "model.safetensors").read_bytes()

    class Broken:
        def save(self, d):
            raise OSError("disk full")

    with pytest.raises(OSError):
        save_hf(ours, out, tokenizer=Broken())
    assert (out / "model.safetensors").read_bytes() == before
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ck"]  # no temp dirs left behind
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("mine")
    with pytest.raises(LiteVLMError, match="not a checkpoint"):
        save_native(ours, tmp_path / "notes")
