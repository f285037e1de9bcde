"""Token selection as one object, chosen when a pipeline is built: which visual tokens the prefill keeps.

Each kind answers one call per question, `select(model, prompt, question, tiling, record)` -> (embeds, positions,
hook), a selector that scores the tokens putting its scores in `record` (a dict, or None):
the prompt pruned before the decoder, or left whole with the `Pruning` hook that prunes inside it
(`litevlm.model.generate.pruned_prefill`). The pipeline times the call as "select_tokens".

- `KeepAll`: every visual token (the baseline).
- `FastV`: the in-LLM baseline cutting before layer K, ranked by layer K - 1's attention as published (arXiv
  2403.06764), its ranking timed as select_tokens inside the prefill pass; its answers decode plainly
  (`plain_decoding`).
- `TokenSelector`: LiteVLM's trained selector, ranking from the decoder's own layer-0 output (a hook after it) or
  pruning the prompt before the decoder (its own copy of layer 0, or one that reads the prompt itself); prompts
  with fewer than `min_tokens` visual tokens are left whole.
- `Pruner`: a training-free pruner (`litevlm.select.pruners`: DART, DivPrune, CDPruner, random, uniform).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from litevlm.errors import LiteVLMError
from litevlm.select.tokens import Pruning, fastv_pruning


class KeepAll:
    """Every visual token goes to the prefill."""

    label = ""
    plain_decoding = False  # FastV's answers decode without the draft head or openings

    def select(self, model, p, question: str, tiling, record: dict | None = None):
        return p.embeds, p.positions, None


@dataclass
class FastV(KeepAll):
    """FastV cutting before decoder layer `k` (ranked by layer k - 1's attention), keeping a fraction `keep_ratio`."""

    k: int
    keep_ratio: float
    plain_decoding = True

    @property
    def label(self) -> str:
        return f"fastv K={self.k} r={self.keep_ratio}"

    def select(self, model, p, question: str, tiling, record: dict | None = None):
        return p.embeds, p.positions, fastv_pruning(model, p.positions, p.view_spans, self.k, self.keep_ratio)


@dataclass
class TokenSelector(KeepAll):
    """The trained TokenSelector keeping `keep_ratio` of prompts with at least `min_tokens` visual tokens.

    layer: 0, where the selector itself prunes (a prompt-reading one before the decoder, one reading layer 0's output
    after that layer); K >= 1, its choice (made from the prompt, before the decoder) applied before decoder layer K,
    so layers [0, K) read the whole prompt as FastV's and DART's do, at the cost of running them on it."""

    selector: object
    keep_ratio: float | None
    min_tokens: int = 0
    layer: int = 0

    @property
    def label(self) -> str:
        return (
            f"tokens r={self.keep_ratio}"
            + (f" K={self.layer}" if self.layer else "")
            + (f" from {self.min_tokens}" if self.min_tokens else "")
        )

    def select(self, model, p, question: str, tiling, record: dict | None = None):
        sel = self.selector
        if p.num_visual_tokens < self.min_tokens:
            return p.embeds, p.positions, None
        if sel.prunes_inside:  # ranks from the decoder's own layer 0: a hook after it
            hook = sel.pruning(
                model, p.positions, p.view_spans, self.keep_ratio, question=question, tiling=tiling, record=record
            )
            return p.embeds, p.positions, hook
        embeds, positions, kept = sel.select(
            model,
            p.embeds,
            p.positions,
            p.view_spans,
            keep_ratio=self.keep_ratio,
            question=question,
            tiling=tiling,
            record=record,
        )
        if self.layer:  # the same choice, applied inside the decoder
            return p.embeds, p.positions, Pruning(self.layer, lambda x: kept, "select_tokens")
        return embeds, positions, None


@dataclass
class Pruner(KeepAll):
    """A training-free pruner (`litevlm.select.pruners.PruneConfig`); the random one draws from `generator`."""

    cfg: object
    tokenizer: object
    generator: torch.Generator

    @property
    def label(self) -> str:
        return self.cfg.name

    def select(self, model, p, question: str, tiling, record: dict | None = None):
        from litevlm.select.pruners import apply_pruner

        ids = None
        if self.cfg.method == "cdpruner":  # its relevance is to the question's own tokens
            ids = torch.tensor(self.tokenizer.encode(question), dtype=torch.long, device=p.embeds.device)
        return apply_pruner(self.cfg, model, p.embeds, p.positions, p.view_spans, ids, self.generator)


def token_selection(
    model,
    token_selector,
    keep_ratio,
    min_select_tokens: int,
    fastv,
    pruner,
    tokenizer,
    seed: int,
    select_layer: int = 0,
) -> KeepAll:
    """The one selection a pipeline's options describe, checked: at most one of a TokenSelector, FastV (K, r) and a
    pruner; every r in (0, 1]; a pruning layer inside the decoder (`select_layer`: the TokenSelector's, 0 its own)."""
    chosen = [name for name, x in (("the TokenSelector", token_selector), ("FastV", fastv), ("a pruner", pruner)) if x]
    if len(chosen) > 1:
        raise LiteVLMError(f"choose one token pruning, not {' and '.join(chosen)}")
    for r in (keep_ratio, fastv[1] if fastv else None):
        if r is not None and not 0.0 < r <= 1.0:
            raise LiteVLMError(f"keep ratio r (fraction of visual tokens KEPT) must be in (0, 1]; got {r}")
    if min_select_tokens < 0:
        raise LiteVLMError(f"min_select_tokens must be >= 0; got {min_select_tokens}")
    if select_layer and not token_selector:
        raise LiteVLMError("a TokenSelector pruning layer needs the TokenSelector")
    n_layers = len(model.language_model.layers)
    for what, layer in (
        (f"{getattr(pruner, 'method', '')} prunes", getattr(pruner, "decoder_layer", None)),
        ("the TokenSelector's choice is applied", select_layer or None),
    ):
        if layer is not None and not 1 <= layer < n_layers:
            raise LiteVLMError(
                f"{what} before decoder layer {layer}, but this decoder has {n_layers} "
                f"layers: choose a pruning layer in 1..{n_layers - 1}"
            )
    if select_layer and token_selector.prunes_inside:
        raise LiteVLMError(
            "this TokenSelector reads decoder layer 0's output and prunes after it: a pruning layer applies to a "
            "selector that reads the prompt (`litevlm train tokens --reads embeds` or `--reads prompt`)"
        )
    if fastv:
        return FastV(*fastv)
    if token_selector:
        return TokenSelector(token_selector, keep_ratio, min_select_tokens, select_layer)
    if pruner:
        return Pruner(pruner, tokenizer, torch.Generator().manual_seed(seed))
    return KeepAll()
