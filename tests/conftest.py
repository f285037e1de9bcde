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


def pytest_collection_modifyitems(config, items):
    """A test marked `once` does its work in subprocesses, whose thread count LITEVLM_TEST_THREADS does not set, or
    spends it compiling (inductor), whose outcome the thread count does not change: a second pass at more threads
    would repeat the same run, so only the one-thread pass (or a run without LITEVLM_TEST_THREADS) runs it."""
    if int(os.environ.get("LITEVLM_TEST_THREADS") or 1) <= 1:
        return
    skip = pytest.mark.skip(reason="a `once` test: the one-thread pass runs it")
    for item in items:
        if item.get_closest_marker("once"):
            item.add_marker(skip)


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


def load_benchmark(name: str):
    """Import a script of benchmarks/ by name ("report" -> benchmarks/report.py) to use or test its parts."""
    import importlib.util
    import sys
    from pathlib import Path

    path = Path(__file__).resolve().parents[1] / "benchmarks" / f"{name}.py"
    spec = importlib.util.spec_from_file_location(f"{name}_bench", path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # dataclasses look their module up while the script runs
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="session")
def benchmark_script():
    """Import a script of benchmarks/ by name ("report" -> benchmarks/report.py) to test its parts."""
    return load_benchmark


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
def user_model_script():
    """benchmarks/tiny_user_model.py (imported once), which writes the tiny user checkpoint and data below."""
    import sys

    return sys.modules.get("tiny_user_model_bench") or load_benchmark("tiny_user_model")


@pytest.fixture(scope="session")
def tiny_hf_checkpoint(tmp_path_factory):
    """A user's transformers InternVL checkpoint in miniature: `save_pretrained` weights of a tiny random Qwen2-based
    InternVL, its own tokenizer.json (a byte-level BPE; the embedding has a spare row, as real ones have) and a
    chat template with a default system turn in tokenizer_config.json. Copy it before writing modules into it."""
    pytest.importorskip("transformers")
    return user_model_script().write_checkpoint(tmp_path_factory.mktemp("user-internvl") / "InternVL-tiny-hf")


@pytest.fixture(scope="session")
def tiny_drivelm(tmp_path_factory):
    """A small DriveLM train-v1_1 JSON with its PNGs (three scenes of synthetic frames, 16:9 like nuScenes); returns
    the JSON's path. Its questions carry c-tags (<c1,CAM_BACK,x,y>) and every category's tag."""
    return user_model_script().write_data(tmp_path_factory.mktemp("user-drivelm"))
