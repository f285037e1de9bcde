"""The static KV cache under tree attention, path commits and the fixed-shape (compiled) path.

A speculative tree is verified in one forward: its n nodes are written at cache slots L..L+n-1 with
RoPE positions L + depth and a mask that lets each node see the prefix and its own ancestors. Every
node's logits must equal decoding its root-to-node path one token at a time, and committing a path
must leave exactly the cache that sequential decoding builds. Tiny random config, fp32.
"""

from __future__ import annotations

import pytest
import torch

from litevlm.config import TextConfig, VisionConfig, VLMConfig
from litevlm.errors import LiteVLMError
from litevlm.model.generate import causal_mask, decode_step, prefill
from litevlm.model.vlm import VLM

# fp32 rounding through the layers: one row and n rows take different matmul kernels. A wrong mask,
# slot or position moves these logits by orders of magnitude more.
ATOL = 3e-5
PREFIX = 7
# A 7-node tree over the prefix: node i's parent (-1: a root, a child of the prefix's last token).
PARENTS = [-1, -1, 0, 0, 1, 2, 5]
CACHE = 24


def tiny_cfg() -> VLMConfig:
    return VLMConfig(
        vision=VisionConfig(
            hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, image_size=28, patch_size=14
        ),
        text=TextConfig(
            vocab_size=128,
            hidden_size=64,
            num_layers=2,
            num_heads=4,
            num_kv_heads=2,
            intermediate_size=96,
            rope_theta=1e4,
            max_position_embeddings=256,
        ),
        image_token_id=127,
        img_start_id=125,
        img_end_id=126,
        eos_token_id=124,
        pad_token_id=0,
    )


@pytest.fixture(scope="module")
def model() -> VLM:
    torch.manual_seed(0)
    m = VLM(tiny_cfg()).eval()
    with torch.no_grad():
        for name, p in m.named_parameters():
            p.copy_(1.0 + 0.1 * torch.randn_like(p) if "norm" in name else 0.2 * torch.randn_like(p))
    return m


@pytest.fixture(scope="module")
def prompt() -> torch.Tensor:
    return torch.randint(0, 120, (1, PREFIX), generator=torch.Generator().manual_seed(1))  # (1, L)


def depths(parents: list[int]) -> list[int]:
    out = []
    for p in parents:
        out.append(0 if p < 0 else out[p] + 1)
    return out


def path_to(node: int, parents: list[int]) -> list[int]:
    path = [node]
    while parents[path[-1]] >= 0:
        path.append(parents[path[-1]])
    return path[::-1]


def tree_mask(parents: list[int], prefix: int, width: int | None = None) -> torch.Tensor:
    """(1, 1, n, width) boolean: every node sees the prefix, itself and its ancestors (slots prefix..prefix+n-1)."""
    n = len(parents)
    width = width or prefix + n
    m = torch.zeros(n, width, dtype=torch.bool)
    m[:, :prefix] = True
    for i in range(n):
        for j in path_to(i, parents):
            m[i, prefix + j] = True
    return m[None, None]


def run_prefix(model: VLM, prompt: torch.Tensor, cache_len: int = CACHE) -> None:
    model.language_model.setup_cache(1, cache_len)
    prefill(model, model.embed(prompt), torch.arange(prompt.shape[1])[None])


@torch.no_grad()
def tree_forward(model: VLM, tokens: torch.Tensor, parents: list[int], full_cache: bool = False) -> torch.Tensor:
    """One forward over all tree nodes after the prefix; returns logits (n, V)."""
    lm, n = model.language_model, len(parents)
    positions = PREFIX + torch.tensor(depths(parents))[None]  # (1, n)
    slots = torch.arange(PREFIX, PREFIX + n)
    if full_cache:  # the compiled-shape path: mask over the whole cache, no slicing
        hidden = lm(lm.embed_tokens(tokens), positions, slots=slots, mask=tree_mask(parents, PREFIX, lm.cache_len))
    else:
        hidden = lm(lm.embed_tokens(tokens), positions, slots=slots, mask=tree_mask(parents, PREFIX), kv_len=PREFIX + n)
    return model.lm_head(hidden)[0]


@torch.no_grad()
def sequential(model: VLM, prompt: torch.Tensor, path_tokens: list[int]) -> torch.Tensor:
    """Logits after decoding `path_tokens` one at a time after the prefix (fresh cache)."""
    run_prefix(model, prompt)
    for i, t in enumerate(path_tokens):
        logits, _ = decode_step(model, torch.tensor([[t]]), PREFIX + i, PREFIX + i)
    return logits[0]


def node_tokens() -> torch.Tensor:
    return torch.randint(0, 120, (1, len(PARENTS)), generator=torch.Generator().manual_seed(2))  # (1, n)


def test_tree_logits_equal_sequential_paths(model, prompt):
    tokens = node_tokens()
    run_prefix(model, prompt)
    tree = tree_forward(model, tokens, PARENTS)
    for node in range(len(PARENTS)):
        path = [int(tokens[0, j]) for j in path_to(node, PARENTS)]
        torch.testing.assert_close(tree[node], sequential(model, prompt, path), atol=ATOL, rtol=0)


@pytest.mark.parametrize("leaf", [3, 4, 6])
def test_commit_path_equals_sequential_cache(model, prompt, leaf):
    tokens = node_tokens()
    path = path_to(leaf, PARENTS)
    path_tokens = [int(tokens[0, j]) for j in path]
    lm = model.language_model

    run_prefix(model, prompt)
    tree_forward(model, tokens, PARENTS)
    lm.commit(PREFIX + torch.tensor(path), PREFIX)
    keep = PREFIX + len(path)
    committed = [
        (layer.self_attn.kv_cache.k[:, :, :keep].clone(), layer.self_attn.kv_cache.v[:, :, :keep].clone())
        for layer in lm.layers
    ]
    after_commit, _ = decode_step(model, torch.tensor([[5]]), keep, keep)  # continue decoding from the committed cache

    expected = sequential(model, prompt, path_tokens + [5])  # also leaves the sequential cache behind
    for (k, v), layer in zip(committed, lm.layers):
        torch.testing.assert_close(k, layer.self_attn.kv_cache.k[:, :, :keep], atol=ATOL, rtol=0)
        torch.testing.assert_close(v, layer.self_attn.kv_cache.v[:, :, :keep], atol=ATOL, rtol=0)
    torch.testing.assert_close(after_commit[0], expected, atol=ATOL, rtol=0)


def test_full_cache_mask_equals_sliced_path(model, prompt):
    tokens = node_tokens()
    run_prefix(model, prompt)
    sliced = tree_forward(model, tokens, PARENTS)
    run_prefix(model, prompt)
    full = tree_forward(model, tokens, PARENTS, full_cache=True)
    torch.testing.assert_close(full, sliced, atol=ATOL, rtol=0)

    # a single decode step, both ways
    lm = model.language_model
    run_prefix(model, prompt)
    ref, _ = decode_step(model, torch.tensor([[9]]), PREFIX, PREFIX)
    run_prefix(model, prompt)
    with torch.no_grad():
        mask = causal_mask(lm.cache_len, PREFIX, 1, "cpu")  # (1, 1, 1, S) over the whole cache
        hidden = lm(
            lm.embed_tokens(torch.tensor([[9]])), torch.tensor([[PREFIX]]), slots=torch.tensor([PREFIX]), mask=mask
        )
    torch.testing.assert_close(model.lm_head(hidden[:, -1]), ref, atol=ATOL, rtol=0)


@torch.no_grad()
def test_prefill_equals_cacheless_forward(model, prompt):
    run_prefix(model, prompt)
    last, _ = prefill(model, model.embed(prompt), torch.arange(PREFIX)[None])
    torch.testing.assert_close(last, model(prompt)[:, -1], atol=ATOL, rtol=0)


def test_prompt_longer_than_cache_raises(model, prompt):
    model.language_model.setup_cache(1, PREFIX - 1)
    with pytest.raises(LiteVLMError, match="KV cache"):
        prefill(model, model.embed(prompt), torch.arange(PREFIX)[None])


def test_placeholder_count_mismatch_raises(model):
    cfg = model.cfg
    pix = torch.randn(2, 3, cfg.vision.image_size, cfg.vision.image_size)
    visual = model.encode_tiles(pix)  # (2, tokens_per_tile, C)
    ids = torch.tensor([[1, 2] + [cfg.image_token_id] * (2 * cfg.tokens_per_tile + 1) + [3]])
    with pytest.raises(LiteVLMError, match="placeholder"):
        model.embed(ids, visual)
    with pytest.raises(LiteVLMError, match="placeholder"):
        model.embed(ids)  # placeholders but no images


def test_wrong_image_size_raises(model):
    s = model.cfg.vision.image_size
    with pytest.raises(LiteVLMError, match=f"\\(tiles, 3, {s}, {s}\\)"):
        model.encode_tiles(torch.randn(1, 3, s + 14, s + 14))
    with pytest.raises(LiteVLMError):
        model.encode_tiles(torch.randn(3, s, s))


def _tiny_vlm():
    torch.manual_seed(0)
    cfg = VLMConfig(
        vision=VisionConfig(32, 1, 2, 64, 28, 14),
        text=TextConfig(64, 32, 2, 2, 1, 64, rope_theta=1e4),
        image_token_id=60,
        img_start_id=61,
        img_end_id=62,
        eos_token_id=63,
        pad_token_id=0,
    )
    return VLM(cfg).eval()
