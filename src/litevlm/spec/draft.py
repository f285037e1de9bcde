"""The EAGLE draft head: one decoder layer that predicts the target's next top feature.

EAGLE (Li et al., arXiv 2401.15077, section 3.1) drafts at the feature level: pair j joins the
target's final post-norm hidden state f_j with the embedding of the token that follows it, x_{j+1}
(`fc` on [embedding ; feature]), and one decoder layer predicts f_{j+1}; the target's own frozen LM
head turns that into the distribution of x_{j+2}. The head then feeds on its own predictions to
draft further ahead. As in SpecVLM (arXiv 2509.11815, 3.3) the layer keeps its input RMSNorm, and
the draft's positions are those of the features (pair j sits at the RoPE position of token j).
Image placeholders are paired with the visual embeddings the target itself consumed.

The embedding table and the LM head are the target's, shared and never stored with the draft: a
checkpoint holds `fc` and the layer (safetensors) plus its config and training recipe (json). Two
options keep a draft step cheap next to a small target: a draft vocabulary (the LM head's rows of
the tokens answers use, as EAGLE-3's d2t map) and a window over the prompt's last pairs.
"""

from __future__ import annotations

import dataclasses
import json
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
import torch.nn as nn
import torch.nn.functional as F

from litevlm.config import TextConfig
from litevlm.errors import LiteVLMError
from litevlm.model.kv_cache import KVCache
from litevlm.model.layers import linear, rope_cos_sin, rope_table, row_major
from litevlm.model.lm import DecoderLayer
from litevlm.models import DRAFT_SUBDIR
from litevlm.spec.openings import Openings

DRAFT_FORMAT = "litevlm-draft"


@dataclass
class DraftConfig:
    hidden_size: int
    vocab_size: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int
    rope_theta: float = 1e6
    norm_eps: float = 1e-6
    qkv_bias: bool = True
    input_norm: bool = True
    draft_vocab: int = 0  # > 0: draft only among this many target tokens (a cheaper LM head, as EAGLE-3's d2t)
    context: int = (
        0  # > 0: the draft sees only the last `context` prompt pairs (cheaper steps), then all generated ones
    )

    def __post_init__(self) -> None:
        self.layer_config()  # validates heads / head_dim like the target's config does
        if not 0 <= self.draft_vocab <= self.vocab_size:
            raise LiteVLMError(f"draft config field 'draft_vocab': must lie in [0, vocab_size={self.vocab_size}]")
        if self.context < 0:
            raise LiteVLMError("draft config field 'context': must be >= 0 (0 = the whole prompt)")

    @classmethod
    def for_target(
        cls, text: TextConfig, intermediate_size: int | None = None, draft_vocab: int = 0, context: int = 0
    ) -> DraftConfig:
        """The target's layer shapes (EAGLE), optionally with a narrower MLP and a reduced draft vocabulary."""
        return cls(
            hidden_size=text.hidden_size,
            vocab_size=text.vocab_size,
            num_heads=text.num_heads,
            num_kv_heads=text.num_kv_heads,
            head_dim=text.head_dim,
            intermediate_size=intermediate_size or text.intermediate_size,
            rope_theta=text.rope_theta,
            norm_eps=text.norm_eps,
            qkv_bias=text.qkv_bias,
            draft_vocab=draft_vocab,
            context=context,
        )

    def layer_config(self) -> TextConfig:
        return TextConfig(
            vocab_size=self.vocab_size,
            hidden_size=self.hidden_size,
            num_layers=1,
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            intermediate_size=self.intermediate_size,
            head_dim=self.head_dim,
            rope_theta=self.rope_theta,
            norm_eps=self.norm_eps,
            qkv_bias=self.qkv_bias,
        )

    @classmethod
    def from_dict(cls, d: dict) -> DraftConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        if set(d) - known:
            raise LiteVLMError(f"draft config has unknown fields {sorted(set(d) - known)}; re-train the draft head")
        return cls(**d)


class DraftHead(nn.Module):
    """fc(2H -> H) + one decoder layer; the target's embedding and LM head are borrowed, not owned."""

    def __init__(self, cfg: DraftConfig, target=None):
        super().__init__()
        self.cfg = cfg
        self.fc = nn.Linear(2 * cfg.hidden_size, cfg.hidden_size, bias=True)
        self.layer = DecoderLayer(cfg.layer_config())
        if not cfg.input_norm:
            self.layer.input_layernorm = nn.Identity()
        if cfg.draft_vocab:  # draft id -> target id (saved with the weights)
            self.register_buffer("vocab_map", torch.arange(cfg.draft_vocab))
        self._sub_head: tuple | None = None
        self.recipe: dict = {}  # how it was trained; saved with the weights
        self.metrics: dict = {}
        self._shared: tuple[nn.Embedding, nn.Linear] | None = None
        self._rope: tuple[torch.Tensor, torch.Tensor] | None = None  # (P, 1, D) cos / sin tables
        self.openings: Openings | None = (
            None  # answer openings verified with the prompt (openings.json beside the head)
        )
        if target is not None:
            self.attach(target)

    # -- the target's shared modules --------------------------------------------------------------
    def attach(self, target) -> DraftHead:
        """Share `target`'s embedding table and LM head (a VLM, or anything with the same attributes)."""
        emb, head = target.language_model.embed_tokens, target.lm_head
        if emb.weight.shape != (self.cfg.vocab_size, self.cfg.hidden_size) or head.weight.shape != (
            self.cfg.vocab_size,
            self.cfg.hidden_size,
        ):
            raise LiteVLMError(
                f"this draft head was built for hidden_size={self.cfg.hidden_size}, vocab_size={self.cfg.vocab_size}; "
                f"the target has embeddings {tuple(emb.weight.shape)}: train a draft head for this model"
            )
        self._shared = (emb, head)
        return self

    def _target(self) -> tuple[nn.Embedding, nn.Linear]:
        if self._shared is None:
            raise LiteVLMError("the draft head is not attached to a target model; call draft.attach(model)")
        return self._shared

    def embed(self, tokens: torch.Tensor) -> torch.Tensor:
        return self._target()[0](tokens)

    def logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The target's LM head over the full vocabulary (training, evaluation)."""
        head = self._target()[1]
        return head(hidden if hidden.dtype == head.weight.dtype else hidden.to(head.weight.dtype))

    def _draft_head(self) -> torch.Tensor:
        """The LM head's rows of the draft vocabulary, gathered once per weight version."""
        w = self._target()[1].weight
        key = (w.data_ptr(), w._version, self.vocab_map.data_ptr(), self.vocab_map._version)
        if self._sub_head is None or self._sub_head[0] != key:
            self._sub_head = (key, w.detach()[self.vocab_map].t().contiguous())  # (C, draft vocab), row-major
        return self._sub_head[1]

    def logprobs(self, hidden: torch.Tensor) -> torch.Tensor:
        """Predicted features (..., C) -> log-probabilities of the token after next over the draft
        vocabulary (..., V or draft_vocab); `topk` maps indices to target token ids."""
        if self.cfg.draft_vocab:
            w = self._draft_head()
            logits = (hidden if hidden.dtype == w.dtype else hidden.to(w.dtype)) @ w
        else:
            logits = self.logits(hidden)
        return torch.log_softmax(logits if logits.dtype == torch.float32 else logits.float(), -1)

    def topk(self, hidden: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor]:
        """(n, C) -> the k most likely next tokens: (log-probs (n, k), target token ids (n, k))."""
        lp, idx = self.logprobs(hidden).topk(k, -1)
        return lp, (self.vocab_map[idx] if self.cfg.draft_vocab else idx)

    def set_draft_vocab(self, token_ids) -> None:
        """The target ids the draft may propose (e.g. the most frequent answer tokens)."""
        ids = torch.as_tensor(token_ids, dtype=torch.long, device=self.fc.weight.device)
        if ids.shape != (self.cfg.draft_vocab,) or int(ids.min()) < 0 or int(ids.max()) >= self.cfg.vocab_size:
            raise LiteVLMError(
                f"a draft vocabulary needs {self.cfg.draft_vocab} distinct token ids below {self.cfg.vocab_size}"
            )
        self.vocab_map.copy_(ids)

    # -- the layer, through its modules -----------------------------------------------------------
    def _qkv(self, x, cos, sin):
        """x (B, T, C), cos / sin (B or 1, T, 1, D) or (T, 1, D) -> RoPE'd q (B, Hq, T, D), k, v (B, Hkv, T, D)."""
        if cos.ndim == 3:
            cos, sin = cos[None], sin[None]
        cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)  # (B or 1, 1, T, D)
        return self.layer.self_attn.qkv(self.layer.input_layernorm(x), cos, sin)

    def _out(self, x, y):
        """Residual + o_proj(attention output y (B, Hq, T, D)), then the MLP block -> (B, T, C)."""
        b, t, _ = x.shape
        layer = self.layer
        x = x + layer.self_attn.o_proj(y.transpose(1, 2).reshape(b, t, -1))  # (B, T, Hq D) -> (B, T, C)
        return x + layer.mlp(layer.post_attention_layernorm(x))

    def _layer(
        self, x, cos, sin, cache: KVCache | None = None, start: int = 0, mask=None, last_only: bool = False
    ) -> torch.Tensor:
        """x (B, T, C) -> (B, T, C). cos / sin (B or 1, T, 1, D). With a cache: write slots start..start+T-1
        and attend over slots 0..start+T-1 where `mask` (1, 1, T, S) allows (None: everything);
        last_only (with a cache, no mask): every row writes its K/V, only the last goes on -> (B, 1, C)."""
        q, k, v = self._qkv(x, cos, sin)
        if cache is None:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None, enable_gqa=True)
        else:
            end = start + x.shape[1]
            cache.k[:, :, start:end] = k
            cache.v[:, :, start:end] = v
            if last_only:  # the last row sees every slot before it
                q, x = q[:, :, -1:], x[:, -1:]
            y = F.scaled_dot_product_attention(
                q, cache.k[:, :, :end], cache.v[:, :, :end], attn_mask=mask, enable_gqa=True
            )
        return self._out(x, y)

    def _cached_layer(self, x: torch.Tensor, cos, sin, start: int, mask=None, last_only: bool = False) -> torch.Tensor:
        """The layer over the draft cache for one sequence, x (n, C) at slots start..start+n-1 -> (n, C)
        (or (1, C) with last_only). mask (1, 1, n, S) or None (everything)."""
        return self._layer(x[None], cos, sin, self.layer.self_attn.kv_cache, start, mask, last_only)[0]

    def fuse(self, features: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        """[embedding ; feature] -> the layer's input (n, C)."""
        return self._fuse(features, next_embeds)

    def _fuse(self, features: torch.Tensor, next_embeds: torch.Tensor) -> torch.Tensor:
        dtype = self.fc.weight.dtype  # the draft may run in another precision than the target
        if features.dtype != dtype or next_embeds.dtype != dtype:
            features, next_embeds = features.to(dtype), next_embeds.to(dtype)
        return linear(torch.cat([next_embeds, features], -1), self.fc)  # [embedding ; feature] -> H

    # -- training ---------------------------------------------------------------------------------
    def forward(
        self, features: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor, mask=None
    ) -> torch.Tensor:
        """Teacher-forced pairs: features f_j (B, T, C), embeddings of x_{j+1} (B, T, C), positions of
        token j (B, T) -> predicted f_{j+1} (B, T, C). Causal attention unless `mask` (B, 1, T, T) is given."""
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, features.dtype)
        return self._layer(self._fuse(features, next_embeds), cos.transpose(1, 2), sin.transpose(1, 2), mask=mask)

    def forward_unrolled(
        self, features: torch.Tensor, next_embeds: torch.Tensor, positions: torch.Tensor, passes: int
    ) -> list[torch.Tensor]:
        """Training-time test (EAGLE-3, arXiv 2503.01840, section 3): pass 1 is `forward`; in pass s
        the input feature of pair i is pass s-1's prediction at pair i-1, i.e. what the head feeds on
        when it drafts s tokens ahead. As in a draft tree, pair i of pass s attends to the teacher-forced
        pairs up to i-s+1 and to its own predicted ancestors (pass r at pair i-s+r). -> predictions per pass."""
        cos, sin = rope_cos_sin(positions, self.cfg.head_dim, self.cfg.rope_theta, features.dtype)
        cos, sin = cos.transpose(1, 2), sin.transpose(1, 2)  # (B, T, 1, D)
        t = features.shape[1]
        x = self._fuse(features, next_embeds)
        q, k, v = self._qkv(x, cos, sin)
        preds = [self._out(x, F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True))]
        keys, values = [k], [v]
        i = torch.arange(t, device=features.device)[:, None]
        j = torch.arange(t, device=features.device)[None, :]
        for s in range(2, passes + 1):
            prev = torch.cat([preds[-1][:, :1], preds[-1][:, :-1]], 1)  # pair i gets the prediction of pair i-1
            x = self._fuse(prev, next_embeds)
            q, k, v = self._qkv(x, cos, sin)
            keys.append(k)
            values.append(v)
            blocks = [j <= i - s + 1] + [j == i - s + r for r in range(2, s + 1)]  # (T, T) each
            mask = torch.cat(blocks, 1)[None, None]  # (1, 1, T, s T)
            y = F.scaled_dot_product_attention(
                q, torch.cat(keys, 2), torch.cat(values, 2), attn_mask=mask, enable_gqa=True
            )
            preds.append(self._out(x, y))
        return preds

    # -- inference over the draft's own static cache ----------------------------------------------
    def setup_cache(self, max_len: int) -> None:
        """Allocate the draft KV cache (one layer): committed pairs, then the tree's scratch entries."""
        p = self.fc.weight
        self.layer.self_attn.kv_cache = KVCache(1, self.cfg.num_kv_heads, max_len, self.cfg.head_dim, p.dtype, p.device)

    @property
    def cache_len(self) -> int:
        cache = self.layer.self_attn.kv_cache
        return 0 if cache is None else cache.max_len

    def prepare(self, cache_len: int, max_position: int) -> None:
        """Ready the draft for a generation: a cache of at least `cache_len` slots and RoPE tables covering
        positions 0..max_position."""
        w = self.fc.weight
        cache = self.layer.self_attn.kv_cache
        if cache is None or cache.max_len < cache_len or cache.k.dtype != w.dtype or cache.k.device != w.device:
            self.setup_cache(cache_len)
        self._rope = rope_table(
            self, self.cfg.head_dim, self.cfg.rope_theta, max_position, w.dtype, w.device
        )  # (P, 1, D)

    def chain_arguments(self) -> tuple:
        """What the native chain reads besides the layer: the target's embedding, fc (2C, C) row-major and its bias,
        the head (C, V') row-major and the draft-vocabulary map (empty: the target's vocabulary)."""
        w = self.fc.weight
        if self.cfg.draft_vocab:
            head, vmap = self._draft_head(), self.vocab_map
        else:
            head, vmap = row_major(self._target()[1]), torch.empty(0, dtype=torch.long, device=w.device)
        return self._target()[0].weight.detach(), row_major(self.fc), self.fc.bias.detach(), head, vmap

    @property
    def rope(self) -> tuple[torch.Tensor, torch.Tensor]:
        """The (P, 1, D) cos / sin tables `prepare` made."""
        if self._rope is None:
            raise LiteVLMError("call draft.prepare(cache_len, max_position) before drafting")
        return self._rope

    def cos_sin(self, positions: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
        return self._cos_sin(positions)

    def _cos_sin(self, positions: torch.Tensor | int) -> tuple[torch.Tensor, torch.Tensor]:
        """cos / sin (T, 1, D) for positions (T,), or (1, 1, D) for one int position shared by all rows."""
        cos, sin = self.rope
        if isinstance(positions, int):
            return cos[positions : positions + 1], sin[positions : positions + 1]
        return cos[positions], sin[positions]

    @torch.no_grad()
    def extend(
        self,
        features: torch.Tensor,
        next_embeds: torch.Tensor,
        positions: torch.Tensor,
        start: int,
        last_only: bool = False,
    ) -> torch.Tensor:
        """Committed pairs (n of them) into draft slots start..start+n-1, causally -> predicted features (n, C).

        features: the target's true features (n, C); next_embeds: what the target consumed at the
        following tokens (n, C); positions (n,): the RoPE positions of the features' tokens.
        last_only: return only the last pair's prediction (1, C), which is all a draft cycle uses; the
        other pairs then only write their K/V (attention, output projection and MLP run on one row).
        """
        x, cos, sin, mask = self.extend_inputs(features, next_embeds, positions, start, last_only)
        return self._cached_layer(x, cos, sin, start, mask, last_only)

    def extend_inputs(self, features, next_embeds, positions, start: int, last_only: bool = False) -> tuple:
        """`extend`'s layer inputs: x (n, C), cos / sin (n, 1, D), the causal mask over slots 0..start+n-1 (None
        for one pair or last_only)."""
        n = features.shape[0]
        cos, sin = self._cos_sin(positions)
        mask = None
        if n > 1 and not last_only:
            rows = torch.arange(start, start + n, device=features.device)[:, None]
            mask = (torch.arange(start + n, device=features.device)[None, :] <= rows)[
                None, None
            ]  # (1, 1, n, start + n)
        return self._fuse(features, next_embeds), cos, sin, mask

    @torch.no_grad()
    def step(
        self, tokens: torch.Tensor, hidden: torch.Tensor, position: int, start: int, mask: torch.Tensor
    ) -> torch.Tensor:
        """k tree nodes at one draft position: tokens (k,), their parents' predicted features (k, C),
        mask (k, S) over draft slots 0..S-1 (S = start + k; None: all) -> predicted features (k, C)."""
        cos, sin = self._cos_sin(position)
        x = self._fuse(hidden, self.embed(tokens))  # (k, C)
        return self._cached_layer(x, cos, sin, start, None if mask is None else mask[None, None])

    # -- checkpoints ------------------------------------------------------------------------------
    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.parameters())

    def save(self, path: str | Path) -> Path:
        """Write path/model.safetensors and path/config.json (config, recipe, metrics). `path` is the
        draft folder itself, conventionally MODEL_DIR/draft."""
        from safetensors.torch import save_file

        out = Path(path)
        out.mkdir(parents=True, exist_ok=True)
        save_file(
            {k: v.detach().cpu().contiguous() for k, v in self.state_dict().items()}, str(out / "model.safetensors")
        )
        meta = {
            "format": DRAFT_FORMAT,
            "version": 1,
            "config": asdict(self.cfg),
            "recipe": self.recipe,
            "metrics": self.metrics,
        }
        (out / "config.json").write_text(json.dumps(meta, indent=1))
        return out

    @classmethod
    def load(cls, path: str | Path, target) -> DraftHead:
        """Load a draft head for `target` from its folder (or from a model folder holding draft/)."""
        from safetensors import safe_open

        path = Path(path)
        if not (path / "config.json").is_file() or _format(path) != DRAFT_FORMAT:
            if (path / DRAFT_SUBDIR / "config.json").is_file():
                path = path / DRAFT_SUBDIR
        if not (path / "config.json").is_file() or not (path / "model.safetensors").is_file():
            raise LiteVLMError(
                f"no draft head at {path}: expected config.json and model.safetensors; "
                "train one with `litevlm train draft`"
            )
        meta = json.loads((path / "config.json").read_text())
        if meta.get("format") != DRAFT_FORMAT:
            raise LiteVLMError(f"{path / 'config.json'} is not a litevlm draft head config")
        try:
            cfg = DraftConfig.from_dict(meta["config"])
        except (TypeError, ValueError, KeyError) as e:
            raise LiteVLMError(f"bad draft config in {path}: {e}") from None
        head = cls(cfg)
        head.recipe, head.metrics = meta.get("recipe", {}), meta.get("metrics", {})
        expected = head.state_dict()
        problems = []
        with safe_open(str(path / "model.safetensors"), framework="pt") as f:
            keys = set(f.keys())
            for k in sorted(keys - set(expected)):
                problems.append(f"unexpected tensor {k}")
            for k in sorted(set(expected) - keys):
                problems.append(f"missing tensor {k}")
            state = {}
            for k in sorted(keys & set(expected)):
                t = f.get_tensor(k)
                if t.shape != expected[k].shape:
                    problems.append(f"{k}: shape {tuple(t.shape)} in the file, {tuple(expected[k].shape)} expected")
                state[k] = t
        if problems:
            raise LiteVLMError(f"draft checkpoint {path} does not match its config: " + "; ".join(problems))
        head.load_state_dict(state)
        head.attach(target)  # checks hidden / vocab sizes against the target
        head.openings = Openings.load(path, cfg.vocab_size)
        w = target.lm_head.weight
        return head.to(device=w.device, dtype=w.dtype).eval()


def _format(path: Path) -> str | None:
    try:
        return json.loads((path / "config.json").read_text()).get("format")
    except (OSError, ValueError):
        return None
