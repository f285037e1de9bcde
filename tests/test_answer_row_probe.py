"""benchmarks/answer_row_probe.py: its classifier reads a separable cue and not noise, and the rows it probes are
the decoder's own at the answer position."""

from __future__ import annotations

import numpy as np
import torch

from litevlm.cameras import CAMERAS


def test_ridge_reads_a_separable_cue_and_not_noise(benchmark_script):
    probe = benchmark_script("answer_row_probe")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, 24, generator=g)
    y = x[:, [2, 5, 9]].argmax(1)  # three classes, each the largest of three features: linearly separable
    assert probe.ridge_accuracy(x, y, 400, 3, lam=1.0) > 0.85
    noise = torch.randint(0, 3, (600,), generator=g)
    assert probe.ridge_accuracy(x, noise, 400, 3, lam=1.0) < 0.5


def test_layer_rows_are_the_decoders_answer_row(benchmark_script):
    from litevlm.model.generate import prefill
    from litevlm.pipeline import Pipeline

    probe = benchmark_script("answer_row_probe")
    pipe = Pipeline.from_pretrained("drive-tiny", select_views=True)
    rng = np.random.default_rng(0)
    images = {c: rng.integers(0, 255, (225, 400, 3), dtype=np.uint8) for c in CAMERAS}
    question = "Is <c1,CAM_FRONT,800.0,450.0> moving?"
    with torch.no_grad():
        rows = probe.layer_rows(pipe, question, images)
        lm = pipe.model.language_model
        assert rows.shape == (lm.cfg.num_layers + 1, lm.cfg.hidden_size)
        # the last row after the last layer, through the final norm, is what a prefill of the same prompt ends with
        embeds = pipe.prompt(question, images).embeds
        _, hidden = prefill(pipe.model, embeds, torch.arange(embeds.shape[1])[None])
        # fp32, two codes for the same layers (the probe's layer-by-layer loop, the prefill's fused steps): sums over up
        # to the 640-wide MLP in another order, ~640 eps ~ 8e-5 of the magnitude; a wrong row or layer is off by O(1).
        torch.testing.assert_close(lm.norm(rows[-1]), hidden[0, -1], rtol=1e-4, atol=1e-4)
        # row 0 is the embedding lookup itself, no arithmetic: assert_close's fp32 defaults (1.3e-6 relative) are
        # equality up to the last bit.
        torch.testing.assert_close(rows[0], embeds[0, -1])
        # teacher forcing moves the row: a prefix of the answer changes what the last row sees
        assert not torch.allclose(probe.layer_rows(pipe, question, images, "The"), rows)
