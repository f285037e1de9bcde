"""The answer-openings recipe: count how a model's answers open, per question kind, and save the table beside its
draft head (`litevlm.spec.openings` explains the technique). On the user's data the answers are the target's own
greedy answers to the training split's questions, as the draft head learns from them (read from the draft's offline
cache when there is one); without data, the reference answers of synthetic training frames.
"""

from __future__ import annotations

import json
from dataclasses import fields
from pathlib import Path

import torch
from tqdm import tqdm

from litevlm.errors import LiteVLMError
from litevlm.spec.openings import Openings


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
        vocab_size=loaded.model.cfg.text.vocab_size,  # the model's rows: a checkpoint may have spare ones
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
    from litevlm.train.draft import LENT, DraftRecipe, answer_shard, cache_key, cached_answers, data_frames, plan

    saved = json.loads((draft / "config.json").read_text()).get("recipe", {})
    recipe = DraftRecipe(**{f.name: saved[f.name] for f in fields(DraftRecipe) if f.name in saved})
    recipe.render_size = tuple(recipe.render_size)  # a list in JSON
    seqs = None
    if offline is not None:
        seqs = cached_answers(offline, cache_key(loaded, recipe, data, samples))
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
        pipe = Pipeline.from_loaded(loaded, **LENT)
        seqs = []
        with tqdm(total=len(samples) - len(held), desc="target answers", disable=not progress) as bar:
            for shard in shards:
                if shard:
                    seqs += answer_shard(pipe, shard, recipe, torch.float16)
                    bar.update(sum(len(items) for _, items in shard))
    return [(s.question, list(s.answer)) for s in seqs if not s.held_out]
