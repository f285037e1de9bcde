"""`litevlm bench` end to end on a tiny random model with every module attached (latency columns are
not asserted: only the table's shape, its consistency and the transformers rows' agreement)."""

import json

import pytest
import torch

from litevlm.eval.bench import RowLog, format_shares, format_table, plot, run_bench
from litevlm.model.layers import bf16_matmul_supported
from litevlm.presets import BF16_CONFIGS, CONFIGS, HF_ROWS


def test_bench_rows_are_consistent(full_model_dir, tmp_path):
    pytest.importorskip("transformers")
    result, per_question = run_bench(str(full_model_dir), n=4, warmup=1, max_new_tokens=6, progress=False)
    rows = {r["config"]: r for r in result["rows"]}
    assert list(rows) == [*CONFIGS, *(BF16_CONFIGS if bf16_matmul_supported() else ()), *HF_ROWS]
    for r in rows.values():
        assert r["total_ms"] > 0 and r["vit_ms"] > 0 and r["prefill_ms"] > 0
        assert r["score"] is not None
    assert rows["baseline"]["speedup"] == 1.0
    assert rows["baseline"]["views"] == 6.0
    # Pruning shortens the prompt; view selection never encodes more views than the baseline.
    assert rows["fastv r=0.3"]["input_tokens"] < rows["fastv r=0.7"]["input_tokens"] < rows["baseline"]["input_tokens"]
    assert rows["litevlm"]["views"] <= 6.0
    # The same views with and without the TokenSelector: only the selector shortens the prompt.
    assert rows["views + eagle"]["views"] == rows["litevlm"]["views"]
    # the TokenSelector prunes only prompts of LITEVLM_MIN_SELECT_TOKENS visual tokens or more
    assert rows["litevlm"]["input_tokens"] <= rows["views + eagle"]["input_tokens"]
    assert rows["eagle"]["tau"] >= 1.0
    assert rows["litevlm fp8"]["precision"].startswith("fp8")
    if bf16_matmul_supported():
        assert rows["litevlm bf16"]["precision"] == rows["baseline bf16"]["precision"] == "bf16-matmul+float32"
        assert rows["litevlm bf16"]["input_tokens"] == rows["litevlm"]["input_tokens"]
    # Speculative decoding is lossless and transformers runs the same weights: same answers, same score.
    assert rows["eagle"]["score"] == rows["baseline"]["score"]
    assert rows["transformers eager"]["score"] == rows["baseline"]["score"]
    assert rows["transformers static"]["score"] == rows["baseline"]["score"]
    for r in rows.values():  # the stage shares of the summed end-to-end time add up to all of it
        assert sum(r["shares"].values()) == pytest.approx(1.0, abs=1e-3)
        assert r["mean_total_ms"] > 0
    log = RowLog()
    log.add(6, 2.0, 100, 3.0, 5.0, 0.0, 4)
    log.add(6, 4.0, 100, 5.0, 1.0, 0.0, 2)
    assert log.shares() == {"vit": 0.3, "select": 0.0, "prefill": 0.4, "decode": 0.3}  # 6 / 20, 8 / 20, 6 / 20
    json.dumps(result)
    assert "| baseline |" in format_table(result)
    assert "| baseline |" in format_shares(result)
    plot(result, tmp_path / "bench.png", per_question)
    assert (tmp_path / "bench.png").stat().st_size > 10_000


def test_cuda_graphs_need_a_gpu_and_a_shape(full_model_dir):
    from litevlm.errors import LiteVLMError

    with pytest.raises(LiteVLMError, match="--shape"):
        run_bench(str(full_model_dir), n=2, warmup=1, max_new_tokens=4, progress=False, cuda_graphs=True)


def test_the_shape_path_runs_every_row_on_random_weights(full_model_dir, monkeypatch):
    """`--shape NAME` (the GPU table on random weights, latency only): every configuration runs at a preset's
    shapes, here a tiny one on the CPU, with no scores and no transformers rows."""
    from litevlm import config
    from litevlm.config import TextConfig, VisionConfig, VLMConfig

    monkeypatch.setitem(
        config.PRESETS,
        "tiny-test",
        lambda: VLMConfig(
            vision=VisionConfig(
                hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64, image_size=28, patch_size=7
            ),
            text=TextConfig(
                vocab_size=4096, hidden_size=64, num_layers=2, num_heads=4, num_kv_heads=2, intermediate_size=128
            ),
            image_token_id=5,
            img_start_id=3,
            img_end_id=4,
            eos_token_id=2,
            pad_token_id=0,
            name="tiny-test",
        ),
    )
    result, _ = run_bench(str(full_model_dir), n=2, warmup=1, max_new_tokens=5, shape="tiny-test", progress=False)
    rows = {r["config"]: r for r in result["rows"]}
    assert list(rows) == list(CONFIGS)  # no bf16 or transformers rows at a preset's shapes
    for r in rows.values():
        assert r["score"] is None and r["total_ms"] > 0
    # tiny-test prompts hold fewer visual tokens than the threshold: the selector leaves them whole
    assert rows["litevlm"]["input_tokens"] == rows["views + eagle"]["input_tokens"]
    assert result["model"] == "random weights, tiny-test shapes"


def test_rows_can_be_chosen_by_name(full_model_dir):
    from litevlm.errors import LiteVLMError
    from litevlm.presets import configs_named

    chosen = configs_named("litevlm, baseline")
    assert list(chosen) == ["baseline", "litevlm"]  # the table's order, whatever the list's
    assert chosen["litevlm"] == CONFIGS["litevlm"]
    with pytest.raises(LiteVLMError, match="unknown bench rows"):
        configs_named("baseline,turbo")
    result, _ = run_bench(
        str(full_model_dir), n=2, warmup=1, max_new_tokens=4, configs=chosen, hf=False, progress=False
    )
    assert [r["config"] for r in result["rows"]] == ["baseline", "litevlm"]


def test_bench_on_a_transformers_checkpoint_gives_transformers_the_pipelines_inputs(
    tmp_path, tiny_tokenizer, capsys, monkeypatch
):
    """`bench --model <-hf folder> --data --images` with the format flags: the pipeline prompts in the checkpoint's
    chat template (a system turn) and dynamic tiling, and transformers' generate gets the very same ids and tiles."""
    transformers = pytest.importorskip("transformers")
    from test_quant_data import TILING, write_drivelm, write_hf_checkpoint

    from litevlm.cameras import CAMERAS
    from litevlm.cli import main
    from litevlm.data.source import load_data
    from litevlm.model.prompt import build_prompt
    from litevlm.pipeline import Pipeline

    hf_dir = write_hf_checkpoint(tmp_path / "tiny-hf", tiny_tokenizer)
    data, images = write_drivelm(tmp_path / "data")
    seen = []
    generate = transformers.InternVLForConditionalGeneration.generate

    def recording(self, *args, **kwargs):
        seen.append((kwargs["input_ids"].clone(), kwargs["pixel_values"].clone()))
        return generate(self, *args, **kwargs)

    monkeypatch.setattr(transformers.InternVLForConditionalGeneration, "generate", recording)
    argv = ["bench", "--model", str(hf_dir), "--data", str(data), "--images", str(images), "--configs", "baseline"]
    assert (
        main([*argv, "--max-tiles", "2", "--thumbnail", "--n", "2", "--warmup", "1", "--max-new-tokens", "4", "--json"])
        == 0
    )
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    rows = {r["config"]: r for r in result["rows"]}
    assert list(rows) == ["baseline", *HF_ROWS] and result["questions"] == 2
    assert rows["baseline"]["input_tokens"] == rows["transformers eager"]["input_tokens"]
    assert rows["transformers eager"]["score"] == rows["transformers static"]["score"] == rows["baseline"]["score"]

    pipe = Pipeline.from_pretrained(hf_dir, **TILING)
    samples = load_data(data, images)[:3]  # the warm-up question and the two measured ones
    assert len(seen) == 2 * len(samples)  # eager and static cache, question by question
    for i, s in enumerate(samples):
        ids = pipe.prompt(s.question, s.images).ids
        pixels, counts = pipe.tiles(s.images, list(CAMERAS))
        assert counts == [12] * 6  # 2x1 tiles + thumbnail, 4 tokens each
        for got_ids, got_pixels in seen[2 * i : 2 * i + 2]:
            assert torch.equal(got_ids, ids) and torch.equal(got_pixels, pixels)
        # the old fixed ChatML prompt without the checkpoint's system turn would not have matched
        assert ids[0].tolist() != build_prompt(pipe.tokenizer, s.question, list(CAMERAS), 12).ids


def test_bench_refuses_transformers_rows_on_fp8_weights_and_format_options_with_a_shape(full_model_dir, tmp_path):
    from litevlm.errors import LiteVLMError
    from litevlm.model.hf import load_native
    from litevlm.presets import configs_named
    from litevlm.quant.fp8 import FP8Recipe, quantize_model, save_fp8

    model = load_native(full_model_dir)
    recipe = FP8Recipe("fp8-dynamic-per-row")
    fp8 = save_fp8(model, tmp_path / "fp8", recipe, quantize_model(model, recipe), full_model_dir)
    baseline = configs_named("baseline")
    with pytest.raises(LiteVLMError, match="--no-transformers"):
        run_bench(str(fp8), n=1, warmup=0, max_new_tokens=2, configs=baseline, progress=False)
    result, _ = run_bench(str(fp8), n=1, warmup=0, max_new_tokens=2, configs=baseline, hf=False, progress=False)
    assert result["rows"][0]["precision"].startswith("fp8-dynamic-per-row")
    with pytest.raises(LiteVLMError, match="no model or format options"):
        run_bench(str(full_model_dir), n=1, shape="2b", load={"max_tiles": 4}, progress=False)
