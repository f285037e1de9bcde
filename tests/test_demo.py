import inspect
import json

import pytest

from litevlm.cameras import CAMERAS
from litevlm.cli import build_parser, main
from litevlm.data.synthetic import make_frame
from litevlm.demo import pick_questions, round_scores, run_demo
from litevlm.errors import LiteVLMError
from litevlm.eval.score import drivelm_score
from litevlm.pipeline import STAGES


def test_the_demo_runs_drive_hd_unless_told_otherwise():
    assert inspect.signature(run_demo).parameters["model"].default == "drive-hd"
    assert build_parser().parse_args(["demo"]).model == "drive-hd"
    assert build_parser().parse_args(["demo", "--model", "drive-tiny"]).model == "drive-tiny"


def test_a_round_mixes_closed_and_open_questions_of_every_category():
    qas = make_frame(2026, 0).qas
    for n in (4, 6, 8):
        picked = pick_questions(qas, n)
        assert len(picked) == n and len(set(map(id, picked))) == n
        assert {q.category for q in picked} == {"perception", "prediction", "planning", "behavior"}
        assert sum(q.closed for q in picked) >= n // 2 - 1 and sum(not q.closed for q in picked) >= n // 2 - 1
    assert len(pick_questions(qas, 1000)) == len(qas)


def test_the_round_is_scored_as_litevlm_eval_scores_it():
    """The round's DriveLM score is `drivelm_score`'s (the official computation, no judge) over the round's records
    in the frame's own order; right answers to the closed questions make its accuracy 1, wrong ones 0."""
    frame = make_frame(2026, 0)
    questions = pick_questions(frame.qas, 6)
    wrong = {"Yes.": "No.", "No.": "Yes."}
    rows = [
        {"answers": {"truth": {"answer": q.answer}, "wrong": {"answer": wrong.get(q.answer, "A.")}}} for q in questions
    ]
    scores, note = round_scores(rows, questions, frame)
    assert "litevlm eval" in note
    assert scores["truth"]["accuracy"] == 1.0 and scores["wrong"]["accuracy"] == 0.0
    assert scores["truth"]["final"] > scores["wrong"]["final"]
    in_order = sorted(questions, key=frame.qas.index)
    records = [
        {
            "id": str(i),
            "question": q.question,
            "answer": q.answer,
            "gt": q.answer,
            "tag": [q.tag],
            "closed": q.closed,
            "frame": frame.frame_id,
        }
        for i, q in enumerate(in_order)
    ]
    assert scores["truth"]["final"] == pytest.approx(drivelm_score(records)["final"], abs=1e-4)
    assert "no judge here" in scores["truth"]["note"]


def test_demo_shows_litevlm_and_the_baseline_on_one_scene(full_model_dir, tmp_path, capsys):
    out = tmp_path / "demo.png"
    result = run_demo(str(full_model_dir), out=str(out), n_questions=4, as_json=True, rounds=2)
    last = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert last["n"] == 4 and last["speedup"] == pytest.approx(result["speedup"])
    assert out.stat().st_size > 5_000
    assert {r["category"] for r in result["questions"]} == {"perception", "prediction", "planning", "behavior"}
    for r in result["questions"]:  # both answers beside the one truth, each with the views it encoded
        assert set(r["answers"]) == {"litevlm", "baseline"} and r["truth"]
        assert r["answers"]["baseline"]["views"] == list(CAMERAS)  # the baseline encodes every camera
        assert r["answers"]["litevlm"]["views"] and set(r["answers"]["litevlm"]["views"]) <= set(CAMERAS)
    assert any(len(r["answers"]["litevlm"]["views"]) < len(CAMERAS) for r in result["questions"])
    assert result["answers_timed"] == 8
    base, lite = result["mean_ms"]["baseline"], result["mean_ms"]["litevlm"]
    assert result["speedup"] == pytest.approx(base["total"] / lite["total"])  # the ratio of the two mean totals
    # the accuracy that can be counted fairly: closed questions right, and the round's DriveLM score
    assert result["n_closed"] == sum(r["closed"] for r in result["questions"]) >= 1
    for name in ("litevlm", "baseline"):
        assert 0 <= result["closed"][name] <= result["n_closed"]
        assert 0 <= result["drivelm"][name]["final"] <= 1
    # `litevlm bench`'s measure: the stage means and other add up to the mean total, p50 and p90 beside it, the
    # images' preprocessing apart.
    for name, ms in result["mean_ms"].items():
        assert sum(ms[s] for s in STAGES) + ms["other"] == pytest.approx(ms["total"], abs=1e-6)
        assert ms["other"] >= -0.01 and ms["preprocess"] > 0
        assert 0 < result["p50_total_ms"][name] <= result["p90_total_ms"][name]
    assert result["emulated"] == []


def test_an_emulated_precision_gives_the_demo_no_speedup(full_model_dir, tmp_path, capsys, monkeypatch):
    import litevlm.demo

    monkeypatch.setattr(litevlm.demo, "emulated_precision", lambda model: True)  # as FP8 weights on a CPU
    result = run_demo(str(full_model_dir), out=str(tmp_path / "d.png"), n_questions=1, rounds=1)
    assert result["speedup"] is None and result["emulated"] == ["litevlm", "baseline"]
    text = capsys.readouterr().out
    assert "no speed figure" in text and "as fast as the baseline" not in text


def test_without_pycocoevalcap_the_demo_counts_the_closed_questions_only(tiny_model_dir, tmp_path, capsys, monkeypatch):
    import litevlm.eval.metrics

    def missing():
        raise LiteVLMError("DriveLM's language score (BLEU, ROUGE-L, CIDEr) needs pycocoevalcap")

    monkeypatch.setattr(litevlm.eval.metrics, "language_scorers", missing)
    result = run_demo(str(tiny_model_dir), out=str(tmp_path / "d.png"), n_questions=2, rounds=1, configs=("baseline",))
    assert result["drivelm"] is None and "pycocoevalcap" in result["drivelm_note"]
    assert result["n_closed"] == 1  # one closed question, one open
    text = capsys.readouterr().out
    assert "closed questions answered right (yes/no, multiple choice): baseline " in text
    assert "no DriveLM score" in text


def test_demo_prints_answers_views_both_stage_tables_and_the_speedup(full_model_dir, tmp_path, capsys):
    assert main(["demo", "--model", str(full_model_dir), "--out", str(tmp_path / "d.png"), "--questions", "2"]) == 0
    text = capsys.readouterr().out
    lines = text.splitlines()
    for label in ("truth", "LiteVLM", "baseline"):  # a line each per question
        assert sum(line.startswith(f"  {label} ") for line in lines) == 2
    assert f"[all {len(CAMERAS)} views]" in text
    header = next(line for line in lines if line.startswith("  stage "))
    assert "LiteVLM" in header and "baseline" in header
    assert "latency, mean ms over 6 answers each" in text  # 2 questions, 3 rounds
    assert any(line.startswith("  other ") for line in lines) and any(line.startswith("  total p90 ") for line in lines)
    assert "x as fast as the baseline (the ratio of their mean totals" in text
    assert "closed questions answered right (yes/no, multiple choice): LiteVLM " in text
    assert "DriveLM score of the round, as `litevlm eval` computes it: LiteVLM " in text
    assert "answers equal to the truth" not in text  # an open answer worded otherwise is not wrong


@pytest.mark.parametrize("flag, shown", [("--baseline-only", "baseline"), ("--litevlm-only", "litevlm")])
def test_demo_can_show_one_configuration(full_model_dir, tmp_path, capsys, flag, shown):
    args = ["demo", "--model", str(full_model_dir), "--out", str(tmp_path / "d.png"), "--questions", "2", "--json"]
    assert main([*args, flag]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert list(result["mean_ms"]) == [shown] and result["speedup"] is None
    assert all(list(r["answers"]) == [shown] for r in result["questions"])


def test_the_baseline_alone_runs_on_a_model_without_selectors(tiny_model_dir, tmp_path):
    result = run_demo(str(tiny_model_dir), out=str(tmp_path), n_questions=1, as_json=True, configs=("baseline",))
    assert (tmp_path / "demo.png").stat().st_size > 5_000  # a folder gets demo.png inside it
    assert result["n"] == 1
    with pytest.raises(LiteVLMError, match="demo configurations"):
        run_demo(str(tiny_model_dir), out=str(tmp_path), configs=("fastest",))


def test_cli_reports_user_errors_with_exit_code_2(tmp_path, capsys):
    assert main(["ask", "--images", str(tmp_path / "none"), "--question", "Anything ahead?"]) == 2
    assert "image folder not found" in capsys.readouterr().err


def test_a_bad_out_is_refused_up_front(tiny_model_dir, tmp_path, capsys):
    assert main(["demo", "--model", str(tiny_model_dir), "--out", str(tmp_path / "grid")]) == 2
    assert "not an image file name" in capsys.readouterr().err
    assert main(["demo", "--model", str(tiny_model_dir), "--out", str(tmp_path / "missing" / "grid.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
    with pytest.raises(SystemExit):  # argparse: the two are exclusive
        main(["demo", "--baseline-only", "--litevlm-only"])
    assert "not allowed with argument" in capsys.readouterr().err


def test_where_llama_cpp_is_installed_the_demo_adds_its_row(tmp_path, capsys):
    """llama.cpp answers the round on the baseline's own tiles and prompt: its time, LiteVLM's ratio over it, and its
    answers, which equal the baseline's here (drive-tiny in f32); --no-llama-cpp leaves the row out."""
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    result = run_demo("drive-tiny", out=str(tmp_path / "d.png"), n_questions=3, rounds=1)
    peer = result["llama_cpp"]
    assert peer["engine"].startswith("llama.cpp f32 (llama-cpp-python ") and peer["e2e_ms"] > 0
    assert peer["litevlm_speedup"] == pytest.approx(peer["e2e_ms"] / result["e2e_ms"]["litevlm"], rel=0.01)
    assert peer["same_as_baseline"] == 3
    assert peer["answers"] == [r["answers"]["baseline"]["answer"] for r in result["questions"]]
    assert "on the baseline's own tiles and prompt" in capsys.readouterr().out
    assert "llama_cpp" not in run_demo("drive-tiny", out=str(tmp_path / "e.png"), n_questions=1, rounds=1,
                                       llama_cpp=False)  # fmt: skip


def test_a_model_gguf_cannot_express_leaves_llama_cpps_row_out_saying_why(full_model_dir, tmp_path, capsys):
    pytest.importorskip("llama_cpp")
    pytest.importorskip("gguf")
    result = run_demo(str(full_model_dir), out=str(tmp_path / "d.png"), n_questions=1, rounds=1)
    assert "no GGUF name" in result["llama_cpp"]["skipped"]
    assert "llama.cpp's row is left out: " in capsys.readouterr().out
