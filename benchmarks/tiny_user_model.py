"""A user's InternVL checkpoint and DriveLM data in miniature, for the walkthrough (benchmarks/your_model.sh) and the
tests: a tiny random transformers InternVL (`save_pretrained`, Qwen2 text model) that brings its own tokenizer.json
and chat template, and a small DriveLM train-v1_1 JSON with its images.

    python benchmarks/tiny_user_model.py --out /tmp/walkthrough

writes OUT/InternVL-tiny-hf/ and OUT/drivelm/drivelm.json (+ PNGs); the last line of stdout is one JSON object with
both paths. The tokenizer is drive-tiny's byte-level BPE plus a `<video>` token, saved as an InternVL -hf tokenizer;
the chat template is transformers' InternVL one with a default system turn, as Qwen2's has.
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

import torch

HF_SYSTEM = "You are a careful driving assistant."
# transformers' InternVL -hf chat template (structured content: an image item is written as <IMG_CONTEXT>\n, a text
# item as its text, a string content as it is), with a default system turn when none is given, as Qwen2's has.
HF_CHAT_TEMPLATE = (
    "{% if messages[0]['role'] != 'system' %}{{ '<|im_start|>system\\n" + HF_SYSTEM + "<|im_end|>\\n' }}{% endif %}"
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' }}"
    "{% if message['content'] is string %}{{ message['content'] }}"
    "{% else %}{% for content in message['content'] %}"
    "{% if content['type'] == 'image' %}{{ '<IMG_CONTEXT>\\n' }}"
    "{% elif content['type'] == 'video' %}{{ '<video>\\n' }}"
    "{% elif content['type'] == 'text' %}{{ content['text'] }}{% endif %}"
    "{% endfor %}{% endif %}{{ '<|im_end|>\\n' }}{% endfor %}"
    "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}"
)
HF_IMAGE_SIZE = 56  # 56 px tiles of 14 px patches, pixel shuffle 0.5: 4 visual tokens a tile (image_seq_length)
IMAGE_SEQ_LENGTH = 4


def write_hf_tokenizer(out: Path) -> None:
    """drive-tiny's byte-level BPE plus a `<video>` token, as an InternVL -hf tokenizer: tokenizer.json and a
    tokenizer_config.json with the chat template and InternVL's image-token names (what InternVLProcessor reads)."""
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as RawTokenizer

    from litevlm.data.tokenizer import Tokenizer
    from litevlm.models import WEIGHTS_DIR

    out = Path(out)
    Tokenizer.from_dir(WEIGHTS_DIR / "drive-tiny").save(out)
    raw = RawTokenizer.from_file(str(out / "tokenizer.json"))
    raw.add_special_tokens([AddedToken("<video>", special=True, normalized=False)])
    raw.save(str(out / "tokenizer.json"))
    config = json.loads((out / "tokenizer_config.json").read_text())
    config["chat_template"] = HF_CHAT_TEMPLATE
    config["extra_special_tokens"] = {
        "start_image_token": "<img>",
        "end_image_token": "</img>",
        "context_image_token": "<IMG_CONTEXT>",
        "video_token": "<video>",
    }
    (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))


def tiny_hf_internvl(vocab_size: int, image_token_id: int, seed: int = 0):
    """A tiny random transformers InternVLForConditionalGeneration (Qwen2 text model with GQA and an untied head),
    every parameter re-randomised (norm weights 1 + N(0, 0.1), the rest N(0, 0.2)) so that greedy decoding makes a
    varied sequence rather than one repeated token."""
    import transformers

    config = transformers.InternVLConfig(
        vision_config=dict(
            hidden_size=64,
            num_hidden_layers=2,
            num_attention_heads=4,
            intermediate_size=128,
            image_size=HF_IMAGE_SIZE,
            patch_size=14,
            layer_norm_eps=1e-6,
            attention_bias=True,
            use_qk_norm=False,
            norm_type="layer_norm",
            hidden_act="gelu",
        ),
        text_config=dict(
            model_type="qwen2",
            vocab_size=vocab_size,
            hidden_size=64,
            intermediate_size=128,
            num_hidden_layers=2,
            num_attention_heads=4,
            num_key_value_heads=2,
            rope_theta=1e6,
            rms_norm_eps=1e-6,
            max_position_embeddings=4096,
            tie_word_embeddings=False,
        ),
        image_token_id=image_token_id,
        image_seq_length=IMAGE_SEQ_LENGTH,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    model = transformers.InternVLForConditionalGeneration._from_config(config, attn_implementation="eager")
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.1 * noise if "norm" in name and name.endswith("weight") else 0.2 * noise)
    return model.eval()


def write_checkpoint(out: Path) -> Path:
    """The checkpoint folder: tokenizer first, then `save_pretrained` weights with one spare embedding row beyond the
    tokenizer's vocabulary (real checkpoints pad theirs)."""
    from litevlm.data.tokenizer import Tokenizer

    write_hf_tokenizer(out)
    tok = Tokenizer.from_dir(out)
    model = tiny_hf_internvl(vocab_size=tok.vocab_size + 1, image_token_id=tok.image_id)
    model.generation_config.eos_token_id = tok.eos_id
    model.generation_config.pad_token_id = tok.pad_id
    model.save_pretrained(out)
    return Path(out)


def write_data(out: Path, frames: int = 9, seed: int = 5) -> Path:
    """A DriveLM train-v1_1 JSON with its PNGs (synthetic frames, 4 a scene, 16:9 like nuScenes); returns its path.
    Its questions carry c-tags (<c1,CAM_BACK,x,y>) and every category's tag."""
    from litevlm.data.synthetic import write_dataset

    return write_dataset(out, frames=frames, seed=seed, size=(160, 90), progress=False)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="folder to write InternVL-tiny-hf/ and drivelm/ into")
    p.add_argument("--frames", type=int, default=9, help="synthetic frames of the DriveLM set")
    args = p.parse_args(argv)
    out = Path(args.out)
    checkpoint = write_checkpoint(out / "InternVL-tiny-hf")
    data = write_data(out / "drivelm", frames=args.frames)
    print(json.dumps({"model": str(checkpoint), "data": str(data)}))


if __name__ == "__main__":
    main()
