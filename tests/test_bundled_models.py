"""Every bundled model (drive-tiny, drive-hd) opens in transformers as an InternVL checkpoint and comes back exactly:
the same logits on a real six-camera prompt, the same greedy answer, the same weights after the round trip."""

import pytest
import torch

transformers = pytest.importorskip("transformers", reason="pip install 'litevlm[hf]'")

from litevlm.model.hf import load_hf, load_native, save_hf  # noqa: E402
from litevlm.models import WEIGHTS_DIR  # noqa: E402
from litevlm.pipeline import Pipeline  # noqa: E402

BUNDLED = sorted(d.name for d in WEIGHTS_DIR.iterdir() if (d / "config.json").is_file())


@pytest.fixture(scope="module")
def scene():
    from litevlm.data.synthetic import make_frame, render_views

    frame = make_frame(5, 1)
    return render_views(frame, size=(400, 225)), frame.qas[0].question


def test_both_embedded_models_are_bundled():
    assert {"drive-tiny", "drive-hd"} <= set(BUNDLED)


@pytest.mark.parametrize("name", BUNDLED)
@torch.no_grad()
def test_a_bundled_model_round_trips_through_transformers(name, scene, tmp_path):
    images, question = scene
    pipe = Pipeline.from_pretrained(name, max_new_tokens=12, backend="modules")
    ours = pipe.model
    p = pipe.prompt(question, images)
    pixels, _ = pipe.tiles(images, p.views)
    save_hf(ours, tmp_path / "hf", tokenizer=pipe.tokenizer)
    hf = transformers.InternVLForConditionalGeneration.from_pretrained(tmp_path / "hf", attn_implementation="eager")
    hf.eval()
    ref = hf(input_ids=p.ids, pixel_values=pixels).logits[0, -1]
    got = ours(p.ids, pixels)[0, -1]
    # two implementations of the same fp32 model over a prompt of a few hundred tokens: sums in another order.
    assert float((ref - got).abs().max() / ref.abs().max()) < 1e-4
    want = pipe.answer(question, images).tokens
    out = hf.generate(input_ids=p.ids, pixel_values=pixels, max_new_tokens=len(want), do_sample=False)
    assert out[0, p.ids.shape[1] :].tolist()[: len(want)] == want
    back, _ = load_hf(tmp_path / "hf")
    native = load_native(WEIGHTS_DIR / name)
    assert back.cfg.downsample_ratio == native.cfg.downsample_ratio
    assert back.cfg.tiles_per_view == native.cfg.tiles_per_view
    for (k, a), (_, b) in zip(sorted(native.state_dict().items()), sorted(back.state_dict().items())):
        assert torch.equal(a.float(), b.float()), k
