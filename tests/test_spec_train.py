"""The draft-head recipe's data alignment and training step, on a tiny random target."""

from __future__ import annotations

import pytest
import torch
from test_spec import EOS, one_thread, prompt, tiny_vlm  # noqa: F401  (fixture re-used)

from litevlm.model.generate import generate
from litevlm.spec import DraftConfig, DraftHead, TreeConfig, speculative_generate
from litevlm.train.draft import Sequence, collate, draft_loss, greedy_batch


def test_greedy_batch_matches_plain_generation_and_records_features():
    model = tiny_vlm(vocab=24)
    prompts = [prompt(model, s, n=n) for s, n in [(0, 9), (1, 12), (2, 5)]]
    with torch.no_grad():
        embeds = [e[0] for e, _ in prompts]
    out = greedy_batch(model, embeds, 20, EOS)
    model.language_model.setup_cache(1, 64)
    lm = model.language_model
    for (e, pos), (answer, feats) in zip(prompts, out):
        ref = generate(model, e, pos, 20, EOS)
        assert answer == ref.tokens
        seq = torch.cat([e[0], lm.embed_tokens(torch.tensor(answer))])
        with torch.no_grad():
            want = lm(seq[None, :-1], torch.arange(seq.shape[0] - 1)[None])[0]  # features at all but the last token
        # features gathered during generation (a prefill, then one-row decode steps) against one causal forward: other
        # matmul shapes, fp32 sums reordered over 20 steps' caches, ~1e-5 relative; 1e-4 of O(1), a wrong row is O(1).
        torch.testing.assert_close(feats, want, rtol=1e-4, atol=1e-4)


def test_pairs_are_aligned_and_only_answer_pairs_are_trained():
    c = 4
    n, t = 9, 5  # 5 prompt tokens, 4 answer tokens (the last one EOS)
    embeds = torch.arange(n, dtype=torch.float16)[:, None].expand(n, c)  # row i holds i: x_i
    feats = 100 + torch.arange(n - 1, dtype=torch.float16)[:, None].expand(n - 1, c)  # f_i = 100 + i
    short = Sequence(embeds[:7], feats[:6], t)
    b = collate([Sequence(embeds, feats, t), short], "cpu")
    assert b["feats"].shape == (2, 8, c)
    j = 6
    assert b["feats"][0, j, 0] == 100 + j and b["nxt"][0, j, 0] == j + 1 and b["target"][0, j, 0] == 100 + j + 1
    # pair j predicts f_{j+1} and through it x_{j+2}: answer pairs are j = t-1 .. n-3
    assert b["mask"][0].nonzero().squeeze(1).tolist() == list(range(t - 1, n - 2))
    assert b["mask"][1].nonzero().squeeze(1).tolist() == list(range(t - 1, 7 - 2))
    assert b["positions"][1].tolist() == list(range(8))
    # a windowed draft sees the last 3 prompt tokens, at their own positions
    w = collate([Sequence(embeds, feats, t).window(3)], "cpu")
    assert w["positions"][0].tolist() == list(range(2, 8)) and w["feats"][0, 0, 0] == 102 and w["nxt"][0, 0, 0] == 3
    assert w["mask"][0].nonzero().squeeze(1).tolist() == list(range(2, n - 2 - 2))


def test_a_few_training_steps_fit_the_target_and_help_speculation():
    torch.manual_seed(0)
    model = tiny_vlm(vocab=24, std=0.3)
    model.requires_grad_(False)
    prompts = [prompt(model, s, n=8) for s in range(6)]
    with torch.no_grad():
        out = greedy_batch(model, [e[0] for e, _ in prompts], 24, EOS)
        seqs = [
            Sequence(torch.cat([e[0], model.language_model.embed_tokens(torch.tensor(a))]), f, 8)
            for (e, _), (a, f) in zip(prompts, out)
        ]
    head = DraftHead(DraftConfig.for_target(model.cfg.text), model)
    opt = torch.optim.AdamW(head.parameters(), lr=3e-3)
    batch = collate(seqs, "cpu")
    first = None
    for _ in range(150):
        loss, stats = draft_loss(head, batch, noise=0.05)
        first = first if first is not None else loss.item()
        opt.zero_grad()
        loss.backward()
        opt.step()
    assert loss.item() < 0.5 * first and stats["acc"] > 0.8
    head.eval()
    model.language_model.setup_cache(1, 64)
    e, pos = prompts[0]
    out = speculative_generate(model, head, e, pos, 24, EOS, tree=TreeConfig(2, 4, 8))
    assert out.tokens == generate(model, e, pos, 24, EOS).tokens
    assert sum(out.accept_lengths) / len(out.accept_lengths) > 1.5  # the trained head drafts accepted tokens


def test_train_draft_end_to_end_on_a_saved_model(tiny_model_dir, tmp_path):
    import shutil

    from litevlm.model.hf import load_native
    from litevlm.train.draft import DraftRecipe, train_draft

    model_dir = tmp_path / "model"
    shutil.copytree(tiny_model_dir, model_dir)
    recipe = DraftRecipe(
        frames=2, max_new_tokens=6, gen_batch=8, minutes=0.2, epochs=3, batch=4, render_size=(112, 63), threads=1
    )
    out = train_draft(model_dir, None, recipe, progress=False)
    assert out == model_dir / "draft" and (model_dir / "prompt.json").is_file()
    head = DraftHead.load(out, load_native(model_dir))
    assert head.recipe["frames"] == 2 and head.recipe["seed"] == 0 and head.metrics["steps"] >= 1
    assert head.recipe["data"] == "synthetic" and head.recipe["answers"] == "target"
    assert 0.0 <= head.metrics["top1"] <= 1.0 and head.metrics["train_sequences"] > 0
    with pytest.raises(ValueError, match="passes"):
        train_draft(model_dir, tmp_path / "bad", DraftRecipe(passes=0), progress=False)
    assert not (tmp_path / "bad").exists()


def test_unrolled_passes_match_drafting_on_own_predictions():
    """Pass s at pair i = extend the true pairs up to i-s+1, then s-1 draft steps on predicted features."""
    model = tiny_vlm()
    torch.manual_seed(3)
    head = DraftHead(DraftConfig.for_target(model.cfg.text), model).eval()
    with torch.no_grad():
        for p in head.parameters():
            if p.ndim >= 2:
                p.normal_(0, 0.3)
    g = torch.Generator().manual_seed(0)
    feats, nxt = torch.randn(1, 10, 32, generator=g), torch.randn(1, 10, 32, generator=g)
    tokens = torch.randint(8, 64, (10,), generator=g)
    nxt = model.language_model.embed_tokens(tokens)[None].detach()  # x_{j+1} of pair j is a real token
    pos = torch.arange(10)[None]
    with torch.no_grad():
        preds = head.forward_unrolled(feats, nxt, pos, 3)
        # pass 0 of the unrolled forward is the plain forward's code: fp32 defaults, a bit at most.
        torch.testing.assert_close(preds[0], head(feats, nxt, pos))
        head.prepare(32, 64)
        for s, i in [(2, 6), (3, 7), (3, 9)]:
            root = i - s + 1  # the last teacher-forced pair
            h = head.extend(feats[0, : root + 1], nxt[0, : root + 1], pos[0, : root + 1], 0)[-1:]
            for lvl in range(1, s):
                h = head.step(tokens[root + lvl : root + lvl + 1], h, root + lvl, root + lvl, None)
            # the cached step-by-step draft against the unrolled training forward: other shapes and cache lengths, fp32
            # sums reordered through s draft steps; 1e-4 of O(1) states.
            torch.testing.assert_close(h[0], preds[s - 1][0, i], rtol=1e-4, atol=1e-4)


def test_the_cli_passes_the_model_data_and_recipe_to_the_recipe(monkeypatch, tmp_path, capsys):
    from litevlm import cli
    from litevlm.train import draft as draft_training

    seen = []

    def fake(loaded, out, recipe, *, samples, data, offline, d):
        assert d.world_size == 1  # not under torchrun
        seen.append((loaded, out, recipe, samples, data, offline))
        (tmp_path / "config.json").write_text(
            '{"metrics": {"top1": 0.5, "chain_accept": 1.5, "validation": "v",'
            ' "val_sequences": 3, "train_sequences": 9}}'
        )
        return tmp_path

    monkeypatch.setattr(draft_training, "train_draft", fake)
    monkeypatch.setattr("litevlm.options.load_model_from_args", lambda args: ("loaded", args.model))
    assert cli.main(["train", "draft", "--model", "m", "--frames", "3", "--intermediate", "0"]) in (0, None)
    assert cli.main(["train", "draft", "--frames", "3", "--out", "o", "--offline", "c"]) in (0, None)
    assert seen[0][0] == ("loaded", "m") and seen[1][0] == ("loaded", "drive-tiny")  # --model, bundled by default
    assert seen[0][2].intermediate_size == 0 and seen[0][2].frames == 3  # 0: the target's width
    assert seen[1][2].intermediate_size == draft_training.DraftRecipe().intermediate_size  # the default stays
    assert seen[0][1:] == (None, seen[0][2], None, "", None) and (seen[1][1], seen[1][5]) == ("o", "c")
    assert "top-1 agreement 0.500" in capsys.readouterr().out
