"""Answer openings: the first tokens of an answer, drafted from the question alone and verified inside the prefill.

A speculative cycle needs the draft head, and the draft head needs the target's features, so the first cycle can
only start once the prefill is done: a short answer ("Yes." + EOS) then pays a whole target pass over the weights
for its last two tokens. But many questions of a kind open their answers the same way ("Is there ...?" -> "Yes." /
"No."; "What will <c> do next?" -> "Keep ..."). `Openings` is a table, built from training questions and answers
(`litevlm.train.openings`), from a question's first words to a small trie of the answer openings seen most often
after them (a retrieval-style draft, as in REST, arXiv 2311.08252). The trie's nodes ride along with the prompt in
the prefill's one forward pass: every node sees the whole prompt and its own ancestors (the tree mask), at position
prompt end + depth. Greedy acceptance then walks the trie from the prompt's own next token exactly as a
verification does (`accept_opening`, in `litevlm.model.generate`), so the output is unchanged token for token; an
answer the trie covers to its
EOS needs no decode step at all, and a miss costs the prefill a few rows.
"""

from __future__ import annotations

import json
import re
from collections import Counter, defaultdict
from dataclasses import dataclass
from pathlib import Path

import torch

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
