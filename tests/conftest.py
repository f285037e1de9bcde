import os
import threading
from contextlib import contextmanager
from http.server import ThreadingHTTPServer

import pytest
import torch

from litevlm.config import TextConfig, VisionConfig, VLMConfig


def pytest_configure(config):
    """LITEVLM_TEST_THREADS=N runs the suite on N torch threads: CI runs it at 1 and at 2, since a kernel's
    reduction order (and so its last fp32 bits) may change with the thread count."""
    threads = os.environ.get("LITEVLM_TEST_THREADS")
    if threads:
        torch.set_num_threads(int(threads))


@pytest.fixture(autouse=True)
def _suite_threads():
    """The training recipes set torch's thread count for their run; each test starts at the suite's."""
    threads = torch.get_num_threads()
    yield
    torch.set_num_threads(threads)


def tiny_config(tokenizer, **overrides) -> VLMConfig:
    """A few-thousand-parameter drive-tiny lookalike: 56 px tiles -> 4 visual tokens per view."""
    kw = dict(
        vision=VisionConfig(
            hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, image_size=56, patch_size=14
        ),
        text=TextConfig(
            vocab_size=tokenizer.vocab_size,
            hidden_size=32,
            num_layers=2,
            num_heads=2,
            num_kv_heads=1,
            intermediate_size=64,
            rope_theta=10000.0,
            tie_embeddings=True,
            max_position_embeddings=4096,
        ),
        image_token_id=tokenizer.image_id,
        img_start_id=tokenizer.img_start_id,
        img_end_id=tokenizer.img_end_id,
        eos_token_id=tokenizer.eos_id,
        pad_token_id=tokenizer.pad_id,
        name="tiny",
    )
    kw.update(overrides)
    return VLMConfig(**kw)


@pytest.fixture(scope="session")
def tiny_tokenizer():
    from litevlm.data.synthetic import question_corpus
    from litevlm.data.tokenizer import train_default

    return train_default(question_corpus(n_frames=40, seed=0), vocab_size=400)


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tiny_tokenizer):
    """A random tiny model saved in our checkpoint format, with its tokenizer."""
    from litevlm.model.hf import save_native
    from litevlm.model.vlm import VLM

    torch.manual_seed(0)
    model = VLM(tiny_config(tiny_tokenizer))
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.3)
    out = tmp_path_factory.mktemp("tiny-model")
    save_native(model, out)
    tiny_tokenizer.save(out)
    return out


@pytest.fixture(scope="session")
def full_model_dir(tiny_model_dir, tmp_path_factory):
    """The tiny model with every module beside it: ViewSelector (lexical), TokenSelector, draft head."""
    import shutil

    from litevlm.model.hf import load_native
    from litevlm.select.tokens import TokenSelector
    from litevlm.select.views import ViewSelector
    from litevlm.spec.draft import DraftConfig, DraftHead

    d = tmp_path_factory.mktemp("full") / "model"
    shutil.copytree(tiny_model_dir, d)
    model = load_native(d)
    torch.manual_seed(0)
    ViewSelector.lexical_only().save(d)
    TokenSelector.from_model(model).save(d)
    DraftHead(DraftConfig.for_target(model.cfg.text), model).save(d / "draft")
    return d


@pytest.fixture(scope="session")
def benchmark_script():
    """Import a script of benchmarks/ by name ("report" -> benchmarks/report.py) to test its parts."""
    import importlib.util
    import sys
    from pathlib import Path

    def load(name: str):
        path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
        spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod  # dataclasses look their module up while the script runs
        spec.loader.exec_module(mod)
        return mod

    return load


@contextmanager
def loopback_server(handler):
    """A threaded HTTP server on 127.0.0.1 (a free port) answering with `handler`; `.seen` collects what the
    handler records. Shut down and closed on exit."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    server.seen = []
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield server
    finally:
        server.shutdown()
        server.server_close()


# ------------------------------------------------------------------------------------------------
# A user's own checkpoint and data: a transformers InternVL folder with its tokenizer and chat template,
# and a DriveLM train-v1_1 JSON with images
# ------------------------------------------------------------------------------------------------
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


def write_hf_tokenizer(out) -> None:
    """drive-tiny's byte-level BPE plus a `<video>` token, as an InternVL -hf tokenizer: tokenizer.json and a
    tokenizer_config.json with the chat template and InternVL's image-token names (what InternVLProcessor reads)."""
    import json
    from pathlib import Path

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
        image_seq_length=4,
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


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    """A user's transformers InternVL checkpoint in miniature: `save_pretrained` weights of a tiny random Qwen2-based
    InternVL, its own tokenizer.json (a byte-level BPE; the embedding has a few spare rows, as real ones do) and a
    chat template with a default system turn in tokenizer_config.json. Copy it before writing modules into it."""
    pytest.importorskip("transformers")
    from litevlm.data.tokenizer import Tokenizer

    out = tmp_path_factory.mktemp("user-internvl") / "InternVL-tiny-hf"
    write_hf_tokenizer(out)
    tok = Tokenizer.from_dir(out)
    model = tiny_hf_internvl(vocab_size=tok.vocab_size + 1, image_token_id=tok.image_id)
    model.generation_config.eos_token_id = tok.eos_id
    model.generation_config.pad_token_id = tok.pad_id
    model.save_pretrained(out)
    return out


@pytest.fixture(scope="session")
def tiny_drivelm(tmp_path_factory):
    """A small DriveLM train-v1_1 JSON with its PNGs (three scenes of synthetic frames, 16:9 like nuScenes); returns
    the JSON's path. Its questions carry c-tags (<c1,CAM_BACK,x,y>) and every category's tag."""
    from litevlm.data.synthetic import write_dataset

    return write_dataset(tmp_path_factory.mktemp("user-drivelm"), frames=9, seed=5, size=(160, 90), progress=False)
