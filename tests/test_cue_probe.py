"""benchmarks/cue_probe.py: the probe reads a linearly separable cue and not a random one."""

from __future__ import annotations

import torch


def test_probe_reads_a_separable_cue_and_not_noise(benchmark_script):
    probe = benchmark_script("cue_probe")
    g = torch.Generator().manual_seed(0)
    x = torch.randn(600, 16, generator=g)
    y = (x[:, 3] + 0.5 * x[:, 7] > 0).long()  # a linear cue
    assert probe.fit_and_score(x[:400], y[:400], x[400:], y[400:], 2, steps=300) > 0.9
    noise = torch.randint(0, 2, (600,), generator=g)  # labels unrelated to the features
    assert probe.fit_and_score(x[:400], noise[:400], x[400:], noise[400:], 2, steps=300) < 0.65


def test_probe_features_cover_every_cue(benchmark_script):
    from litevlm.pipeline import Pipeline

    probe = benchmark_script("cue_probe")
    feats = probe.features(Pipeline.from_pretrained("drive-tiny"), 0, 3)
    assert set(feats) == {"moving", "light", "colour"}
    tok, pat, pix, crops, labels = feats["moving"]
    assert len(tok) == len(pat) == len(pix) == len(crops) == len(labels) > 0
    assert crops[0].shape == (3, *probe.CROP)
    assert pix[0].numel() == 2 * 3 * 14 * 14  # mean and max of each raw 14 x 14 patch
    assert set(labels) <= {0, 1}
    from litevlm.data.synthetic import COLOURS

    assert feats["colour"][4] and set(feats["colour"][4]) <= set(COLOURS)
