"""benchmarks/token_pruning.py: every method at every r on the same questions, scored and timed, its last stdout line
one JSON object with every number; its answers are the pipeline's own."""

import json

import pytest

FIELDS = {"final", "closed_accuracy", "accuracy", "language", "match", "visual_tokens", "changed"}
PER_QUESTION = {"final", "correct", "same", "drop", "loglik"}


@pytest.fixture(scope="module")
def pruning(benchmark_script):
    return benchmark_script("token_pruning")


def test_the_method_list_adds_the_per_view_variants(pruning):
    assert pruning.method_list("dart,uniform,token-selector", per_view=True) == [
        "dart",
        "dart-per-view",
        "uniform",
        "token-selector",
    ]
    assert pruning.method_list("divprune-per-view", per_view=False) == ["divprune-per-view"]
    with pytest.raises(SystemExit, match="unknown method"):
        pruning.method_list("fastv-per-view", per_view=False)


def test_the_held_out_questions_are_spread_over_the_frames(pruning):
    samples = pruning.load_questions(None, None, 5, seed=1, frames=20)
    assert len(samples) == 5 and len({s.frame_id for s in samples}) == 5
    assert [s.id for s in samples] == [s.id for s in pruning.load_questions(None, None, 5, seed=1, frames=20)]
    assert all(set(s.images) == set(samples[0].images) for s in samples)  # each with its six rendered views


def test_a_small_run_reports_every_method_at_every_r_and_answers_as_the_pipeline(tmp_path, pruning, capsys):
    from litevlm.pipeline import Pipeline

    plot, predictions = tmp_path / "pruning.png", tmp_path / "answers.json"
    argv = ["--n", "3", "--r", "0.3", "--timing-n", "1", "--repeats", "1", "--views", "all", "--per-view"]
    result = pruning.main([*argv, "--threads", "1", "--plot", str(plot), "--predictions", str(predictions)])
    assert json.loads(capsys.readouterr().out.strip().splitlines()[-1]) == result
    methods = ["token-selector", "fastv-k1", "fastv-k2", "dart", "dart-per-view", "divprune", "divprune-per-view"]
    methods += ["cdpruner", "cdpruner-per-view", "random", "random-per-view", "uniform"]
    assert result["methods"] == methods and result["absent"] == {} and result["model"] == "drive-tiny"
    assert set(result["scores"]) == {f"{m}@0.3" for m in methods}
    assert all(FIELDS <= set(s) for s in result["scores"].values())
    # Per-question lists, in the questions' order, from which any paired interval can be computed: each question's
    # share of the final (their mean is the final), closed questions right or not, the fidelity to the unpruned model.
    questions, lists = result["questions"], result["per_question"]
    assert set(questions) == {"id", "frame", "closed"} and all(len(v) == 3 for v in questions.values())
    assert set(lists) == {"unpruned", *result["scores"]} and set(result["per_question_fields"]) == set(PER_QUESTION)
    assert set(lists["unpruned"]) == {"final", "correct", "loglik"} and max(lists["unpruned"]["loglik"]) <= 0
    for key, score in result["scores"].items():
        assert set(lists[key]) == {"final", "correct", "same", "drop"}
        assert sum(lists[key]["final"]) / 3 == pytest.approx(score["final"], abs=1e-5)
        assert [c is None for c in lists[key]["correct"]] == [not c for c in questions["closed"]]
        fid = score["fidelity"]
        assert fid["same_answer"] == pytest.approx(sum(lists[key]["same"]) / 3, abs=1e-4)
        assert fid["low"] <= fid["drop"] <= fid["high"] and {"final_se", "closed_se"} <= set(score)
        if key.startswith("token-selector@"):
            continue
        paired = score["vs_selector_paired"]  # against the TokenSelector at the same r: final, closed, fidelity
        assert set(paired) == {"final", "closed_accuracy", "fidelity"}
        assert paired["final"]["diff"] == pytest.approx(
            score["final"] - result["scores"]["token-selector@0.3"]["final"], abs=1e-5
        )
        assert paired["final"]["verdict"] in ("level", "token-selector", key.split("@")[0])
    # Every method keeps the same number of visual tokens at r, about r of the unpruned prompt's.
    n_visual = result["unpruned"]["visual_tokens"]
    kept = {s["visual_tokens"] for s in result["scores"].values()}
    assert len(kept) == 1 and abs(kept.pop() - 0.3 * n_visual) <= 1
    assert 0 < result["visual_share"] < 1 and result["n"] == 3 and result["ratios"] == [0.3]
    # Timing: the unpruned prefill and each configuration's own select_tokens and prefill.
    timing = result["timing_ms"]
    assert set(timing) == {"unpruned", *result["scores"]}
    assert all(t["prefill_ms"] > 0 and t["select_tokens_ms"] >= 0 for t in timing.values())
    assert {"platform", "threads", "torch"} <= set(result["machine"]) and result["date"]
    assert "commit" in result and plot.stat().st_size > 10_000
    # The figure redrawn from the run's JSON alone (as report.py keeps it: under "result"), with the trade-off panel.
    from PIL import Image

    run = tmp_path / "run.json"
    run.write_text(json.dumps({"benchmark": "token_pruning_x", "result": result}))
    again = tmp_path / "again.png"
    assert pruning.main(["--replot", str(run), "--plot", str(again)]) == {"plot": str(again)}
    assert Image.open(again).size == Image.open(plot).size and Image.open(again).size[0] > 2 * 6.2 * 120
    untimed = {**result, "timing_ms": {}}
    run.write_text(json.dumps(untimed))  # the script's own line, no panel for ms without timings
    assert Image.open(pruning.replot(str(run), str(again))).size[0] < Image.open(plot).size[0]
    run.write_text(json.dumps({"benchmark": "bench"}))
    with pytest.raises(SystemExit, match="not a run of the pruning benchmark"):
        pruning.replot(str(run), str(again))
    # The benchmark's answer is the pipeline's: DART (pruning inside the decoder) on the first question.
    s = pruning.load_questions(None, None, 3, seed=1, frames=100)[0]
    pipe = Pipeline.from_pretrained("drive-tiny", prune="dart", keep=0.3)
    assert json.loads(predictions.read_text())["dart@0.3"][0]["answer"] == pipe.answer(s.question, s.images).text


def test_a_model_without_a_token_selector_reports_it_absent(tmp_path, pruning, capsys):
    from litevlm.models import resolve_model_dir

    model = tmp_path / "drive-hd"
    model.mkdir()
    for f in resolve_model_dir("drive-tiny").iterdir():
        if f.is_file():  # the weights and tokenizer, no token_selector/ (nor draft/) folder
            (model / f.name).symlink_to(f)
    argv = ["--model", str(model), "--n", "2", "--r", "0.2", "--methods", "token-selector,uniform", "--timing-n", "0"]
    result = pruning.main([*argv, "--threads", "1", "--no-progress"])
    assert result["methods"] == ["uniform"] and set(result["scores"]) == {"uniform@0.2"}
    assert result["absent"] == {"token-selector": "drive-hd has no token_selector/ folder"}
    assert result["timing_ms"] == {} and result["model"] == "drive-hd"


def test_the_selectors_choice_inside_the_decoder_is_a_method_of_its_own(tmp_path, pruning):
    """token-selector-k2: a prompt-reading TokenSelector's choice applied before decoder layer 2, answered as the
    pipeline answers `--prune token-selector --prune-layer 2`, paired with the selector; a selector that reads layer
    0's output has none, and says why."""
    from litevlm.models import load_model, resolve_model_dir
    from litevlm.pipeline import Pipeline
    from litevlm.select.tokens import SelectorConfig, TokenSelector

    argv = ["--n", "2", "--r", "0.2", "--timing-n", "0", "--threads", "1", "--no-progress"]
    tiny = pruning.main([*argv, "--methods", "token-selector-k2,uniform"])
    assert tiny["methods"] == ["uniform"]
    assert tiny["absent"] == {
        "token-selector-k2": "its TokenSelector reads decoder layer 0's output and prunes after that layer"
    }
    model = tmp_path / "drive-tiny"
    model.mkdir()
    for f in resolve_model_dir("drive-tiny").iterdir():
        if f.is_file():
            (model / f.name).symlink_to(f)
    TokenSelector.from_model(load_model(model).model, SelectorConfig(reads="prompt")).save(model)
    predictions = tmp_path / "answers.json"
    methods = "token-selector,token-selector-k2"
    result = pruning.main([*argv, "--model", str(model), "--methods", methods, "--predictions", str(predictions)])
    assert result["methods"] == ["token-selector", "token-selector-k2"] and result["absent"] == {}
    assert result["labels"]["token-selector-k2"] == "TokenSelector K=2"
    assert "vs_selector" in result["scores"]["token-selector-k2@0.2"]
    assert (
        result["scores"]["token-selector-k2@0.2"]["visual_tokens"]
        == result["scores"]["token-selector@0.2"]["visual_tokens"]
    )
    s = pruning.load_questions(None, None, 2, seed=1, frames=100)[0]
    pipe = Pipeline.from_pretrained(model, prune="token-selector", keep=0.2, prune_layer=2)
    answers = json.loads(predictions.read_text())["token-selector-k2@0.2"]
    assert answers[0]["answer"] == pipe.answer(s.question, s.images).text


def test_the_stored_keep_ratio_is_the_smallest_within_the_tolerance(tmp_path, benchmark_script):
    choose = benchmark_script("choose_keep_ratio")
    run = {
        "benchmark": "token_pruning",
        "data": "val",
        "n": 200,
        "views": "needed",
        "commit": "abc",
        "selector": {"reads": "prompt"},
        "unpruned": {"final": 0.5137},
        "scores": {
            "token-selector@0.5": {"final": 0.5094},
            "token-selector@0.3": {"final": 0.4991},
            "token-selector@0.4": {"final": 0.5079},
            "cdpruner@0.3": {"final": 0.52},
        },
    }
    assert choose.choose(run, 0.005)[0] == 0.5  # 0.4 is 0.0058 below unpruned
    assert choose.choose(run, 0.006)[0] == 0.4
    assert choose.choose(run, 0.0001)[0] == 0.5  # none within: the largest measured
    sel = tmp_path / "token_selector"
    sel.mkdir()
    (sel / "config.json").write_text(json.dumps({"selector": {"keep_ratio": 0.3, "reads": "prompt"}}))
    (sel / "config.json").chmod(0o644)
    (tmp_path / "run.txt").write_text("progress\n" + json.dumps(run) + "\n")
    assert choose.main([str(tmp_path / "run.txt"), str(sel)]) == 0
    assert (sel / "config.json").stat().st_mode & 0o777 == 0o644  # readable as before, not the temporary file's 0600
    cfg = json.loads((sel / "config.json").read_text())
    assert cfg["selector"]["keep_ratio"] == 0.5 and cfg["keep_ratio_choice"]["final_at_r"]["0.4"] == 0.5079
    assert cfg["keep_ratio_choice"]["data"].startswith("val (200 questions")  # the run's folder, as given
    made = "litevlm data synth --seed 2 --frames 100"
    assert choose.main([str(tmp_path / "run.txt"), str(sel), "--data-made-by", made]) == 0
    assert json.loads((sel / "config.json").read_text())["keep_ratio_choice"]["data"].startswith(made + " (200")
    (sel / "config.json").write_text(json.dumps({"selector": {"keep_ratio": 0.3}}))  # reads layer 0
    with pytest.raises(SystemExit, match="another input"):
        choose.main([str(tmp_path / "run.txt"), str(sel)])


def test_methods_are_paired_with_the_selector_on_the_closed_questions(pruning):
    assert pruning.sign_test(0, 0) == 1.0 and pruning.sign_test(4, 4) == 1.0
    assert pruning.sign_test(3, 0) == pytest.approx(0.25)  # 2 * (1/2)^3
    assert pruning.sign_test(1, 9) == pytest.approx(2 * 11 / 1024)

    def rec(answer, gt, closed=True):
        return {"answer": answer, "gt": gt, "closed": closed}

    sel = [rec("Yes.", "Yes."), rec("No.", "Yes."), rec("B", "B"), rec("left", "right", closed=False), rec("A", "A")]
    other = [rec("No.", "Yes."), rec("yes", "Yes."), rec("C", "B"), rec("right", "right", closed=False), rec("A", "A")]
    assert pruning.paired_closed(sel, other) == {"selector_only": 2, "method_only": 1, "p": 1.0}


def test_fastvs_choice_before_the_decoder_keeps_fastvs_tokens_and_prunes_the_prompt(pruning):
    """fastv-k2-k0: the tokens FastV K=2 keeps (its hook's own choice at layer 2), cut from the prompt before the
    decoder, so no layer reads the others; by name only."""
    import torch

    from litevlm.pipeline import Pipeline
    from litevlm.select.tokens import fastv_pruning

    assert pruning.method_list("fastv-k2-k0,fastv-k2", per_view=True) == ["fastv-k2-k0", "fastv-k2"]
    pipe = Pipeline.from_pretrained("drive-tiny")
    s = pruning.load_questions(None, None, 1, seed=1, frames=20)[0]
    p = pruning.Prompts(pipe, "all")(s)
    sel = pruning.selection(pipe, "fastv-k2-k0", 0.25, None, 0)
    assert sel.plain_decoding and "before the decoder" in sel.label
    with torch.no_grad():
        embeds, positions, hook = sel.select(pipe.model, p, s.question, pipe.format.tiling)
        x = pipe.model.language_model(p.embeds, p.positions, start_layer=0, end_layer=1)  # layer 1's input
        kept = fastv_pruning(pipe.model, p.positions, p.view_spans, 2, 0.25).keep(x)
    assert hook is None and embeds.shape[1] < p.embeds.shape[1]
    assert torch.equal(embeds, p.embeds[:, kept]) and torch.equal(positions, p.positions[:, kept])


def test_per_question_lists_give_the_standard_errors_fidelity_and_the_pairing_with_the_selector(pruning):
    """From per-question lists alone: the standard errors over frames, the fidelity (answers the same, the mean drop
    and its interval) and each measure's paired difference with the TokenSelector, a lower drop being ahead."""
    frames = [f"f{i // 2}" for i in range(8)]
    records = [
        {"id": str(i), "question": "Is it safe?", "answer": a, "gt": "Yes.", "tag": [0], "closed": True}
        for i, a in enumerate(["Yes.", "No.", "Yes.", "Yes.", "No.", "Yes.", "Yes.", "Yes."])
    ]
    base = [-0.2] * 8
    sel = pruning.question_scores(records, [True] * 8, [-0.25] * 8, base)  # a drop of 0.05 everywhere
    other = pruning.question_scores(records, [True, False] * 4, [-0.3] * 8, base)  # 0.1
    assert sel["final"] == [1.0, 0.0, 1.0, 1.0, 0.0, 1.0, 1.0, 1.0] and sel["correct"] == sel["final"]
    assert sel["drop"] == [0.05] * 8 and other["same"] == [1, 0] * 4
    assert pruning.question_scores(records, None, base, base)["loglik"] == base  # the unpruned lists
    spread = pruning.spreads(other, frames)
    assert spread["fidelity"] == {"same_answer": 0.5, "drop": 0.1, "low": 0.1, "high": 0.1, "se": 0.0}
    assert spread["final_se"] == spread["closed_se"] > 0
    versus = pruning.versus_selector("dart", other, sel, frames)
    assert versus["final"]["diff"] == 0 and versus["final"]["verdict"] == "level" and versus["final"]["frames"] == 4
    assert versus["fidelity"]["diff"] == pytest.approx(0.05) and versus["fidelity"]["verdict"] == "token-selector"
