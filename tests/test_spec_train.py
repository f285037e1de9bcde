"""The draft-head recipe's data alignment and training step, on a tiny random target."""

from __future__ import annotations

import torch

from litevlm.model.generate import generate
from litevlm.spec import DraftConfig, DraftHead, TreeConfig, speculative_generate
from litevlm.train.draft import Sequence, collate, draft_loss, greedy_batch

from test_spec import EOS, one_thread, prompt, tiny_vlm  # noqa: F401  (fixture re-used)


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


def test_a_few_training_steps_fit_the_target_and_help_speculation():
    torch.manual_seed(0)
    model = tiny_vlm(vocab=24, std=0.3)
    model.requires_grad_(False)
    prompts = [prompt(model, s, n=8) for s in range(6)]
    with torch.no_grad():
        out = greedy_batch(model, [e[0] for e, _ in prompts], 24, EOS)
        seqs = [Sequence(torch.cat([e[0], model.language_model.embed_tokens(torch.tensor(a))]), f, 8) for (e, _), (a, f) in zip(prompts, out)]
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
    from litevlm.model.hf import load_native
    from litevlm.train.draft import DraftRecipe, train_draft

    recipe = DraftRecipe(frames=2, max_new_tokens=6, gen_batch=8, minutes=0.2, epochs=3, batch=4, render_size=(112, 63), threads=1)
    out = train_draft(tiny_model_dir, tmp_path / "draft", recipe, progress=False)
    model = load_native(tiny_model_dir)
    head = DraftHead.load(out, model)
    assert head.recipe["frames"] == 2 and head.recipe["seed"] == 0 and head.metrics["steps"] >= 1
    assert 0.0 <= head.metrics["top1"] <= 1.0 and head.metrics["train_sequences"] > 0
