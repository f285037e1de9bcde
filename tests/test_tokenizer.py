"""The default byte-level BPE tokenizer: exact round trips, special ids, save/load, answer lengths."""

import statistics

import pytest

from litevlm.data.synthetic import make_frame, question_corpus
from litevlm.data.tokenizer import SPECIAL_TOKENS, Tokenizer, train_default
from litevlm.errors import LiteVLMError


@pytest.fixture(scope="module")
def tok():
    return train_default(question_corpus(n_frames=120, seed=0), vocab_size=1024)


def test_round_trip_tags_numbers_unicode(tok):
    texts = [
        "What is the moving status of object <c1,CAM_FRONT,812.4,470.0>?",
        "Firstly, notice <c3,CAM_BACK_LEFT,1599.9,0.0>. 12 m, 3.75 s, -40.25",
        "héllo wörld — 世界 🚗  tabs\tand\nnewlines  ",
        "",
        "<img><IMG_CONTEXT></img> plain text with <|im_end|>",
    ]
    for t in texts:
        ids = tok.encode(t)
        assert tok.decode(ids, skip_special=False) == t
    assert tok.decode(tok.encode("a<|im_end|>b")) == "ab"  # specials dropped by default


def test_digits_are_single_tokens(tok):
    ids = tok.encode("812.4")
    assert len(ids) == 5 and [tok.decode([i]) for i in ids] == ["8", "1", "2", ".", "4"]


def test_special_ids(tok):
    ids = [tok.pad_id, tok.im_start_id, tok.eos_id, tok.img_start_id, tok.img_end_id, tok.image_id]
    assert ids == list(range(len(SPECIAL_TOKENS)))
    assert tok.encode("<IMG_CONTEXT>") == [tok.image_id] and tok.encode("<|im_end|>") == [tok.eos_id]
    assert 256 + len(SPECIAL_TOKENS) < tok.vocab_size <= 1024


def test_training_is_deterministic_and_save_load_equal(tok, tmp_path):
    again = train_default(question_corpus(n_frames=120, seed=0), vocab_size=1024)
    assert again == tok
    out = tok.save(tmp_path / "tk")
    assert (out / "tokenizer.json").exists() and (out / "tokenizer_config.json").exists()
    loaded = Tokenizer.from_dir(out)
    assert loaded == tok and loaded.eos_id == tok.eos_id
    text = make_frame(0, 999).qas[0].answer
    assert loaded.encode(text) == tok.encode(text)
    assert Tokenizer.from_file(out / "tokenizer.json") == tok
    with pytest.raises(LiteVLMError, match="no tokenizer file"):
        Tokenizer.from_dir(tmp_path / "missing")
    small = train_default(["a b c"] * 10, vocab_size=300)
    assert small.vocab_size <= 300 and small.decode(small.encode("zebra 42")) == "zebra 42"


def test_transformers_can_open_the_folder(tok, tmp_path):
    transformers = pytest.importorskip("transformers")
    out = tok.save(tmp_path / "tk")
    hf = transformers.PreTrainedTokenizerFast.from_pretrained(str(out))
    text = "Is <c2,CAM_FRONT_LEFT,402.0,455.5> a traffic sign or a road barrier?"
    assert hf.encode(text, add_special_tokens=False) == tok.encode(text)
    assert hf.eos_token == "<|im_end|>" and hf.pad_token_id == tok.pad_id and hf.bos_token_id == tok.im_start_id


def test_typical_answers_are_short(tok):
    lengths = [len(tok.encode(qa.answer)) for i in range(500, 540) for qa in make_frame(0, i).qas]
    assert statistics.median(lengths) <= 30 and max(lengths) < 200
    open_lengths = [len(tok.encode(qa.answer)) for i in range(500, 540) for qa in make_frame(0, i).qas if not qa.closed]
    assert 5 <= statistics.median(open_lengths) <= 30


def test_wraps_an_internvl_style_tokenizer_without_pad(tmp_path):
    from tokenizers import Tokenizer as HF
    from tokenizers import models, pre_tokenizers

    raw = HF(models.BPE())
    raw.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    raw.add_special_tokens(["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<img>", "</img>", "<IMG_CONTEXT>"])
    (tmp_path / "tk").mkdir()
    raw.save(str(tmp_path / "tk" / "tokenizer.json"))
    tok = Tokenizer.from_dir(tmp_path / "tk")
    assert tok.pad_id == raw.token_to_id("<|endoftext|>") and tok.image_id == raw.token_to_id("<IMG_CONTEXT>")
    raw2 = HF(models.BPE())
    raw2.add_special_tokens(["<|im_start|>", "<|im_end|>"])
    with pytest.raises(LiteVLMError, match="lacks the special tokens <img>"):
        Tokenizer(raw2)
