import json

from litevlm.cli import main
from litevlm.demo import run_demo


def test_demo_answers_questions_and_saves_the_grid(tiny_model_dir, tmp_path, capsys):
    out = tmp_path / "demo.png"
    result = run_demo(str(tiny_model_dir), out=str(out), n_questions=4, as_json=True)
    last = capsys.readouterr().out.strip().splitlines()[-1]
    assert json.loads(last)["n"] == 4
    assert out.stat().st_size > 5_000
    assert {r["category"] for r in result["questions"]} == {"perception", "prediction", "planning", "behavior"}
    assert result["median_ms"]["total"] > 0


def test_cli_reports_user_errors_with_exit_code_2(tmp_path, capsys):
    assert main(["ask", "--images", str(tmp_path / "none"), "--question", "Anything ahead?"]) == 2
    assert "image folder not found" in capsys.readouterr().err


def test_demo_with_view_selection_reports_the_views_it_used(full_model_dir, tmp_path):
    from litevlm.cameras import CAMERAS

    result = run_demo(
        str(full_model_dir), out=str(tmp_path / "grid.png"), n_questions=4, as_json=True, select_views=True
    )
    assert len(result["questions"]) == 4
    for q in result["questions"]:
        assert q["views"] and set(q["views"]) <= set(CAMERAS)
    assert any(len(q["views"]) < len(CAMERAS) for q in result["questions"])  # at least one question needs fewer


def test_demo_out_may_be_a_folder_and_a_bad_out_is_refused_up_front(tiny_model_dir, tmp_path, capsys):
    run_demo(str(tiny_model_dir), out=str(tmp_path), n_questions=1, as_json=True)
    assert (tmp_path / "demo.png").stat().st_size > 5_000  # a folder gets demo.png inside it
    assert main(["demo", "--model", str(tiny_model_dir), "--out", str(tmp_path / "grid")]) == 2
    assert "not an image file name" in capsys.readouterr().err
    assert main(["demo", "--model", str(tiny_model_dir), "--out", str(tmp_path / "missing" / "grid.png")]) == 2
    assert "does not exist" in capsys.readouterr().err
