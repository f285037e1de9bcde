"""`litevlm convert --to gguf`: the files read back give our tensors, and llama.cpp runs them as litevlm does.

Without llama.cpp: every tensor read back with gguf's own reader (f32 exact, f16 within its rounding, Q8_0 within
its block error), the metadata mtmd reads, what cannot be expressed refused. With llama-cpp-python installed
(`pip install 'litevlm[llamacpp]'`): the held-out questions tokenized to our ids, the text model's logits, mtmd's image
embeddings, and an answer through mtmd equal to litevlm's (from litevlm's own tiles and prompt), and an answer from
image files the way llama.cpp's own tools make it.
"""

from __future__ import annotations

from dataclasses import replace

import numpy as np
import pytest
import torch

gguf = pytest.importorskip("gguf")

from litevlm.cameras import CAMERAS  # noqa: E402
from litevlm.cli import main  # noqa: E402
from litevlm.errors import LiteVLMError  # noqa: E402
from litevlm.model.gguf import (  # noqa: E402
    OUTTYPES,
    check_expressible,
    mmproj_tensors,
    pre_tokenizer,
    read_tensors,
    storage_type,
    text_tensors,
    write_gguf,
    write_loaded,
)
from litevlm.model.hf import chat_template_for  # noqa: E402
from litevlm.model.prompt import IMAGE_MARK  # noqa: E402
from litevlm.models import load_model  # noqa: E402

Q = gguf.GGMLQuantizationType


@pytest.fixture(scope="module")
def tiny():
    return load_model("drive-tiny")


@pytest.fixture(scope="module")
def tiny_files(tiny, tmp_path_factory):
    out = tmp_path_factory.mktemp("gguf-tiny")
    return {t: write_loaded(tiny, out, t) for t in OUTTYPES}


@pytest.fixture(scope="module")
def hd():
    return load_model("drive-hd")


@pytest.fixture(scope="module")
def hd_files(hd, tmp_path_factory):
    return write_loaded(hd, tmp_path_factory.mktemp("gguf-hd"), "f32")


def fields(path) -> dict:
    reader = gguf.GGUFReader(str(path))
    return {k: f.contents() for k, f in reader.fields.items() if not k.startswith("GGUF.")}


def heldout_texts(frames: int = 100) -> list[str]:
    """Every question and answer of the held-out frames the benchmarks ask (seed 1)."""
    from litevlm.data.synthetic import make_frame

    return [t for i in range(frames) for qa in make_frame(1, i).qas for t in (qa.question, qa.answer)]


# ------------------------------------------------------------------------------------------------
# The files, read back
# ------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("outtype", OUTTYPES)
def test_tensors_read_back_as_ours(tiny, tiny_files, outtype):
    files = tiny_files[outtype]
    for path, ours, mmproj in ((files.text, text_tensors, False), (files.mmproj, mmproj_tensors, True)):
        want = ours(tiny.model)
        got = {name: (qtype, values) for name, qtype, values in read_tensors(path)}
        assert set(got) == set(want)
        for name, t in want.items():
            qtype, values = got[name]
            assert qtype == storage_type(name, tuple(t.shape), outtype, mmproj), name
            x = t.numpy()
            if qtype == Q.F32:
                np.testing.assert_array_equal(values, x, err_msg=name)
            elif qtype == Q.F16:
                np.testing.assert_array_equal(values, x.astype(np.float16).astype(np.float32), err_msg=name)
            else:  # Q8_0: blocks of 32 along a row, each scaled by its largest value / 127 (the scale stored in f16)
                blocks = np.abs(x).reshape(-1, 32).max(axis=1, keepdims=True)
                err = np.abs(values - x).reshape(-1, 32)
                assert (err <= blocks / 127 * 0.51 + blocks * 2**-10).all(), name


def test_storage_types_follow_llama_cpps_converter(tiny_files):
    types = {
        t: {name: qtype for path in (f.text, f.mmproj) for name, qtype, _ in read_tensors(path)}
        for t, f in tiny_files.items()
    }
    assert types["q8_0"]["blk.0.attn_q.weight"] == Q.Q8_0 and types["q8_0"]["token_embd.weight"] == Q.Q8_0
    assert types["f16"]["v.blk.0.ffn_up.weight"] == Q.F16
    for t in OUTTYPES:  # norms, biases, layer scales, class and position embeddings stay f32
        for name in ("blk.0.attn_norm.weight", "blk.0.attn_q.bias", "v.blk.0.ls1.weight", "v.class_embd"):
            assert types[t][name] == Q.F32
        assert types[t]["v.position_embd.weight"] == Q.F32
    assert [types[t]["v.patch_embd.weight"] for t in OUTTYPES] == [Q.F32, Q.F16, Q.F32]
    assert "output.weight" not in types["f32"]  # drive-tiny ties its head: llama.cpp reads token_embd


def test_position_embeddings_are_stored_patches_first(tiny, tiny_files):
    """llama.cpp's InternVL graph puts the class token after the patches and adds the rows in stored order."""
    stored = dict((n, v) for n, _, v in read_tensors(tiny_files["f32"].mmproj))["v.position_embd.weight"]
    ours = tiny.model.vision_tower.embeddings.position_embeddings.detach().numpy()  # (1, 1 + g*g, C)
    np.testing.assert_array_equal(stored[:, :-1], ours[:, 1:])
    np.testing.assert_array_equal(stored[:, -1], ours[:, 0])


def test_metadata_mtmd_reads(tiny, tiny_files, hd, hd_files):
    m = fields(tiny_files["q8_0"].mmproj)
    assert m["general.architecture"] == "clip" and m["clip.projector_type"] == "internvl"
    assert m["clip.vision.image_size"] == 112 and m["clip.vision.patch_size"] == 14
    assert m["clip.vision.block_count"] == 4 and m["clip.vision.projection_dim"] == 256
    assert m["clip.use_gelu"] and m["clip.vision.attention.layer_norm_epsilon"] == pytest.approx(1e-6)
    np.testing.assert_allclose(m["clip.vision.image_mean"], [0.485, 0.456, 0.406], rtol=1e-6)
    np.testing.assert_allclose(m["clip.vision.image_std"], [0.229, 0.224, 0.225], rtol=1e-6)
    assert m["clip.vision.projector.scale_factor"] == 2 and m["clip.vision.preproc_max_tiles"] == 1
    h = fields(hd_files.mmproj)  # no pixel shuffle, two tiles a view
    assert h["clip.vision.projector.scale_factor"] == 1 and h["clip.vision.preproc_max_tiles"] == 2
    t = fields(tiny_files["q8_0"].text)
    assert t["general.architecture"] == "qwen2" and t["qwen2.block_count"] == 6
    assert t["general.file_type"] == gguf.LlamaFileType.MOSTLY_Q8_0
    assert t["tokenizer.ggml.model"] == "gpt2" and t["tokenizer.ggml.pre"] == "refact"
    tok = tiny.tokenizer
    assert t["tokenizer.ggml.tokens"][tok.image_id] == "<IMG_CONTEXT>" and len(t["tokenizer.ggml.tokens"]) == 854
    assert t["tokenizer.ggml.token_type"][tok.img_start_id] == gguf.TokenType.CONTROL
    ids = (t["tokenizer.ggml.bos_token_id"], t["tokenizer.ggml.eos_token_id"], t["tokenizer.ggml.padding_token_id"])
    assert ids == (tok.im_start_id, tok.eos_id, tok.pad_id) and t["tokenizer.ggml.add_bos_token"] is False
    assert t["tokenizer.chat_template"] == chat_template_for(tiny.format)


def test_what_gguf_cannot_express_is_refused(tiny, tmp_path):
    cfg = tiny.model.cfg
    for bad, words in (
        (replace(cfg, vision=replace(cfg.vision, qk_norm=True)), "q/k norms"),
        (replace(cfg, vision=replace(cfg.vision, norm_type="rms_norm")), "RMSNorm"),
        (replace(cfg, projector_act="quick_gelu"), "always applies GELU"),
        (replace(cfg, text=replace(cfg.text, head_dim=32)), "head_dim 32"),
    ):
        with pytest.raises(LiteVLMError, match=words):
            check_expressible(bad)
    with pytest.raises(LiteVLMError, match="outtype"):
        write_gguf("drive-tiny", tmp_path, "q4_0")
    with pytest.raises(LiteVLMError, match="no llama.cpp counterpart"):
        pre_tokenizer({"type": "Metaspace", "replacement": "▁"})
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    assert pre_tokenizer(byte_level) == "gpt-2"
    ours = {"type": "Sequence", "pretokenizers": [{"type": "Digits", "individual_digits": True}, byte_level]}
    assert pre_tokenizer(ours) == "refact"
    with pytest.raises(LiteVLMError):  # digits in runs split differently
        pre_tokenizer({**ours, "pretokenizers": [{"type": "Digits", "individual_digits": False}, byte_level]})


def test_cli_writes_both_files(tmp_path, capsys):
    assert main(["convert", "--to", "gguf", "--outtype", "q8_0", "drive-tiny", str(tmp_path)]) in (0, None)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["drive-tiny-q8_0.gguf", "mmproj-drive-tiny-q8_0.gguf"]
    assert "mmproj-drive-tiny-q8_0.gguf" in capsys.readouterr().out


# ------------------------------------------------------------------------------------------------
# In llama.cpp
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def llama_cpp():
    return pytest.importorskip("llama_cpp", reason="pip install 'litevlm[llamacpp]'")


@pytest.mark.parametrize("model", ["drive-tiny", "drive-hd"])
def test_llama_cpp_tokenizes_the_heldout_questions_as_we_do(llama_cpp, request, model):
    loaded, files = (
        (request.getfixturevalue("tiny"), request.getfixturevalue("tiny_files")["q8_0"])
        if model == "drive-tiny"
        else (request.getfixturevalue("hd"), request.getfixturevalue("hd_files"))
    )
    vocab = llama_cpp.Llama(str(files.text), vocab_only=True, verbose=False)
    tok = loaded.tokenizer
    texts = heldout_texts()
    assert [vocab.tokenize(t.encode(), add_bos=False, special=True) for t in texts] == [tok.encode(t) for t in texts]
    prompt = loaded.format.render("Is the car at <c1,CAM_BACK,812.4,300.2> moving?", list(CAMERAS[:2]))
    prompt = prompt.replace(IMAGE_MARK, f"<img>{IMAGE_MARK}</img>")  # the special tokens stay whole
    assert vocab.tokenize(prompt.encode(), add_bos=False, special=True) == tok.encode(prompt)


def test_llama_cpp_logits_match_ours(llama_cpp, tiny, tiny_files):
    from litevlm.eval.llamacpp import LlamaCpp

    ids = tiny.format.build(tiny.tokenizer, "Which objects can be seen in the front right camera?", [], 0).ids
    with LlamaCpp(tiny_files["f32"], threads=1, f32_cache=True) as lc:
        theirs = lc.logits(ids)
    with torch.no_grad():
        ours = tiny.model(torch.tensor([ids]))[0].numpy()
    assert np.abs(theirs - ours).max() <= 1e-4 * (ours.max() - ours.min())


@pytest.fixture(scope="module")
def frame_files(tmp_path_factory):
    """A held-out frame's six views as PNG files, and its questions."""
    from litevlm.data.synthetic import make_frame, render_views

    folder = tmp_path_factory.mktemp("frame")
    frame = make_frame(1, 0)
    paths = {}
    for cam, image in render_views(frame, size=(400, 225)).items():
        paths[cam] = folder / f"{cam}.png"
        image.save(paths[cam])
    return paths, [qa.question for qa in frame.qas]


@pytest.mark.parametrize("model", ["drive-tiny", "drive-hd"])
def test_mtmd_image_embeddings_match_ours(llama_cpp, request, frame_files, model):
    """mtmd's vision tower and projector on our tiles: within llama.cpp's tanh GELU (ours is erf's)."""
    from litevlm.eval.llamacpp import LlamaCpp
    from litevlm.model.vlm import cut_view, normalize_tiles

    loaded, files = (
        (request.getfixturevalue("tiny"), request.getfixturevalue("tiny_files")["f32"])
        if model == "drive-tiny"
        else (request.getfixturevalue("hd"), request.getfixturevalue("hd_files"))
    )
    tiles = cut_view(frame_files[0]["CAM_FRONT"], loaded.format.tiling, loaded.model.cfg.vision.image_size)
    with LlamaCpp(files, threads=1) as lc:
        theirs = lc.encode_tiles(tiles)
    with torch.no_grad():
        ours = loaded.model.encode_tiles(normalize_tiles(torch.from_numpy(tiles))).numpy()
    assert theirs.shape == ours.shape == (tiles.shape[0], loaded.model.cfg.tokens_per_tile, 256)
    scale = np.abs(ours).max()
    assert np.abs(theirs - ours).max() <= 1e-2 * scale and np.abs(theirs - ours).mean() <= 1e-3 * scale


def test_an_answer_through_mtmd_equals_ours(llama_cpp, tiny_files, frame_files):
    """Our prompt ids and tiles, the tiles encoded by mtmd: the same greedy answer as litevlm's baseline."""
    from litevlm import Pipeline
    from litevlm.eval.llamacpp import LlamaCpp
    from litevlm.model.vlm import cut_images

    paths, questions = frame_files
    pipe = Pipeline.from_pretrained("drive-tiny", max_new_tokens=40)
    cut = cut_images([paths[c] for c in CAMERAS], pipe.format.tiling, pipe.cfg.vision.image_size)
    counts = [len(t) * pipe.cfg.tokens_per_tile for t in cut]
    with LlamaCpp(tiny_files["f32"], threads=1, f32_cache=True) as lc:
        for q in questions[1:3]:
            ours = pipe.answer(q, paths)
            layout = pipe.format.build(pipe.tokenizer, q, list(CAMERAS), counts)
            spans = [(s, e) for _, s, e in layout.view_spans]
            theirs = lc.answer_tiles(layout.ids, spans, np.concatenate(cut), 40)
            assert theirs.tokens == ours.tokens, q
            assert theirs.visual_tokens == ours.num_visual_tokens and theirs.input_tokens == ours.input_tokens


def test_an_answer_from_image_files_the_way_llama_cpp_does(llama_cpp, tiny, tiny_files, frame_files):
    """mtmd reads the files and tiles each view itself: one tile of drive-tiny's view plus its thumbnail (the same
    image again), `<img>` ... `</img>` around them, our text around those."""
    from litevlm.eval.llamacpp import MARKER, LlamaCpp

    paths, questions = frame_files
    text = tiny.format.render(questions[2], list(CAMERAS)).replace(IMAGE_MARK, MARKER)
    ours = tiny.format.build(tiny.tokenizer, questions[2], list(CAMERAS), 16)
    with LlamaCpp(tiny_files["q8_0"], threads=1) as lc:
        a = lc.answer_files(text, [paths[c] for c in CAMERAS], 40)
    assert a.visual_tokens == 6 * 2 * 16 and a.input_tokens == len(ours.ids) + 6 * 16
    assert 1 < len(a.tokens) <= 40 and a.tokens[-1] == tiny.tokenizer.eos_id
    assert tiny.tokenizer.decode(a.tokens).strip()
    assert a.perf["eval_tokens"] == len(a.tokens) - 1 and set(a.ms) >= {"load", "encode", "prompt", "generate"}


def test_llama_cpp_pythons_chat_handler_answers_from_our_files(llama_cpp, tiny, tiny_files, frame_files):
    """llama-cpp-python's multimodal chat handler: the GGUF's chat template renders the camera labels and images as
    litevlm's prompt, and the greedy answer is the one mtmd makes from the same files."""
    from llama_cpp.llama_chat_format import MTMDChatHandler

    from litevlm.eval.llamacpp import MARKER, LlamaCpp

    paths, questions = frame_files
    content = []
    for cam in CAMERAS:
        image = {"type": "image_url", "image_url": {"url": paths[cam].as_uri()}}
        content += [{"type": "text", "text": f"{cam}: "}, image, {"type": "text", "text": "\n"}]
    content.append({"type": "text", "text": questions[2]})
    files = tiny_files["f32"]
    handler = MTMDChatHandler(str(files.mmproj), verbose=False, use_gpu=False)
    llm = llama_cpp.Llama(str(files.text), chat_handler=handler, n_ctx=2048, n_threads=1, verbose=False)
    try:
        out = llm.create_chat_completion([{"role": "user", "content": content}], temperature=0.0, max_tokens=40)
    finally:
        llm.close()
    text = tiny.format.render(questions[2], list(CAMERAS)).replace(IMAGE_MARK, MARKER)
    with LlamaCpp(files, threads=1) as lc:
        ours = lc.answer_files(text, [paths[c] for c in CAMERAS], 40)
    assert out["usage"]["prompt_tokens"] == ours.input_tokens
    assert out["choices"][0]["message"]["content"].strip() == tiny.tokenizer.decode(ours.tokens).strip()


def test_llama_cpps_prompt_lookup_drafting_answers_as_its_plain_chat_path(llama_cpp, tiny, tiny_files, frame_files):
    """The peers benchmark's speculative llama.cpp row (`LlamaChat` with prompt-lookup drafting) is lossless: the
    same greedy answers and prompt as the chat path without it."""
    from litevlm.eval.llamacpp import LlamaChat

    paths, questions = frame_files
    labelled = [(f"{cam}: ", paths[cam]) for cam in CAMERAS]
    files = tiny_files["f32"]
    with LlamaChat(files, threads=1) as plain, LlamaChat(files, threads=1, lookup=8) as drafted:
        for q in questions[:3]:
            a, _, new_a, prompt_a = plain.answer(labelled, q, 40)
            b, _, new_b, prompt_b = drafted.answer(labelled, q, 40)
            assert (a, new_a, prompt_a) == (b, new_b, prompt_b) and new_a > 0
