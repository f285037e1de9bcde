"""The default model's tokenizer: a small byte-level BPE saved as a standard tokenizer.json.

Byte-level BPE (GPT-2 style) round-trips any text exactly and never needs an unknown token; digits
are split one per token so that c-tag coordinates like 812.4 are spelled digit by digit and every
number the model writes is built from the same ten pieces. Trained on the synthetic QA corpus with
InternVL's special tokens, it opens in transformers' PreTrainedTokenizerFast as well.
"""

from __future__ import annotations

import json
from pathlib import Path

from tokenizers import Tokenizer as _HFTokenizer
from tokenizers import decoders, models, pre_tokenizers, trainers

from litevlm.errors import LiteVLMError

PAD, IM_START, IM_END, IMG_START, IMG_END, IMG_CONTEXT = (
    "<|pad|>",
    "<|im_start|>",
    "<|im_end|>",
    "<img>",
    "</img>",
    "<IMG_CONTEXT>",
)
SPECIAL_TOKENS = (PAD, IM_START, IM_END, IMG_START, IMG_END, IMG_CONTEXT)  # ids 0..5 in a trained tokenizer


REQUIRED_TOKENS = (IM_START, IM_END, IMG_START, IMG_END, IMG_CONTEXT)  # InternVL's own tokenizers have these too


class Tokenizer:
    """A thin wrapper over `tokenizers.Tokenizer` with the ids the model and prompt builder need.

    Also wraps an InternVL checkpoint's own tokenizer.json: those have no `<|pad|>`, so the pad token
    is `pad_token` (from tokenizer_config.json), else `<|endoftext|>`, else the end-of-answer token.
    """

    def __init__(self, tok: _HFTokenizer, pad_token: str | None = None):
        self._tok = tok
        missing = [t for t in REQUIRED_TOKENS if tok.token_to_id(t) is None]
        if missing:
            raise LiteVLMError(f"tokenizer lacks the special tokens {', '.join(missing)}; a VLM prompt needs them")
        candidates = (PAD, pad_token, "<|endoftext|>", IM_END)
        self._pad = next(t for t in candidates if t is not None and tok.token_to_id(t) is not None)

    # -- construction ------------------------------------------------------------------------------
    @classmethod
    def train(cls, texts, vocab_size: int = 1024) -> Tokenizer:
        """Byte-level BPE on `texts`; deterministic for the same texts and vocab size."""
        if vocab_size < 256 + len(SPECIAL_TOKENS):
            raise ValueError(
                f"vocab_size must be at least {256 + len(SPECIAL_TOKENS)} (the byte alphabet plus specials)"
            )
        tok = _HFTokenizer(models.BPE())
        tok.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
        )
        tok.decoder = decoders.ByteLevel()
        trainer = trainers.BpeTrainer(
            vocab_size=vocab_size,
            special_tokens=list(SPECIAL_TOKENS),
            show_progress=False,
            initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
            min_frequency=2,
        )
        tok.train_from_iterator(list(texts), trainer=trainer)
        return cls(tok)

    @classmethod
    def from_file(cls, path, pad_token: str | None = None) -> Tokenizer:
        p = Path(path)
        if not p.is_file():
            raise LiteVLMError(f"no tokenizer file at {p}")
        try:
            tok = _HFTokenizer.from_file(str(p))
        except Exception as e:  # the Rust side raises a bare Exception for a bad file
            raise LiteVLMError(f"cannot read tokenizer {p}: {e}") from None
        return cls(tok, pad_token)

    @classmethod
    def from_dir(cls, path) -> Tokenizer:
        """tokenizer.json of a folder, with the pad token its tokenizer_config.json names (if any)."""
        d = Path(path)
        pad = None
        if (d / "tokenizer_config.json").is_file():
            try:
                pad = json.loads((d / "tokenizer_config.json").read_text()).get("pad_token")
            except (json.JSONDecodeError, AttributeError):
                raise LiteVLMError(f"{d / 'tokenizer_config.json'} is not a JSON object") from None
            pad = pad.get("content") if isinstance(pad, dict) else pad
        return cls.from_file(d / "tokenizer.json", pad)

    def save(self, out_dir) -> Path:
        """Write tokenizer.json and a tokenizer_config.json that PreTrainedTokenizerFast can open."""
        out = Path(out_dir)
        out.mkdir(parents=True, exist_ok=True)
        self._tok.save(str(out / "tokenizer.json"))
        config = {
            "tokenizer_class": "PreTrainedTokenizerFast",
            "bos_token": IM_START,
            "eos_token": IM_END,
            "pad_token": self._pad,
            "additional_special_tokens": [IMG_START, IMG_END, IMG_CONTEXT],
            "clean_up_tokenization_spaces": False,
            "model_max_length": 4096,
        }
        (out / "tokenizer_config.json").write_text(json.dumps(config, indent=1))
        return out

    # -- use ---------------------------------------------------------------------------------------
    def encode(self, text: str) -> list[int]:
        """Token ids of `text`, no special tokens added (special-token strings in the text still map to them)."""
        return self._tok.encode(text, add_special_tokens=False).ids

    def offsets(self, text: str) -> list[tuple[int, int]]:
        """(start, end) character span in `text` of each token `encode(text)` returns."""
        return self._tok.encode(text, add_special_tokens=False).offsets

    def decode(self, ids, skip_special: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special)

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def to_str(self) -> str:
        return self._tok.to_str()

    def __eq__(self, other) -> bool:
        return isinstance(other, Tokenizer) and self.to_str() == other.to_str()

    @property
    def vocab_size(self) -> int:
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def pad_id(self) -> int:
        return self._tok.token_to_id(self._pad)

    @property
    def eos_id(self) -> int:
        return self._tok.token_to_id(IM_END)

    @property
    def im_start_id(self) -> int:
        return self._tok.token_to_id(IM_START)

    @property
    def img_start_id(self) -> int:
        return self._tok.token_to_id(IMG_START)

    @property
    def img_end_id(self) -> int:
        return self._tok.token_to_id(IMG_END)

    @property
    def image_id(self) -> int:
        return self._tok.token_to_id(IMG_CONTEXT)


def train_default(texts, vocab_size: int = 1024) -> Tokenizer:
    """The default model's tokenizer trained on `texts` (usually synthetic.question_corpus())."""
    return Tokenizer.train(texts, vocab_size)


def default_tokenizer(vocab_size: int = 1024, n_frames: int = 500, seed: int = 0) -> Tokenizer:
    """`train_default` on the synthetic question corpus: the same tokenizer every time."""
    from litevlm.data.synthetic import question_corpus

    return train_default(question_corpus(n_frames=n_frames, seed=seed), vocab_size)
