"""A litevlm model as the two GGUF files llama.cpp's multimodal library (mtmd) loads.

llama.cpp runs an InternVL checkpoint as a text model (here a `qwen2` GGUF: RMSNorm, rotate-half RoPE, GQA, SwiGLU,
optional q/k/v biases, which covers the Llama/InternLM2-style decoders too) beside an "mmproj" GGUF holding the
vision tower and the projector (`clip` architecture, projector type `internvl`). Tensor names, metadata keys and
storage types are the ones llama.cpp's own `convert_hf_to_gguf.py` gives an InternVL checkpoint (its
`InternVisionModel` and `Qwen2Model`), written with its `gguf` package, in f32, f16 or Q8_0:

- 1-D tensors, norms, the class and position embeddings stay f32; the patch embedding is f16 in an f16 file and f32
  otherwise (Q8_0 included); other matrices take the file's type, and a matrix whose rows are not whole Q8_0 blocks
  of 32 falls back to f16, as the converter does.
- One layout differs, on purpose: llama.cpp's InternVL graph appends the class token after the patches and adds the
  position embeddings in stored order, so the rows are stored patches first, class token last. Stored in the
  checkpoint's order (class token first, as the converter does), every patch would get its neighbour's position.
- The tokenizer is written as a GPT-2 style byte-level BPE with the pre-tokenizer llama.cpp knows as the one that
  splits text as ours does (`refact`: each digit alone, then GPT-2's split), its special tokens as control tokens,
  `<|im_start|>` / `<|im_end|>` / the pad token as bos / eos / pad (no bos added: the chat template writes it), and
  the chat template the transformers export writes (`litevlm.model.hf.chat_template_for`: the checkpoint's own, or
  ChatML that takes a message's content as a string or as text and image parts, and its system message).

What mtmd then does that litevlm's prompt does not (`litevlm.model.prompt`), for one camera view:
- Tiling. mtmd cuts an image larger than a tile by llama.cpp's own rule (the tile grid of at most
  `clip.vision.preproc_max_tiles` tiles that keeps the most pixels: written as the checkpoint's tiles per view, so a
  wide view gets litevlm's grid) and always adds a thumbnail of the whole image, last. A two-tile view is thus three
  tiles in mtmd (left, right, thumbnail), a one-tile view two (the view twice); a view no larger than a tile is one.
- Markers. Each image is `<img>` + its tiles' tokens + `</img>`, as in litevlm's prompt.
- Numerics. mtmd resizes with its Pillow-style bicubic filter (litevlm's is torch's antialiased bicubic, within one
  level of Pillow's) and computes GELU from llama.cpp's tanh approximation (erf's in litevlm).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from litevlm.config import VLMConfig
from litevlm.errors import LiteVLMError

OUTTYPES = ("f32", "f16", "q8_0")
Q8_0_BLOCK = 32  # values per Q8_0 block: a row must hold whole blocks
# convert_hf_to_gguf.py renames the projector to the original InternVL names before mapping them (InternVisionModel)
PROJECTOR_NAMES = {
    "multi_modal_projector.layer_norm": "mlp1.0",
    "multi_modal_projector.linear_1": "mlp1.1",
    "multi_modal_projector.linear_2": "mlp1.3",
}
# tokenizers' pre-tokenizers -> the name of the llama.cpp pre-tokenizer that splits text the same way
BYTE_LEVEL = {"type": "ByteLevel", "add_prefix_space": False, "use_regex": True}
QWEN2_SPLIT = (
    r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+"
)


@dataclass(frozen=True)
class GGUFFiles:
    """The two files of one conversion: the text model and the vision tower with its projector."""

    text: Path
    mmproj: Path


def _gguf():
    try:
        import gguf
    except ImportError:
        raise LiteVLMError("writing GGUF needs the gguf package: pip install 'litevlm[gguf]'") from None
    return gguf


# ------------------------------------------------------------------------------------------------
# What GGUF and mtmd can express
# ------------------------------------------------------------------------------------------------
def check_expressible(cfg: VLMConfig) -> None:
    """Raise a LiteVLMError naming the first feature of `cfg` that llama.cpp's qwen2 model or its InternVL graph
    has no counterpart for."""
    v, t = cfg.vision, cfg.text
    if t.num_heads * t.head_dim != t.hidden_size:
        raise LiteVLMError(
            f"head_dim {t.head_dim} x {t.num_heads} heads != hidden_size {t.hidden_size}: llama.cpp's qwen2 model "
            "takes an attention as wide as the hidden state"
        )
    if v.qk_norm or v.norm_type != "layer_norm":
        raise LiteVLMError(
            "the vision tower uses q/k norms or RMSNorm: llama.cpp's InternVL graph takes those only at InternViT-6B's "
            "shape, and this converter writes LayerNorm towers (InternViT-300M's kind)"
        )
    if cfg.projector_act != "gelu":
        raise LiteVLMError(
            f"projector activation {cfg.projector_act!r}: llama.cpp's InternVL projector always applies GELU"
        )


def pre_tokenizer(spec: dict | None) -> str:
    """The llama.cpp pre-tokenizer (`tokenizer.ggml.pre`) that splits text as the tokenizers pre-tokenizer `spec`
    (tokenizer.json's "pre_tokenizer") does, or a LiteVLMError."""
    spec = spec or {}
    parts = spec.get("pretokenizers", []) if spec.get("type") == "Sequence" else [spec]

    def byte_level(p: dict) -> bool:
        return all(p.get(k, BYTE_LEVEL[k]) == want for k, want in BYTE_LEVEL.items())

    if len(parts) == 1 and byte_level(parts[0]):
        return "gpt-2"
    if len(parts) == 2 and parts[0] == {"type": "Digits", "individual_digits": True} and byte_level(parts[1]):
        return "refact"  # "\p{N}", then GPT-2's split: each digit alone, as Digits(individual_digits) + ByteLevel
    if (
        len(parts) == 2
        and parts[0].get("type") == "Split"
        and parts[0].get("pattern", {}).get("Regex") == QWEN2_SPLIT
        and parts[1].get("type") == "ByteLevel"
        and parts[1].get("use_regex") is False
    ):
        return "qwen2"
    raise LiteVLMError(
        f"the tokenizer's pre-tokenizer {json.dumps(spec)[:200]} has no llama.cpp counterpart this converter knows "
        "(byte-level GPT-2, digits apart + byte-level, or Qwen2's split)"
    )


# ------------------------------------------------------------------------------------------------
# Tensors: our names -> GGUF names, and how each is stored
# ------------------------------------------------------------------------------------------------
def text_tensors(model) -> dict[str, torch.Tensor]:
    """The decoder's tensors under their GGUF names (`blk.0.attn_q.weight`, ...), fp32 in torch's layout; a tied
    head is left out (llama.cpp then reads `token_embd.weight` as the output)."""
    gguf = _gguf()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.QWEN2, model.cfg.text.num_layers)
    out = {}
    for key, t in model.state_dict().items():
        if not key.startswith(("language_model.", "lm_head.")):
            continue
        if key == "lm_head.weight" and model.cfg.text.tie_embeddings:
            continue
        name = names.get_name(key.replace("language_model.", "model.", 1), try_suffixes=(".weight", ".bias"))
        if name is None:
            raise LiteVLMError(f"no GGUF name for the text model's tensor {key}")
        out[name] = t.detach().float().cpu()
    return out


def mmproj_tensors(model) -> dict[str, torch.Tensor]:
    """The vision tower's and projector's tensors under their GGUF names (`v.blk.0.attn_q.weight`,
    `mm.model.mlp.1.weight`, ...), fp32 in torch's layout, position embedding rows patches first (module docstring)."""
    gguf = _gguf()
    names = gguf.get_tensor_name_map(gguf.MODEL_ARCH.MMPROJ, model.cfg.vision.num_layers)
    out = {}
    for key, t in model.state_dict().items():
        if not key.startswith(("vision_tower.", "multi_modal_projector.")):
            continue
        module, _, leaf = key.rpartition(".")
        source = f"{PROJECTOR_NAMES[module]}.{leaf}" if module in PROJECTOR_NAMES else f"model.{key}"
        name = names.get_name(source, try_suffixes=(".weight", ".bias"))
        if name is None:
            raise LiteVLMError(f"no GGUF name for the vision tensor {key}")
        t = t.detach().float().cpu()
        if name.endswith(("ls1", "ls2", "position_embd")):  # the converter's suffix for these bare parameters
            name += ".weight"
        if name == "v.position_embd.weight":
            t = torch.cat([t[:, 1:], t[:, :1]], dim=1)  # (1, 1 + g*g, C): class token's row last
        out[name] = t
    return out


def storage_type(name: str, shape: tuple[int, ...], outtype: str, mmproj: bool = False):
    """The GGML type convert_hf_to_gguf.py stores tensor `name` of torch shape `shape` as, in an `outtype` file."""
    gguf = _gguf()
    q = gguf.GGMLQuantizationType
    if outtype not in OUTTYPES:
        raise LiteVLMError(f"outtype {outtype!r}: use one of {', '.join(OUTTYPES)}")
    if len(shape) <= 1 or name.endswith("_norm.weight") or not name.endswith(".weight"):
        return q.F32  # vectors, norms, and parameters without a .weight suffix (the class embedding)
    if "position_embd" in name:
        return q.F32
    if mmproj and name == "v.patch_embd.weight":
        return q.F16 if outtype == "f16" else q.F32
    if outtype == "q8_0" and shape[-1] % Q8_0_BLOCK:
        return q.F16  # the converter's fallback where rows are not whole Q8_0 blocks
    return {"f32": q.F32, "f16": q.F16, "q8_0": q.Q8_0}[outtype]


def encode(t: torch.Tensor, qtype) -> np.ndarray:
    """A tensor as the bytes (or values) GGUFWriter stores for GGML type `qtype`."""
    gguf = _gguf()
    a = t.numpy().astype(np.float32)
    if qtype == gguf.GGMLQuantizationType.F32:
        return a
    if qtype == gguf.GGMLQuantizationType.F16:
        return a.astype(np.float16)
    return gguf.quants.quantize(a, qtype)


def _file_type(outtype: str):
    t = _gguf().LlamaFileType
    return {"f32": t.ALL_F32, "f16": t.MOSTLY_F16, "q8_0": t.MOSTLY_Q8_0}[outtype]


def _add_tensors(writer, tensors: dict[str, torch.Tensor], outtype: str, mmproj: bool) -> None:
    for name, t in tensors.items():
        qtype = storage_type(name, tuple(t.shape), outtype, mmproj)
        writer.add_tensor(name, encode(t, qtype), raw_dtype=qtype)


def _write(writer, path: Path) -> None:
    writer.write_header_to_file(path=path)
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()


# ------------------------------------------------------------------------------------------------
# The two files
# ------------------------------------------------------------------------------------------------
def _vocabulary(tokenizer, vocab_size: int) -> tuple[list[str], list[int], list[str], str]:
    """(tokens, token types, merges, llama.cpp pre-tokenizer) from the tokenizer's own JSON, one token per embedding
    row (rows no token names are `[PAD{i}]`, unused, as the converter writes them)."""
    gguf = _gguf()
    spec = json.loads(tokenizer.to_str())
    model = spec.get("model", {})
    if model.get("type") != "BPE" or (spec.get("decoder") or {}).get("type") != "ByteLevel":
        raise LiteVLMError(
            "only byte-level BPE tokenizers have a llama.cpp counterpart here (tokenizer.ggml.model gpt2)"
        )
    if (spec.get("normalizer") or {}).get("type") not in (None, "NFC"):
        raise LiteVLMError(f"the tokenizer's normalizer {spec['normalizer']['type']} has no llama.cpp counterpart")
    pre = pre_tokenizer(spec.get("pre_tokenizer"))
    by_id = {i: tok for tok, i in model["vocab"].items()}
    added = {a["id"]: a for a in spec.get("added_tokens", [])}
    tokens, types = [], []
    for i in range(vocab_size):
        if i in added:
            tokens.append(added[i]["content"])
            types.append(gguf.TokenType.CONTROL if added[i]["special"] else gguf.TokenType.USER_DEFINED)
        elif i in by_id:
            tokens.append(by_id[i])
            types.append(gguf.TokenType.NORMAL)
        else:
            tokens.append(f"[PAD{i}]")
            types.append(gguf.TokenType.UNUSED)
    merges = [m if isinstance(m, str) else " ".join(m) for m in model.get("merges", [])]
    return tokens, types, merges, pre


def write_text_gguf(loaded, path: Path, outtype: str) -> Path:
    """The decoder and the tokenizer as a `qwen2` GGUF at `path`."""
    gguf = _gguf()
    cfg, tok = loaded.model.cfg, loaded.tokenizer
    t = cfg.text
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.QWEN2])
    w.add_type(gguf.GGUFType.MODEL)
    w.add_name(cfg.name)
    w.add_block_count(t.num_layers)
    w.add_context_length(t.max_position_embeddings)
    w.add_embedding_length(t.hidden_size)
    w.add_feed_forward_length(t.intermediate_size)
    w.add_head_count(t.num_heads)
    w.add_head_count_kv(t.num_kv_heads)
    w.add_rope_freq_base(t.rope_theta)
    w.add_layer_norm_rms_eps(t.norm_eps)
    w.add_file_type(_file_type(outtype))
    tokens, types, merges, pre = _vocabulary(tok, t.vocab_size)
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre(pre)
    w.add_token_list(tokens)
    w.add_token_types(types)
    w.add_token_merges(merges)
    w.add_bos_token_id(tok.im_start_id)
    w.add_eos_token_id(tok.eos_id)
    w.add_pad_token_id(tok.pad_id)
    w.add_add_bos_token(False)  # the chat template writes <|im_start|> itself
    w.add_add_eos_token(False)
    from litevlm.model.hf import chat_template_for

    w.add_chat_template(chat_template_for(loaded.format))  # string contents, or text and image parts
    _add_tensors(w, text_tensors(loaded.model), outtype, mmproj=False)
    _write(w, path)
    return path


def write_mmproj_gguf(loaded, path: Path, outtype: str) -> Path:
    """The vision tower and projector as a `clip` GGUF with the InternVL projector at `path`."""
    gguf = _gguf()
    from litevlm.model.vlm import IMAGENET_MEAN, IMAGENET_STD

    cfg = loaded.model.cfg
    v = cfg.vision
    tiling = loaded.format.tiling
    w = gguf.GGUFWriter(path, gguf.MODEL_ARCH_NAMES[gguf.MODEL_ARCH.MMPROJ])
    w.add_type(gguf.GGUFType.MMPROJ)
    w.add_name(cfg.name)
    w.add_file_type(_file_type(outtype))
    w.add_clip_has_vision_encoder(True)
    w.add_vision_projection_dim(cfg.text.hidden_size)
    w.add_vision_image_size(v.image_size)
    w.add_vision_patch_size(v.patch_size)
    w.add_vision_embedding_length(v.hidden_size)
    w.add_vision_feed_forward_length(v.intermediate_size)
    w.add_vision_block_count(v.num_layers)
    w.add_vision_head_count(v.num_heads)
    w.add_vision_image_mean(list(IMAGENET_MEAN))
    w.add_vision_image_std(list(IMAGENET_STD))
    w.add_clip_projector_type(gguf.VisionProjectorType.INTERNVL)
    w.add_vision_attention_layernorm_eps(v.norm_eps)
    if v.hidden_act in ("gelu", "gelu_pytorch_tanh"):
        w.add_vision_use_gelu(True)  # neither flag: quick GELU
    w.add_vision_projector_scale_factor(cfg.shuffle)
    w.add_vision_preproc_min_tiles(1)
    w.add_vision_preproc_max_tiles(tiling.max_tiles or tiling.tiles)
    _add_tensors(w, mmproj_tensors(loaded.model), outtype, mmproj=True)
    _write(w, path)
    return path


def write_gguf(name_or_path, out_dir, outtype: str = "f16") -> GGUFFiles:
    """A bundled model ("drive-hd") or checkpoint folder -> `NAME-OUTTYPE.gguf` (text model) and
    `mmproj-NAME-OUTTYPE.gguf` (vision tower and projector) in `out_dir`."""
    from litevlm.models import load_model

    if outtype not in OUTTYPES:
        raise LiteVLMError(f"--outtype {outtype!r}: use one of {', '.join(OUTTYPES)}")
    _gguf()
    return write_loaded(load_model(name_or_path, dtype=torch.float32), out_dir, outtype)


def write_loaded(loaded, out_dir, outtype: str = "f16") -> GGUFFiles:
    """`write_gguf` of a model already loaded (`litevlm.models.load_model`, fp32)."""
    from litevlm.quant.fp8 import FP8Linear

    if any(isinstance(m, FP8Linear) for m in loaded.model.modules()):
        raise LiteVLMError(
            f"{loaded.path} is an FP8 checkpoint: GGUF has no FP8 type; convert the checkpoint it was quantised from"
        )
    check_expressible(loaded.model.cfg)
    name = loaded.model.cfg.name if loaded.model.cfg.name != "custom" else loaded.path.name
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    files = GGUFFiles(out / f"{name}-{outtype}.gguf", out / f"mmproj-{name}-{outtype}.gguf")
    with torch.no_grad():
        write_text_gguf(loaded, files.text, outtype)
        write_mmproj_gguf(loaded, files.mmproj, outtype)
    return files


def read_tensors(path) -> Iterator[tuple[str, object, np.ndarray]]:
    """(name, GGML type, values as float32 in torch's layout) of each tensor of a GGUF file, Q8_0 dequantised."""
    gguf = _gguf()
    reader = gguf.GGUFReader(str(path))
    for t in reader.tensors:
        shape = tuple(int(n) for n in reversed(t.shape))  # GGUF lists dimensions innermost first
        values = gguf.quants.dequantize(np.asarray(t.data), t.tensor_type).reshape(shape)
        yield t.name, t.tensor_type, values.astype(np.float32)
