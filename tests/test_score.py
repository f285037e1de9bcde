"""DriveLM's official score (litevlm.eval.score, `litevlm score`, `litevlm eval`) against the official evaluation."""

import json
import os
import re
from http.server import BaseHTTPRequestHandler
from pathlib import Path

import pytest
from conftest import loopback_server

from litevlm.cli import main
from litevlm.data.drivelm import load_samples, official_tags
from litevlm.errors import LiteVLMError
from litevlm.eval.judge import Judge
from litevlm.eval.metrics import final_score
from litevlm.eval.score import drivelm_score, record, score_files, write_submission

DATA = Path(__file__).parent / "data"
GT = DATA / "drivelm_own_gt.json"
PREDICTIONS = DATA / "drivelm_own_predictions.json"

# The official evaluation (OpenDriveLab/DriveLM challenge/evaluation.py, commit 0469200), run unchanged in a scratch
# folder on GT and PREDICTIONS: `python evaluation.py --root_path1 PREDICTIONS --root_path2 GT`. Two imports were
# shimmed: gpt_eval.GPTEvaluation (the API judge) by `stand_in` below, and language_evaluation (bckim92/language-
# evaluation, not on PyPI) by its CocoEvaluator's own steps over PyPI pycocoevalcap 1.2: the Java Stanford PTBTokenizer
# (CoreNLP 3.4.1) then Bleu(4), Rouge(), Cider(), the scorer code that package vendors. It printed:
OFFICIAL = {
    "accuracy": 0.5714285714285714,
    "chatgpt": 72.0,
    "match": 69.33333292666666,
    "language": {
        "Bleu_1": 0.528911753886287,
        "Bleu_2": 0.4704053878355237,
        "Bleu_3": 0.417905223976158,
        "Bleu_4": 0.3662938985353759,
        "ROUGE_L": 0.7208597304353512,
        "CIDEr": 2.685837010268263,
    },
    "final": 0.6366405466404153,
}
# Our path runs the same float64 operations in the same order (the tokenizer is a pure-Python copy that yields the
# same tokens), so it agrees to the last digit; 1e-9 leaves room for a different summation order only.
TOL = 1e-9


def stand_in(answer: str, gt: str) -> str:
    """The stand-in judge: the share (0..100) of the GT's distinct words that the answer holds, as reply text."""
    g = set(re.findall(r"[a-z0-9]+", gt.lower()))
    a = set(re.findall(r"[a-z0-9]+", answer.lower()))
    return str(round(100 * len(a & g) / len(g))) if g else "0"


class StandInJudge:
    model = "stand-in"

    def score(self, question, gt, pred):
        return float(stand_in(pred, gt))


# DriveLM's own sample, challenge/test_eval.json and challenge/output.json of OpenDriveLab/DriveLM: the official
# evaluation, run the same way with the same stand-in judge, gave this final. The files are DriveLM's data and are not
# part of this repository; point DRIVELM_CHALLENGE_DIR at a DriveLM checkout's challenge/ folder to check it.
OFFICIAL_SAMPLE_FINAL = 0.22489548592262493


@pytest.mark.skipif(
    not os.environ.get("DRIVELM_CHALLENGE_DIR"),
    reason="DRIVELM_CHALLENGE_DIR (a DriveLM checkout's challenge/ folder) not set: DriveLM's sample is not shipped",
)
def test_score_files_reproduces_the_official_evaluation_on_drivelms_sample():
    folder = Path(os.environ["DRIVELM_CHALLENGE_DIR"])
    result = score_files(folder / "output.json", folder / "test_eval.json", judge=StandInJudge())
    assert result["final"] == pytest.approx(OFFICIAL_SAMPLE_FINAL, abs=1e-4)


def test_score_files_reproduces_the_official_evaluation():
    result = score_files(PREDICTIONS, GT, judge=StandInJudge())
    assert result["final"] == pytest.approx(OFFICIAL["final"], abs=TOL)
    assert result["accuracy"] == pytest.approx(OFFICIAL["accuracy"], abs=TOL)
    assert result["judge"] * 100 == pytest.approx(OFFICIAL["chatgpt"], abs=TOL)
    assert result["match"] * 100 == pytest.approx(OFFICIAL["match"], abs=TOL)
    assert result["language_detail"] == pytest.approx(OFFICIAL["language"], abs=TOL)
    assert result["official"] and result["final_note"].startswith("official DriveLM final")
    # the gate dropped the questions about c2 of frame-a1 (its first answer missed it by 20 px)
    assert (result["n"], result["gated_out"], result["unrouted"]) == (22, 6, 0)
    # multi-tag items count in every bucket they name: [1, 2] twice, [2, 3] once
    assert result["counts"]["language"] == 4 and result["counts"]["match"] == 3


class _StandInEndpoint(BaseHTTPRequestHandler):
    """An OpenAI-compatible endpoint that reads the official prompt back and answers with the stand-in judge."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append(body)
        user = body["messages"][-1]["content"]
        gt, answer = user.split("This is the correct answer: ", 1)[1].split("This is my answer: ", 1)
        payload = json.dumps({"choices": [{"message": {"role": "assistant", "content": stand_in(answer, gt)}}]})
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload.encode())

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def endpoint():
    with loopback_server(_StandInEndpoint) as server:
        yield server


def test_litevlm_score_with_a_judge_endpoint_gives_the_official_final(endpoint, capsys, monkeypatch):
    monkeypatch.setenv("STAND_IN_KEY", "sk-local")
    url = f"http://127.0.0.1:{endpoint.server_address[1]}/v1"
    argv = ["score", "--predictions", str(PREDICTIONS), "--gt", str(GT), "--json"]
    argv += ["--judge-endpoint", url, "--judge-model", "stand-in", "--api-key-env", "STAND_IN_KEY"]
    assert main(argv) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["final"] == pytest.approx(OFFICIAL["final"], abs=TOL) and result["official"]
    assert result["scoring"] == {"gate": True, "renormalise": False, "judge": "stand-in"}
    # DriveLM's own prompt: system message, then the instruction and both answers joined without separators
    body = endpoint.seen[-1]
    assert body["model"] == "stand-in"
    assert body["messages"][0] == {
        "role": "system",
        "content": "an evaluator who rates my answer based on the correct answer",
    }
    assert body["messages"][1]["content"].startswith(
        "Rate my answer based on the correct answer out of 100, with higher scores indicating that the answer is "
        "closer to the correct answer, and you should be accurate to single digits like 62, 78, 41,etc. Output the "
        "number onlyThis is the correct answer: "
    )


def test_the_judge_sends_the_official_prompt_or_the_question_on_request():
    official = Judge("http://127.0.0.1:9/v1", "m").messages("Q?", "Stop.", "Go.")[1]["content"]
    assert official.endswith("Output the number onlyThis is the correct answer: Stop.This is my answer: Go.")
    assert "Q?" not in official
    with_question = Judge("http://127.0.0.1:9/v1", "m", prompt="with-question").messages("Q?", "Stop.", "Go.")
    assert "This is the question: Q?" in with_question[1]["content"]
    with pytest.raises(LiteVLMError, match="not one of"):
        Judge("http://127.0.0.1:9/v1", "m", prompt="mine")


def test_without_a_judge_the_final_says_it_is_not_the_official_one(capsys):
    result = score_files(PREDICTIONS, GT)
    assert not result["official"] and result["judge"] is None
    assert result["final_note"].startswith("not the official DriveLM final: no judge")
    # the official weights with the judge's parts counted as 0: match keeps only its F1 half
    lang = OFFICIAL["language"]
    language = (sum(lang[f"Bleu_{n}"] for n in range(1, 5)) / 4 + lang["ROUGE_L"]) / 3 + lang["CIDEr"] / 30
    expected = 0.2 * language + 0.2 * result["match_f1"] / 2 + 0.2 * OFFICIAL["accuracy"]
    assert result["final"] == pytest.approx(expected, abs=TOL)
    assert main(["score", "--predictions", str(PREDICTIONS), "--gt", str(GT)]) == 0
    assert "not the official DriveLM final: no judge" in capsys.readouterr().out


def test_ungated_and_renormalised_scores_are_named_options():
    ungated = score_files(PREDICTIONS, GT, gate=False)
    assert ungated["gated_out"] == 0 and ungated["n_scored"] == 22
    assert "graph gate off" in ungated["final_note"] and not ungated["official"]
    mix = score_files(PREDICTIONS, GT, gate=False, renormalise=True)
    assert mix["final"] == pytest.approx(
        final_score(mix["accuracy"], None, mix["language"], mix["match"]), abs=TOL
    )  # the older one-third mix
    assert mix["match"] == mix["match_f1"] and "weights renormalised" in mix["final_note"]


def test_a_gt_file_without_answers_is_not_scored(tmp_path):
    gt = json.loads(GT.read_text())
    for scene in gt.values():
        for frame in scene["key_frames"].values():
            for items in frame["QA"].values():
                for item in items:
                    item["A"] = ""
    (tmp_path / "questions.json").write_text(json.dumps(gt))
    with pytest.raises(LiteVLMError, match="holds no answers"):
        score_files(PREDICTIONS, tmp_path / "questions.json")


def test_submission_files_are_checked(tmp_path):
    preds = json.loads(PREDICTIONS.read_text())
    (tmp_path / "short.json").write_text(json.dumps(preds[:-2]))
    with pytest.raises(LiteVLMError, match="no answer for 2 of the 22 questions"):
        score_files(tmp_path / "short.json", GT)
    (tmp_path / "twice.json").write_text(json.dumps(preds + preds[:1]))
    with pytest.raises(LiteVLMError, match="appears twice"):
        score_files(tmp_path / "twice.json", GT)
    (tmp_path / "bad.json").write_text(json.dumps([{"id": 1, "answer": "x"}]))
    with pytest.raises(LiteVLMError, match="string 'id'"):
        score_files(tmp_path / "bad.json", GT)
    extra = preds + [{"id": "scene-x_frame-x_0", "question": "q", "answer": "a"}]
    (tmp_path / "extra.json").write_text(json.dumps({"method": "m", "results": extra}))  # the upload's wrapper
    result = score_files(tmp_path / "extra.json", GT, judge=StandInJudge())
    assert (
        result["final"] == pytest.approx(OFFICIAL["final"], abs=TOL)
        and "1 predictions with ids" in result["final_note"]
    )
    assert main(["score", "--predictions", str(tmp_path / "short.json"), "--gt", str(GT)]) == 2
    assert main(["score", "--predictions", str(PREDICTIONS), "--gt", str(GT), "--judge-model", "m"]) == 2


def test_every_empty_answer_is_said(tmp_path):
    preds = [{**p, "answer": ""} for p in json.loads(PREDICTIONS.read_text())]
    (tmp_path / "empty.json").write_text(json.dumps(preds))
    result = score_files(tmp_path / "empty.json", GT, judge=StandInJudge())
    assert "every answer is empty" in result["final_note"]


def test_files_without_tags_are_routed_by_the_official_rule(tmp_path):
    """A llama-adapter list (no tags, no categories): planning questions go to the judge, not to language."""
    gt = json.loads(GT.read_text())
    items = []
    for scene, sc in gt.items():
        for frame, fr in sc["key_frames"].items():
            qas = [q for c in ("perception", "prediction", "planning", "behavior") for q in fr["QA"][c]]
            for i, qa in enumerate(qas):
                turns = [{"from": "human", "value": "<image>\n" + qa["Q"]}, {"from": "gpt", "value": qa["A"]}]
                items.append({"id": f"{scene}_{frame}_{i}", "image": None, "conversations": turns})
    items.append(
        {
            "id": "scene-beta_frame-b1_6",
            "image": None,
            "conversations": [
                {"from": "human", "value": "What is the weather like?"},
                {"from": "gpt", "value": "Sunny."},
            ],
        }
    )
    (tmp_path / "llama.json").write_text(json.dumps(items))
    samples = load_samples(tmp_path / "llama.json", require_images=False)
    by_id = {s.id: s for s in samples}
    assert by_id["scene-alpha_frame-a1_6"].tags == (1,)  # "What actions could the ego vehicle take ..."
    assert by_id["scene-alpha_frame-a1_8"].tags == (1,)  # "... safe actions ..."
    assert by_id["scene-alpha_frame-a1_0"].tags == (2,) and by_id["scene-alpha_frame-a1_3"].tags == (3,)
    assert by_id["scene-alpha_frame-a1_9"].tags == (0,) and by_id["scene-alpha_frame-a1_5"].tags == (0,)
    assert by_id["scene-beta_frame-b1_6"].tags == ()  # not a kind the challenge scores
    preds = json.loads(PREDICTIONS.read_text()) + [{"id": "scene-beta_frame-b1_6", "answer": "Sunny."}]
    (tmp_path / "preds.json").write_text(json.dumps(preds))
    result = score_files(tmp_path / "preds.json", tmp_path / "llama.json", judge=StandInJudge())
    assert result["unrouted"] == 1 and result["counts"]["judge"] >= 4


def test_official_tags_of_the_training_layout():
    key_objects = {"<c1,CAM_FRONT,812.4,470.0>": {}, "<c2,CAM_BACK,402.0,455.5>": {}}
    notice = "Firstly notice <c1,CAM_FRONT,812.4,470.0>. Secondly notice <c2,CAM_BACK,402.0,455.5>."
    assert official_tags("What object should the ego vehicle notice first?", notice, "prediction", key_objects) == (3,)
    assert official_tags("Would <c1,CAM_FRONT,812.4,470.0> be in the moving direction?", "Yes.", "prediction") == (0,)
    assert official_tags(
        "What is the moving status of object <c1,CAM_FRONT,812.4,470.0>?", "Going ahead.", "perception"
    ) == (0,)
    assert official_tags(
        "Predict the behavior of the ego vehicle.", "The ego vehicle is going straight.", "behavior"
    ) == (0,)
    assert official_tags(
        "What actions taken by the ego vehicle can lead to a collision with <c1,CAM_FRONT,812.4,470.0>?",
        "Back up.",
        "planning",
    ) == (1,)
    assert official_tags("What is the priority of the objects?", "c1 first.", "planning") == ()
    assert (
        official_tags("What is the visual description of <c1,CAM_FRONT,812.4,470.0>?", "A black car.", "perception")
        == ()
    )


def test_multi_tag_items_keep_every_tag(tmp_path):
    samples = {s.id: s for s in load_samples(GT, require_images=False)}
    assert samples["scene-alpha_frame-a1_7"].tags == (1, 2) and samples["scene-alpha_frame-a1_7"].tag == 1
    assert samples["scene-alpha_frame-a2_0"].tags == (2, 3)
    rec = record(samples["scene-alpha_frame-a1_7"], "Turning right.")
    assert rec["tag"] == [1, 2] and rec["frame"] == "scene-alpha_frame-a1"
    result = drivelm_score([rec], judge=StandInJudge(), gate=False)
    assert result["counts"]["judge"] == 1 and result["counts"]["language"] == 1


def test_write_submission_is_exactly_the_challenge_list(tmp_path):
    samples = load_samples(GT, require_images=False)
    path = write_submission(tmp_path / "sub.json", samples, [f"answer {i}" for i in range(len(samples))])
    items = json.loads(path.read_text())
    assert [set(item) for item in items] == [{"id", "question", "answer"}] * len(samples)
    assert [item["id"] for item in items] == [s.id for s in samples]
    with pytest.raises(LiteVLMError, match="a submission needs every one"):
        write_submission(tmp_path / "part.json", samples, ["x"])
    assert not (tmp_path / "part.json").exists()


@pytest.fixture(scope="module")
def synth(tmp_path_factory):
    from litevlm.data.synthetic import write_dataset

    return write_dataset(tmp_path_factory.mktemp("synth"), frames=1, seed=3, size=(112, 63), progress=False).parent


def test_eval_on_a_synth_folder_says_what_it_computed(tiny_model_dir, synth, tmp_path, capsys):
    n = len(load_samples(synth))
    base = ["eval", "--data", str(synth), "--model", str(tiny_model_dir), "--max-new-tokens", "4"]
    out = tmp_path / "sub.json"
    assert main([*base, "--json", "--predictions-out", str(out), "--records", str(tmp_path / "rec.json")]) == 0
    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["scored"] and result["n"] == n and not result["official"]
    assert result["scoring"] == {"gate": True, "renormalise": False, "judge": None}
    assert result["n_scored"] + result["gated_out"] == n and "graph gate on" in result["final_note"]
    assert [set(item) for item in json.loads(out.read_text())] == [{"id", "question", "answer"}] * n
    records = json.loads((tmp_path / "rec.json").read_text())
    assert len(records) == n and "timings_ms" in records[0] and "views" in records[0]
    # --n with --predictions-out is refused before anything runs: a partial submission is never written
    assert main([*base, "--n", "2", "--predictions-out", str(tmp_path / "part.json")]) == 2
    assert not (tmp_path / "part.json").exists()
    assert main([*base, "--n", "3", "--no-gate", "--renormalise"]) == 0
    assert "graph gate off" in capsys.readouterr().out


def test_eval_on_questions_without_answers_gives_predictions_only(tiny_model_dir, synth, tmp_path, capsys):
    data = json.loads((synth / "drivelm.json").read_text())
    for scene in data.values():
        for frame in scene["key_frames"].values():
            for items in frame["QA"].values():
                for item in items:
                    item["A"] = ""
    questions = synth / "questions.json"
    questions.write_text(json.dumps(data))
    out = tmp_path / "sub.json"
    argv = ["eval", "--data", str(questions), "--model", str(tiny_model_dir), "--max-new-tokens", "2"]
    assert main([*argv, "--predictions-out", str(out)]) == 0
    said = capsys.readouterr().out
    assert "holds no answers" in said and "nothing scored" in said
    assert len(json.loads(out.read_text())) == len(load_samples(questions))
