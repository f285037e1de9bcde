"""`litevlm bench` end to end on a tiny random model with every module attached (latency figures are not
asserted: only the table's shape, its consistency (stage means and other adding up to the mean total, speed-ups the
ratio of mean totals, an emulated precision no speed figure) and the transformers rows' agreement)."""

import json

import pytest
import torch

from litevlm.eval.bench import STAGES, RowLog, format_shares, format_table, plot, run_bench, speed_figure
from litevlm.model.layers import bf16_matmul_supported
from litevlm.presets import BF16_CONFIGS, CONFIGS, HF_ROWS
from litevlm.quant.fp8 import fp8_kernel_available

STAGE_NAMES = ("select_views", "vit", "select_tokens", "prefill", "decode")  # written out: not the bench's own list


def watch_answers(monkeypatch) -> dict[str, list]:
    """Every answer the bench's pipelines give, each with the wall ms of our own clock around it (inside the bench's
    own): row name -> [(ms, Answer)], in the order answered, warm-up included. Both ways of asking (the pipeline, a
    frame) go through the pipeline's `stream_frame`, watched here."""
    import time

    import litevlm.eval.bench as bench

    seen: dict[str, list] = {}
    make = bench._pipelines

    def pipelines(*args, **kw):
        pipes = make(*args, **kw)
        for name, pipe in pipes.items():

            def timed(question, frame, stream_frame=pipe.stream_frame, log=seen.setdefault(name, [])):
                t0 = time.perf_counter()
                for item in stream_frame(question, frame):
                    yield item
                log.append(((time.perf_counter() - t0) * 1e3, item))

            monkeypatch.setattr(pipe, "stream_frame", timed)
        return pipes

    monkeypatch.setattr(bench, "_pipelines", pipelines)
    return seen


def check_row_clock(rows: list[dict], counted: list, eps: float = 2e-3) -> None:
    """Rows (one, or a frame-mode pair) against the answers they hold, watched from outside (`watch_answers`): the
    stage and preprocessing means are the answers' own, the rows' e2e holds our clock around each answer (the bench's
    encloses it), and the stages with the preprocessing fit in e2e."""
    n = len(counted) // len(rows)  # answers a row: its figures are means over them
    assert n > 0 and n * len(rows) == len(counted)

    def summed(key: str) -> float:
        return sum(r[key] for r in rows) * n

    def answers_sum(key: str) -> float:
        return sum(a.timings_ms.get(key, 0.0) for _, a in counted)

    for key in (*STAGE_NAMES, "preprocess"):
        assert summed(f"{key}_ms") == pytest.approx(answers_sum(key), abs=eps * n), key
    assert summed("e2e_ms") >= sum(ms for ms, _ in counted) - eps * n
    for ms, a in counted:
        assert a.timings_ms["total"] + a.timings_ms.get("preprocess", 0.0) <= a.timings_ms["e2e"] + 1e-3 <= ms + 2e-3
    for r in rows:
        assert sum(r[f"{s}_ms"] for s in STAGE_NAMES) + r["preprocess_ms"] <= r["e2e_ms"] + eps
        assert r["e2e_ms"] == pytest.approx(r["total_ms"] + r["preprocess_ms"], abs=eps)


def test_bench_rows_are_consistent(full_model_dir, tmp_path, monkeypatch):
    pytest.importorskip("transformers")
    import time

    seen = watch_answers(monkeypatch)
    t0 = time.perf_counter()
    result, per_question = run_bench(str(full_model_dir), n=4, warmup=1, max_new_tokens=6, progress=False)
    wall = (time.perf_counter() - t0) * 1e3  # the caller's own clock around the whole run
    rows = {r["config"]: r for r in result["rows"]}
    # our pipelines' rows against the answers they hold (the first, the warm-up's, not counted), and every answer
    # the rows count within the caller's wall
    assert set(seen) == set(CONFIGS) | (set(BF16_CONFIGS) if bf16_matmul_supported() else set())
    for name, answered in seen.items():
        check_row_clock([rows[name]], answered[1:])
    assert sum(rows[name]["e2e_ms"] * 4 for name in seen) <= wall
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
    # FP8 without FP8 kernels (a CPU) is an accuracy row, whose times are no speed figure.
    fp8 = rows["litevlm fp8"]
    emulated = not fp8_kernel_available(torch.device(result["device"]))
    assert fp8["emulated"] is emulated and fp8["speed_figure"] is not emulated and fp8["score"] is not None
    assert (fp8["speedup"] is None) is emulated
    base = rows["baseline"]
    for r in rows.values():
        stages = [r[f"{s}_ms"] for s in STAGES]
        # Means over the questions: the five stages and other add up to the mean total, p50 and p90 beside it.
        assert sum(stages) + r["other_ms"] == pytest.approx(r["total_ms"], abs=1e-6)
        assert r["vit_ms"] + r["prefill_ms"] + r["decode_ms"] + r["select_ms"] + r["other_ms"] == pytest.approx(
            r["total_ms"], abs=1e-6
        )
        assert r["select_ms"] == pytest.approx(r["select_views_ms"] + r["select_tokens_ms"], abs=1e-6)
        assert r["other_ms"] >= -0.01  # an answer's end-to-end time holds its stages (less rounding)
        assert 0 < r["p50_total_ms"] <= r["p90_total_ms"]
        # The speed-up is the ratio of the mean totals, for every row timed at a precision that runs natively.
        if r["speed_figure"]:
            assert r["speedup"] == round(base["total_ms"] / r["total_ms"], 2)
        if r["decode_tokens"]:
            assert r["extend_one_ms"] == pytest.approx(r["decode_ms"] / r["decode_tokens"], rel=1e-2, abs=2e-3)
        assert 0 < r["visual_tokens"] < r["input_tokens"]
        # the fields of the median-based rows are still there: the mean total under its old name, the shares
        assert r["mean_total_ms"] == r["total_ms"]
        assert sum(r["shares"].values()) == pytest.approx(1.0, abs=1e-3)
    assert rows["transformers eager"]["visual_tokens"] == base["visual_tokens"]  # the baseline's own prompt
    assert rows["transformers eager"]["other_ms"] == pytest.approx(0.0, abs=0.005)  # generate holds the whole answer
    # the images' preprocessing is timed apart from the total, the transformers rows' own (PIL's resize) too
    assert base["preprocess_ms"] > 0 and rows["transformers eager"]["preprocess_ms"] > 0
    for r in rows.values():  # e2e: from the images as given, preprocessing included; its speed-up a ratio of means
        assert r["e2e_ms"] == pytest.approx(r["total_ms"] + r["preprocess_ms"], abs=2e-3)
        assert r["p50_e2e_ms"] <= r["p90_e2e_ms"]
        if r["speed_figure"]:
            assert r["e2e_speedup"] == round(base["e2e_ms"] / r["e2e_ms"], 2)
            assert r["preprocess_share"] == pytest.approx(r["preprocess_ms"] / r["e2e_ms"], abs=1e-3)
    assert rows["litevlm"]["visual_tokens"] <= base["visual_tokens"]
    assert rows["fastv r=0.3"]["visual_tokens"] < rows["fastv r=0.7"]["visual_tokens"] < base["visual_tokens"]
    json.dumps(result)
    table = format_table(result)
    if emulated:
        speed, accuracy = table.split("accuracy rows")
        assert "| baseline |" in speed and "| litevlm fp8 |" not in speed
        assert "| litevlm fp8 | fp8-dynamic-per-row" in accuracy
    shares = format_shares(result)
    assert "| baseline |" in shares and ("| litevlm fp8 |" in shares) is not emulated
    plot(result, tmp_path / "bench.png", per_question)
    assert (tmp_path / "bench.png").stat().st_size > 10_000


def answers(log: RowLog, rows) -> RowLog:
    """Answers with these stage times (vit, prefill, decode) and end-to-end times into `log`."""
    for vit, prefill, decode, total in rows:
        stages = {"select_views": 0.5, "vit": vit, "prefill": prefill, "decode": decode}
        log.add(views=6, visual_tokens=96, input_tokens=140, stages=stages, new_tokens=5, total=total)
    return log


def test_a_row_is_means_whose_stages_and_other_add_up_and_its_speedup_is_the_ratio_of_means():
    # Medians and means disagree here: the baseline has one slow answer, LiteVLM does not.
    base = answers(RowLog(), [(10.0, 10.0, 9.0, 30.0), (10.0, 10.0, 9.0, 30.0), (10.0, 10.0, 99.5, 120.0)])
    lite = answers(RowLog(), [(4.0, 4.0, 1.0, 10.0), (4.0, 4.0, 1.0, 10.0), (4.0, 4.0, 7.0, 16.0)])
    b = base.row("baseline", base.mean_total(), None)
    r = lite.row("litevlm", base.mean_total(), None)
    assert b["total_ms"] == 60.0 and r["total_ms"] == 12.0  # means, not the medians 30 and 10
    assert r["speedup"] == 5.0 and b["speedup"] == 1.0  # 60 / 12, where the medians would say 3
    assert (b["p50_total_ms"], b["p90_total_ms"]) == (30.0, 102.0)  # 30, 30, 120: the 90th percentile interpolated
    assert (b["vit_ms"], b["prefill_ms"], b["decode_ms"], b["select_views_ms"]) == (10.0, 10.0, 39.167, 0.5)
    assert b["other_ms"] == 0.333  # 60 less the rounded stages: they add up exactly to the total
    assert r["other_ms"] == 0.5 and r["select_ms"] == 0.5 and r["select_tokens_ms"] == 0.0
    for row in (b, r):
        assert sum(row[f"{s}_ms"] for s in STAGES) + row["other_ms"] == pytest.approx(row["total_ms"], abs=1e-9)
    assert r["decode_tokens"] == 4.0 and r["extend_one_ms"] == 0.75  # decode ms per token made after the first
    assert r["visual_tokens"] == 96.0 and r["input_tokens"] == 140.0
    assert r["mean_total_ms"] == r["total_ms"] and r["shares"] == {
        "vit": 0.3333,
        "select": 0.0417,
        "prefill": 0.3333,
        "decode": 0.25,
        "other": 0.0417,
    }
    # Without an end-to-end time an answer is its stages: other is 0.
    log = RowLog()
    log.add(
        views=6, visual_tokens=96, input_tokens=100, stages={"vit": 2.0, "prefill": 3.0, "decode": 5.0}, new_tokens=4
    )
    log.add(
        views=6, visual_tokens=96, input_tokens=100, stages={"vit": 4.0, "prefill": 5.0, "decode": 1.0}, new_tokens=2
    )
    assert log.row("x", None, None)["other_ms"] == 0.0 and log.row("x", None, None)["speedup"] is None
    assert log.shares() == {"vit": 0.3, "select": 0.0, "prefill": 0.4, "decode": 0.3, "other": 0.0}
    with pytest.raises(ValueError, match="preprocess"):
        log.add(views=6, visual_tokens=1, input_tokens=1, stages={"preprocess": 1.0}, new_tokens=1)


def test_an_emulated_precision_is_an_accuracy_row_and_no_speed_figure(tmp_path):
    base = answers(RowLog(), [(10.0, 10.0, 9.0, 30.0)])
    fp8 = answers(RowLog(precision="fp8-dynamic-per-row+float32", emulated=True), [(50.0, 50.0, 9.0, 110.0)])
    rows = [base.row("baseline", base.mean_total(), 0.5), fp8.row("litevlm fp8", base.mean_total(), 0.49)]
    assert rows[1]["speedup"] is None and rows[1]["speed_figure"] is False and rows[1]["emulated"] is True
    assert rows[1]["score"] == 0.49 and rows[1]["total_ms"] == 110.0  # measured and kept, but not a speed figure
    result = {"rows": rows, "model": "m", "device": "cpu", "questions": 1}
    speed, accuracy = format_table(result).split("accuracy rows")
    assert "| litevlm fp8 |" not in speed and "| litevlm fp8 | fp8-dynamic-per-row+float32 |" in accuracy
    assert "110.0" not in accuracy  # no time is shown for it
    assert "| litevlm fp8 |" not in format_shares(result)
    plot(
        result,
        tmp_path / "p.png",
        {"litevlm fp8": {"views": [6], "vit": [50.0], "input_tokens": [140]} | {"prefill": [50.0], "emulated": True}},
    )
    assert (tmp_path / "p.png").stat().st_size > 10_000
    # rows written before the flag: an FP8 row is taken for emulated, any other for a speed figure
    assert not speed_figure({"precision": "fp8-dynamic-per-row+float32"}) and speed_figure({"precision": "float32"})


def test_cuda_graphs_need_a_gpu_and_a_checkpoint_on_it(full_model_dir, monkeypatch):
    """The CUDA backend's rows measure a GPU: refused on a machine without one (the twin named), and for a
    checkpoint left on the CPU (--device cuda named)."""
    from litevlm.errors import LiteVLMError

    with pytest.raises(LiteVLMError, match="cuda-twin"):
        run_bench(str(full_model_dir), n=2, warmup=1, max_new_tokens=4, progress=False, cuda_graphs=True)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    with pytest.raises(LiteVLMError, match="--device cuda"):
        run_bench(str(full_model_dir), n=2, warmup=1, max_new_tokens=4, progress=False, backend="cuda")


@pytest.fixture
def tiny_shape(monkeypatch):
    """A preset named tiny-test, small enough for `--shape` on the CPU."""
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
    return "tiny-test"


def test_the_shape_path_runs_every_row_on_random_weights(full_model_dir, tiny_shape):
    """`--shape NAME` (the GPU table on random weights, latency only): every configuration runs at a preset's
    shapes, here a tiny one (on the CPU, or the GPU where there is one), transformers' rows included, with no scores;
    FP8 is an accuracy row where it is emulated."""
    result, _ = run_bench(str(full_model_dir), n=2, warmup=1, max_new_tokens=5, shape="tiny-test", progress=False)
    rows = {r["config"]: r for r in result["rows"]}
    assert list(rows) == [*CONFIGS, *HF_ROWS]  # no bf16 rows at a preset's shapes
    # transformers answers the same prompt with the same random weights, to max_new_tokens like ours
    for name in HF_ROWS:
        assert rows[name]["input_tokens"] == rows["baseline"]["input_tokens"]
        assert rows[name]["decode_tokens"] == rows["baseline"]["decode_tokens"] == 4
    for r in rows.values():
        assert r["score"] is None and r["total_ms"] > 0
    emulated = not fp8_kernel_available(torch.device(result["device"]))
    assert rows["litevlm fp8"]["speed_figure"] is not emulated and (rows["litevlm fp8"]["speedup"] is None) is emulated
    assert all(r["speedup"] is not None for r in rows.values() if r["config"] != "litevlm fp8")
    # tiny-test prompts hold fewer visual tokens than the threshold: the selector leaves them whole
    assert rows["litevlm"]["input_tokens"] == rows["views + eagle"]["input_tokens"]
    assert result["model"] == "random weights, tiny-test shapes"
    assert result["peak_memory_mb"] > 0


def test_rows_at_a_preset_shape_share_one_set_of_weights(full_model_dir, tiny_shape):
    """A 2B model in fp32 is 9 GB: the rows of `--shape` hold their random weights (and the native steps' packing of
    them) once, each row on its own modules, so that quantising one row or caching in one leaves the others alone."""
    from litevlm.data.drivelm import samples_from_frame
    from litevlm.data.synthetic import make_frame, render_views
    from litevlm.eval.bench import random_pipeline
    from litevlm.quant.fp8 import FP8Linear

    weights = {}
    plain = random_pipeline("tiny-test", str(full_model_dir), 4, weights=weights)
    fp8 = random_pipeline("tiny-test", str(full_model_dir), 4, weights=weights, fp8="fp8-dynamic-per-row")
    eagle = random_pipeline("tiny-test", str(full_model_dir), 4, weights=weights, speculative=True)
    assert len({id(p.model) for p in (plain, fp8, eagle)}) == 3
    for (name, p), q in zip(eagle.model.named_parameters(), plain.model.parameters()):
        assert p.data_ptr() == q.data_ptr(), name
    assert not any(isinstance(m, FP8Linear) for p in (plain, eagle) for m in p.model.modules())
    assert any(isinstance(m, FP8Linear) for m in fp8.model.modules())
    # each row's own KV cache; what the first row's warm-up derived from the weights, shared
    k = [p.model.language_model.layers[0].self_attn.kv_cache.k for p in (plain, eagle)]
    assert k[0].data_ptr() != k[1].data_ptr()
    derived = [p.model.vision_tower.encoder.layer[0]._packed for p in (plain, eagle)]
    assert derived[0] is not None and derived[0][1][2].data_ptr() == derived[1][1][2].data_ptr()
    frame = make_frame(1, 0)
    s = samples_from_frame(frame, render_views(frame, size=(800, 450)))[0]
    assert plain.answer(s.question, s.images).text == eagle.answer(s.question, s.images).text


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

    pipe = Pipeline.from_pretrained(hf_dir, resample="pil", **TILING)  # the transformers rows' own image processing
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
    row = result["rows"][0]
    assert row["precision"].startswith("fp8-dynamic-per-row")
    assert row["emulated"] and row["speedup"] is None  # an emulated baseline gives no speed-ups, not even its own
    with pytest.raises(LiteVLMError, match="no model or format options"):
        run_bench(str(full_model_dir), n=1, shape="2b", load={"max_tiles": 4}, progress=False)


def test_frame_mode_answers_each_frame_as_strangers_and_through_one_frame_side_by_side(full_model_dir, monkeypatch):
    """--questions-per-frame K: every row twice on the same questions; the frame's answers equal the strangers', its
    views are read once a frame (the rest reused), and its e2e per question is what the row reports."""
    from litevlm.eval.bench import format_frames

    seen = watch_answers(monkeypatch)
    configs = {"baseline": CONFIGS["baseline"], "litevlm": CONFIGS["litevlm"]}
    result, _ = run_bench(
        str(full_model_dir),
        n=4,
        warmup=1,
        configs=configs,
        hf=False,
        max_new_tokens=6,
        progress=False,
        questions_per_frame=2,
    )
    assert result["questions_per_frame"] == 2 and result["frames"] == 2 and result["questions"] == 4
    rows = {(r["config"], r["mode"]): r for r in result["frame_rows"]}
    assert set(rows) == {(c, m) for c in configs for m in ("strangers", "frame")}
    for config in configs:
        alone, frame = rows[(config, "strangers")], rows[(config, "frame")]
        assert alone["answers_equal"] and frame["answers_equal"] and alone["score"] == frame["score"]
        paired = frame["vs_strangers"]["final"]  # the same answers: exactly level, over both measured frames
        assert paired["diff"] == paired["low"] == paired["high"] == 0.0 and paired["frames"] == 2
        assert "vs_strangers" not in alone
        assert alone["views_encoded_per_question"] == alone["views"] and alone["views_reused_per_question"] == 0
        # each view of a frame is encoded once: what a question needs is encoded or reused
        assert frame["views_encoded_per_question"] + frame["views_reused_per_question"] == pytest.approx(frame["views"])
        assert frame["views_encoded_per_question"] < alone["views_encoded_per_question"]
        assert frame["e2e_vs_strangers"] == round(frame["e2e_ms"] / alone["e2e_ms"], 3)
        # both modes' answers of the measured frame (the warm-up frame's first 2 x 2 not counted), watched from outside
        check_row_clock([alone, frame], seen[config][4:])
    assert "| litevlm | frame | 2 |" in format_frames(result)
    json.dumps(result)


def test_the_bf16_matmul_rows_join_only_a_real_model_in_fp32_on_the_cpu(monkeypatch):
    """On a CPU that multiplies bf16, the bench's default rows add their bf16-matmul twins, but not for a model on a
    GPU or in bf16 (whose pipelines refuse matmul="bf16"), nor for random weights at a preset's shapes."""
    import litevlm.model.layers as layers
    from litevlm.eval.bench import default_configs

    monkeypatch.setattr(layers, "bf16_matmul_supported", lambda: True)
    assert list(default_configs(None, None)) == [*CONFIGS, *BF16_CONFIGS]
    assert list(default_configs(None, {"device": "cpu", "dtype": "float32", "tiles": None})) == [
        *CONFIGS,
        *BF16_CONFIGS,
    ]
    assert list(default_configs(None, {"device": "cuda", "dtype": "bfloat16"})) == list(CONFIGS)
    assert list(default_configs(None, {"dtype": "bfloat16"})) == list(CONFIGS)
    assert list(default_configs("2b", None)) == list(CONFIGS)


def answered_no(seed: int, frames: int) -> tuple[list[dict], list[dict]]:
    """Scoring records of every question of `frames` synthetic frames, each answered "no" -> (those, the same with
    every closed question answered right)."""
    from litevlm.data.synthetic import make_frame

    records = []
    for f in range(frames):
        frame = make_frame(seed, f)
        for qa in frame.qas:
            records.append(
                {"id": str(len(records)), "question": qa.question, "answer": "no", "gt": qa.answer}
                | {"tag": [qa.tag], "closed": qa.closed, "frame": frame.frame_id}
            )
    return records, [r | {"answer": r["gt"] if r["closed"] else r["answer"]} for r in records]


def test_each_row_is_paired_with_the_baseline_over_frames():
    """A row whose answers equal the baseline's is level at exactly zero; one that answers every closed question
    right where the baseline answers them all wrong is ahead on closed accuracy with an interval above zero."""
    from types import SimpleNamespace

    from litevlm.eval.bench import vs_baseline

    records, right = answered_no(seed=1, frames=6)
    logs = {name: SimpleNamespace(records=recs) for name, recs in
            (("baseline", records), ("same", [dict(r) for r in records]), ("right", right))}  # fmt: skip
    paired = vs_baseline(logs)
    same, better = paired["same"], paired["right"]
    assert same["final"]["diff"] == 0.0 and same["final"]["low"] == 0.0 == same["final"]["high"]
    assert same["closed"]["diff"] == 0.0 and same["closed"]["frames"] == 6
    closed = sum(r["closed"] for r in records)
    assert better["closed"]["n"] == closed and better["closed"]["low"] > 0.0
    from litevlm.eval.metrics import answered_right

    wrong_before = sum(r["closed"] and not answered_right(r) for r in records) / closed
    assert better["closed"]["diff"] == pytest.approx(wrong_before)
    assert better["final"]["diff"] > 0.0


def test_view_selection_fp8_and_bf16_are_each_paired_with_the_row_without_them():
    """`vs_pairs` reads each technique or precision against the same pipeline without it: a row answering like its
    pair is level at zero, one answering every closed question right is ahead; a pair missing a row is left out."""
    from types import SimpleNamespace

    from litevlm.eval.bench import PAIRS, vs_pairs

    records, right = answered_no(seed=2, frames=5)
    logs = {
        "eagle": SimpleNamespace(records=records),
        "views + eagle": SimpleNamespace(records=right),
        "litevlm": SimpleNamespace(records=records),
        "litevlm fp8": SimpleNamespace(records=[dict(r) for r in records]),
    }
    pairs = vs_pairs(logs)
    assert set(pairs) == {"views + eagle", "litevlm fp8"}  # no "litevlm bf16" row: no pair
    views, fp8 = pairs["views + eagle"], pairs["litevlm fp8"]
    assert views["against"] == "eagle" and views["measures"] == dict((a, c) for a, _, c in PAIRS)["views + eagle"]
    assert views["closed"]["low"] > 0.0 and views["final"]["diff"] > 0.0
    assert fp8["final"]["diff"] == 0.0 == fp8["final"]["low"] == fp8["final"]["high"]
    assert fp8["final"]["frames"] == 5
