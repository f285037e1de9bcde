"""Answer openings: the first tokens of an answer, drafted from the question alone and verified inside the prefill.

A speculative cycle needs the draft head, and the draft head needs the target's features, so the first cycle can
only start once the prefill is done: a short answer ("Yes." + EOS) then pays a whole target pass over the weights
for its last two tokens. But many questions of a kind open their answers the same way ("Is there ...?" -> "Yes." /
"No."; "What will <c> do next?" -> "Keep ..."). `Openings` is a table, built from training questions and answers,
from a question's first words to a small trie of the answer openings seen most often after them (a
retrieval-style draft, as in REST, arXiv 2311.08252). The trie's nodes ride along with the prompt in the prefill's
one forward pass: every node sees the whole prompt and its own ancestors (the tree mask), at position
prompt end + depth. Greedy acceptance then walks the trie from the prompt's own next token exactly as a
verification does (`accept_opening`, in `litevlm.model.generate`), so the output is unchanged token for token; an
answer the trie covers to its
EOS needs no decode step at all, and a miss costs the prefill a few rows.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass, fields
from pathlib import Path

import torch
from tqdm import tqdm

from litevlm.errors import LiteVLMError
from litevlm.spec.tree import ancestor_mask

OPENINGS_FILE = "openings.json"
OPENINGS_FORMAT = "litevlm-openings"
_WORD = re.compile(r"[a-z]+")


def question_key(question: str, words: int = 2) -> str:
    """The first `words` words of a question, lower-case letters only: a key of the table."""
    return " ".join(_WORD.findall(question.lower())[:words])


@dataclass
class Opening:
    """A trie of answer openings, parents before children: node i holds tokens[i] at depth[i] (0: the answer's first
    token) under parents[i] (-1: none); mask[i, j] is True where j is i or one of its ancestors."""

    tokens: torch.Tensor  # (N,) long
    parents: torch.Tensor  # (N,) long
    depth: torch.Tensor  # (N,) long
    mask: torch.Tensor  # (N, N) bool

    def __len__(self) -> int:
        return self.tokens.numel()

    @classmethod
    def from_sequences(cls, sequences: list[list[int]]) -> Opening:
        tokens, parents, depth, index = [], [], [], {}
        for seq in sequences:
            for d in range(len(seq)):
                prefix = tuple(seq[: d + 1])
                if prefix not in index:
                    index[prefix] = len(tokens)
                    tokens.append(seq[d])
                    parents.append(index[prefix[:-1]] if d else -1)
                    depth.append(d)
        parents_t = torch.tensor(parents, dtype=torch.long)
        return cls(
            torch.tensor(tokens, dtype=torch.long),
            parents_t,
            torch.tensor(depth, dtype=torch.long),
            ancestor_mask(parents_t, max(depth, default=0)),
        )


class Openings:
    """Question key -> the answer openings seen most often after it (token id sequences, each at most `depth` long,
    ending early at EOS), as a trie of at most `max_nodes` nodes per key. Keys are a question's first `key_words[0]`
    words, then (for questions whose longer key was not seen in training) its first `key_words[1]`, and so on."""

    def __init__(
        self,
        table: dict[str, list[list[int]]],
        *,
        depth: int,
        max_nodes: int,
        vocab_size: int,
        key_words: tuple[int, ...] = (2,),
        recipe: dict | None = None,
    ):
        self.table, self.depth, self.max_nodes, self.vocab_size = table, depth, max_nodes, vocab_size
        self.key_words = tuple(key_words)
        self.recipe = recipe or {}
        self._tries: dict[str, Opening] = {}

    @classmethod
    def build(
        cls,
        pairs,
        *,
        eos_id: int,
        vocab_size: int,
        depth: int = 3,
        max_nodes: int = 8,
        min_share: float = 0.05,
        key_words: tuple[int, ...] = (2,),
        recipe: dict | None = None,
    ) -> Openings:
        """From (question, answer token ids) pairs: per question key (of each length in `key_words`), the most frequent
        openings (the answer's tokens and EOS, cut at `depth`) that make up at least `min_share` of its answers, most
        frequent first, while their trie stays within `max_nodes` nodes."""
        if depth < 1 or max_nodes < 1 or not key_words or min(key_words) < 1:
            raise LiteVLMError(
                f"openings need depth, max_nodes and key words >= 1; got {depth}, {max_nodes}, {key_words}"
            )
        counts: dict[str, Counter] = defaultdict(Counter)
        for question, ids in pairs:
            for words in key_words:
                counts[question_key(question, words)][tuple((list(ids) + [eos_id])[:depth])] += 1
        table = {}
        for key, seen in counts.items():
            total, chosen, prefixes = sum(seen.values()), [], set()
            for seq, n in seen.most_common():
                if n < min_share * total:
                    break
                grown = prefixes | {seq[: d + 1] for d in range(len(seq))}
                if len(grown) > max_nodes:
                    continue
                chosen.append(list(seq))
                prefixes = grown
            if chosen:
                table[key] = chosen
        return cls(table, depth=depth, max_nodes=max_nodes, vocab_size=vocab_size, key_words=key_words, recipe=recipe)

    def for_question(self, question: str) -> Opening | None:
        """The trie to verify with this question's prompt (its longest key the table knows), or None where no key has
        openings."""
        key = next((k for k in (question_key(question, w) for w in self.key_words) if k in self.table), None)
        if key is None:
            return None
        if key not in self._tries:
            self._tries[key] = Opening.from_sequences(self.table[key])
        return self._tries[key]

    # -- files ----------------------------------------------------------------------------------
    def save(self, folder: str | Path) -> Path:
        out = Path(folder) / OPENINGS_FILE
        meta = {
            "format": OPENINGS_FORMAT,
            "version": 1,
            "depth": self.depth,
            "max_nodes": self.max_nodes,
            "key_words": list(self.key_words),
            "vocab_size": self.vocab_size,
            "recipe": self.recipe,
            "table": self.table,
        }
        out.write_text(json.dumps(meta, indent=1))
        return out

    @classmethod
    def load(cls, folder: str | Path, vocab_size: int) -> Openings | None:
        """The table in `folder` (a draft head's folder), None where it has none; an error names a file that is not
        one or that was built for another vocabulary."""
        path = Path(folder) / OPENINGS_FILE
        if not path.is_file():
            return None
        try:
            meta = json.loads(path.read_text())
            if meta.get("format") != OPENINGS_FORMAT:
                raise ValueError("not a litevlm openings table")
            table = {str(k): [[int(t) for t in seq] for seq in v] for k, v in meta["table"].items()}
            depth, max_nodes, vocab = int(meta["depth"]), int(meta["max_nodes"]), int(meta["vocab_size"])
            key_words = tuple(int(w) for w in meta.get("key_words", [2]))
        except (OSError, ValueError, KeyError, TypeError) as e:
            raise LiteVLMError(f"cannot read the answer openings {path}: {e}") from None
        if vocab != vocab_size:
            raise LiteVLMError(
                f"the answer openings {path} were built for a vocabulary of {vocab}; the model has {vocab_size}"
            )
        bad = [t for seqs in table.values() for seq in seqs for t in seq if not 0 <= t < vocab_size]
        if bad or any(not seq or len(seq) > depth for seqs in table.values() for seq in seqs):
            raise LiteVLMError(
                f"the answer openings {path} hold sequences outside the vocabulary or longer than {depth}"
            )
        return cls(
            table,
            depth=depth,
            max_nodes=max_nodes,
            vocab_size=vocab,
            key_words=key_words,
            recipe=meta.get("recipe", {}),
        )


def build_openings(
    model,
    out: str | Path | None = None,
    *,
    samples=None,
    data: str = "",
    offline: str | Path | None = None,
    frames: int = 3000,
    seed: int = 0,
    depth: int = 4,
    max_nodes: int = 12,
    min_share: float = 0.03,
    key_words: tuple[int, ...] = (4, 2),
    progress: bool = True,
) -> Path:
    """The answer openings of a model (a `litevlm.models.Loaded`, or a name or folder to load), saved beside its
    draft head (`modules_dir(loaded, out)/draft/openings.json`).

    With `samples` (the user's data, named by `data`): the target's own greedy answers to the training split's
    questions (the scenes `litevlm train draft` does not hold out), read from the draft's `offline` cache when
    given, else generated with the settings the draft head was trained with. Without: the reference answers of synthetic
    training frames (seed, 0..frames-1; the held-out split is seed 1)."""
    from litevlm.models import DRAFT_SUBDIR, Loaded, load_model

    loaded = model if isinstance(model, Loaded) else load_model(model)
    folder = (Path(out) if out is not None else loaded.path) / DRAFT_SUBDIR
    if not (folder / "config.json").is_file():
        raise LiteVLMError(
            f"{folder.parent} has no draft head: answer openings are kept beside it (train one with "
            "`litevlm train draft`)"
        )
    if samples is None and frames < 1:
        raise LiteVLMError(f"--frames must be >= 1; got {frames}")
    tok = loaded.tokenizer
    if samples is not None:
        pairs, source = target_answers(loaded, folder, samples, data, offline, progress), "target"
        eos = [tok.eos_id]
        pairs = [(q, a[:-1] if a[-1:] == eos else a) for q, a in pairs]  # `build` appends EOS itself
    else:
        from litevlm.data.synthetic import make_frame

        pairs, source = (
            [
                (qa.question, tok.encode(qa.answer))
                for i in tqdm(range(frames), desc="frames", disable=not progress)
                for qa in make_frame(seed, i).qas
            ],
            "reference",
        )
    table = Openings.build(
        pairs,
        eos_id=tok.eos_id,
        vocab_size=tok.vocab_size,
        depth=depth,
        max_nodes=max_nodes,
        min_share=min_share,
        key_words=key_words,
        recipe={
            **({"data": data or "given"} if samples is not None else {"frames": frames, "seed": seed}),
            "depth": depth,
            "max_nodes": max_nodes,
            "min_share": min_share,
            "key_words": list(key_words),
            "answers": source,
            "questions": len(pairs),
        },
    )
    return table.save(folder)


def target_answers(
    loaded, draft: Path, samples, data: str, offline, progress: bool = True
) -> list[tuple[str, list[int]]]:
    """(question, the target's greedy answer ids) for the questions of the training split of `samples`: from the
    draft recipe's offline cache in `offline` when it holds one for this target and data, else generated."""
    from litevlm.train.draft import DraftRecipe, answer_shard, cache_key, cached_answers, data_frames, plan

    saved = json.loads((draft / "config.json").read_text()).get("recipe", {})
    recipe = DraftRecipe(**{f.name: saved[f.name] for f in fields(DraftRecipe) if f.name in saved})
    recipe.render_size = tuple(recipe.render_size)  # a list in JSON
    seqs = None
    if offline is not None:
        seqs = cached_answers(offline, cache_key(loaded, recipe, data, len(samples)))
        if seqs is None:
            raise LiteVLMError(
                f"{offline} holds no draft features: run `litevlm train draft --offline {offline}` first"
            )
    if seqs is None:
        from litevlm.data.source import scene_split
        from litevlm.pipeline import Pipeline

        held = frozenset(s.id for s in scene_split(samples, recipe.val_fraction, recipe.seed)[1])
        shards = [  # the draft recipe's plan (the same views per question), the training split only
            [(f, kept) for f, items in shard if (kept := [it for it in items if not it.held_out])]
            for shard in plan(data_frames(samples), recipe, held)
        ]
        pipe = Pipeline.from_loaded(loaded)
        seqs = []
        with tqdm(total=len(samples) - len(held), desc="target answers", disable=not progress) as bar:
            for shard in shards:
                if shard:
                    seqs += answer_shard(pipe, shard, recipe, torch.float16)
                    bar.update(sum(len(items) for _, items in shard))
    return [(s.question, list(s.answer)) for s in seqs if not s.held_out]
