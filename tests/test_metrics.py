"""DriveLM scoring (litevlm.eval.metrics) and the LLM judge (litevlm.eval.judge), with real values."""

import json
import math
import shutil
from http.server import BaseHTTPRequestHandler

import pytest
from conftest import loopback_server

from litevlm.errors import LiteVLMError
from litevlm.eval.judge import Judge, parse_score
from litevlm.eval.metrics import (
    closed_accuracy,
    extract_points,
    final_score,
    language_score,
    language_scores,
    match_f1,
    ptb_tokenize,
    score,
)

# --------------------------------------------------------------------------------------------
# Final score: the three published DriveLM results
# --------------------------------------------------------------------------------------------

PUBLISHED = [
    # README demo (challenge/README.md)
    dict(
        accuracy=0.0,
        chatgpt=65.11111111111111,
        match=28.25,
        language={
            "Bleu_1": 0.0495223110147729,
            "Bleu_2": 0.00021977465683011536,
            "Bleu_3": 3.6312541763196866e-05,
            "Bleu_4": 1.4776149283286042e-05,
            "ROUGE_L": 0.08383567940883102,
            "CIDEr": 0.09901486412073952,
        },
        final=0.3240234750718823,
    ),
    # server baseline, DriveLM issue #88
    dict(
        accuracy=0.6563218390804598,
        chatgpt=52.304035874439464,
        match=33.8955710955711,
        language={
            "Bleu_1": 0.7290411998613902,
            "Bleu_2": 0.6639121354657584,
            "Bleu_3": 0.6015739286561763,
            "Bleu_4": 0.540482940279753,
            "ROUGE_L": 0.7144301423026727,
            "CIDEr": 0.10061532435610071,
        },
        final=0.4988212685585955,
    ),
    # server submission, DriveLM issue #176
    dict(
        accuracy=0.7274247491638796,
        chatgpt=61.961195188203334,
        match=40.18540427325772,
        language={
            "Bleu_1": 0.7386886382254595,
            "Bleu_2": 0.6785149262510286,
            "Bleu_3": 0.6224188327995392,
            "Bleu_4": 0.5682660593560364,
            "ROUGE_L": 0.7408382267370595,
            "CIDEr": 0.16644789860984704,
        },
        final=0.567664,
    ),
]


@pytest.mark.parametrize("case", PUBLISHED)
def test_final_score_reproduces_published_drivelm_results(case):
    got = final_score(
        accuracy=case["accuracy"],
        judge=case["chatgpt"] / 100,
        language=language_score(case["language"]),
        match=case["match"] / 100,
    )
    # the published scores carry 7 decimals or fewer; float64 arithmetic adds ~1e-16: 1e-6 is the published rounding.
    assert abs(got - case["final"]) < 1e-6


def test_final_score_renormalises_missing_components():
    # no judge: a third each
    assert final_score(accuracy=0.5, judge=None, language=0.3, match=0.6) == pytest.approx((0.5 + 0.3 + 0.6) / 3)
    # no judge and no language items: half each
    assert final_score(accuracy=0.5, judge=None, language=None, match=0.6) == pytest.approx(0.55)
    # judge but no accuracy items: 0.4/0.8, 0.2/0.8, 0.2/0.8
    assert final_score(accuracy=None, judge=1.0, language=0.0, match=0.0) == pytest.approx(0.5)
    assert final_score(None, None, None, None) is None


# --------------------------------------------------------------------------------------------
# Match: coordinate F1
# --------------------------------------------------------------------------------------------

GT2 = "Firstly, notice <c1,CAM_FRONT,1000.0,500.0>. Secondly, notice <c2,CAM_BACK,200.0,300.0>."


def test_extract_points_follows_drivelm_regex():
    assert extract_points(GT2) == [(1000.0, 500.0), (200.0, 300.0)]
    # camera names, c-ids and integers are ignored; an odd count drops the last number
    assert extract_points("<c1,CAM_FRONT,1088,497> CAM_BACK") == []
    assert extract_points("<c1,CAM_FRONT,1088.3,497.5> is 2.5 m away") == [(1088.3, 497.5)]


def test_match_f1_exact_match():
    assert match_f1(GT2, GT2) == pytest.approx(1.0, abs=1e-6)


def test_match_f1_threshold_is_strictly_below_16px_l1():
    gt = "<c1,CAM_FRONT,1000.0,500.0>"
    assert match_f1("<c1,CAM_FRONT,1010.0,505.0>", gt) == pytest.approx(1.0, abs=1e-6)  # 10 + 5 = 15
    assert match_f1("<c1,CAM_FRONT,1010.0,506.0>", gt) == 0.0  # 10 + 6 = 16: no match
    assert match_f1("<c1,CAM_FRONT,1000.0,515.5>", gt) == pytest.approx(1.0, abs=1e-6)  # L1, not L2


def test_match_f1_trims_an_odd_prediction_count():
    # 1000.0 500.0 pair up, the trailing 2.5 is dropped instead of crashing the reshape
    assert match_f1("<c1,CAM_FRONT,1000.0,500.0>, about 2.5 m ahead", "<c1,CAM_FRONT,1000.0,500.0>") == pytest.approx(
        1.0, abs=1e-6
    )
    # an odd GT count does not crash either (its last number is dropped too)
    assert match_f1("<c1,CAM_FRONT,1000.0,500.0>", "<c1,CAM_FRONT,1000.0,500.0> 3.5") == pytest.approx(1.0, abs=1e-6)


def test_match_f1_ignores_camera_and_integers():
    gt = "<c1,CAM_FRONT,1000.0,500.0>"
    assert match_f1("<c1,CAM_BACK,1000.0,500.0>", gt) == pytest.approx(1.0, abs=1e-6)  # wrong camera still matches
    assert match_f1("<c1,CAM_FRONT,1000,500>", gt) == 0.0  # integers are not extracted


def test_match_f1_greedy_order_matters():
    gt = "<c1,CAM_FRONT,100.0,100.0> <c2,CAM_FRONT,110.0,100.0>"
    # (106,100) is nearer c2 (4 px) and takes it; (121,100) is then 21 px from c1: 1 TP, 1 FP, 1 FN
    assert match_f1("<c1,CAM_FRONT,106.0,100.0> <c2,CAM_FRONT,121.0,100.0>", gt) == pytest.approx(0.5, abs=1e-6)
    # the other order: (121,100) takes c2 (11 px), (106,100) takes c1 (6 px)
    assert match_f1("<c2,CAM_FRONT,121.0,100.0> <c1,CAM_FRONT,106.0,100.0>", gt) == pytest.approx(1.0, abs=1e-6)


def test_match_f1_partial_and_empty():
    gt = "<c1,C,100.0,100.0> <c2,C,500.0,500.0> <c3,C,900.0,100.0>"
    # 1 TP + 1 FP against 3 GT: P = 1/2, R = 1/3, F1 = 0.4
    assert match_f1("<c1,C,101.0,101.0> <c9,C,300.0,800.0>", gt) == pytest.approx(0.4, abs=1e-6)
    assert match_f1("I see no objects.", gt) == 0.0


# --------------------------------------------------------------------------------------------
# Language: tokenizer and pycocoevalcap scorers
# --------------------------------------------------------------------------------------------

REFS = [
    "There is a white sedan to the front of the ego car, <c1,CAM_FRONT,1088.3,497.5>.",
    "The ego vehicle is steering to the left. The ego vehicle is driving slowly.",
    "A pedestrian is crossing the road behind us on the right.",
    "The traffic light in the front view is green, so keep going ahead.",
]


def test_ptb_tokenize_matches_stanford_conventions():
    assert ptb_tokenize("Yes.") == "yes"
    assert (
        ptb_tokenize("Don't stop; it's the car's turn (probably).")
        == "do n't stop it 's the car 's turn -lrb- probably -rrb-"
    )
    assert ptb_tokenize("notice <c1,CAM_FRONT,1088.3,497.5>.") == "notice < c1 cam_front ,1088.3,497.5 >"
    # a one-letter acronym keeps its period unless a sentence-start word follows
    assert ptb_tokenize("The answer is A.") == "the answer is a."
    assert ptb_tokenize("C. The car") == "c the car"


@pytest.mark.skipif(shutil.which("java") is None, reason="the reference PTBTokenizer needs Java")
def test_ptb_tokenize_agrees_with_the_java_tokenizer():
    from pycocoevalcap.tokenizer.ptbtokenizer import PTBTokenizer

    texts = REFS + [
        "Firstly, notice <c3,CAM_FRONT_LEFT,1075.5,382.8>. The object is a traffic sign, so the ego vehicle "
        "should continue at the same speed.",
        "(traffic light, green, 674.86, 0.14, 723.33, 109.18) -- well-known... \"quoted\" 'single' e.g. U.S.",
        "I'm sure they're here; we can't go, won't go: 50% of 1,000 cars, high/low, 3-year-old.",
        "Answer: A. Going ahead. The answer is C. The car is 2.5 m away!?",
    ]
    java = PTBTokenizer().tokenize({i: [{"caption": t}] for i, t in enumerate(texts + ["end"])})
    for i, text in enumerate(texts):
        assert ptb_tokenize(text) == java[i][0], text


def test_identical_answers_score_bleu_1_rouge_1_cider_10(capsys):
    scores = language_scores(REFS, REFS)
    for n in range(1, 5):
        assert scores[f"Bleu_{n}"] == pytest.approx(1.0, abs=1e-6)
    assert scores["ROUGE_L"] == pytest.approx(1.0)
    assert scores["CIDEr"] == pytest.approx(10.0, abs=1e-6)
    assert language_score(scores) == pytest.approx(1.0, abs=1e-6)
    assert capsys.readouterr().out == ""  # pycocoevalcap's Bleu print is swallowed


def test_language_scores_hand_computed_single_pair():
    # 4 hypothesis tokens, all in the 7-token reference: BLEU-1 = 1 * exp(1 - 7/4) (brevity penalty);
    # ROUGE-L: LCS 4, P = 1, R = 4/7, F(beta=1.2); CIDEr of a one-item corpus is 0 (IDF = log 1 - log 1).
    assert ptb_tokenize("The ego car stops at the light.") == "the ego car stops at the light"
    scores = language_scores(["the ego car stops."], ["The ego car stops at the light."])
    assert scores["Bleu_1"] == pytest.approx(math.exp(1 - 7 / 4), rel=1e-6)
    p, r, b2 = 1.0, 4 / 7, 1.2**2
    assert scores["ROUGE_L"] == pytest.approx((1 + b2) * p * r / (r + b2 * p), rel=1e-9)
    assert scores["CIDEr"] == 0.0


def test_empty_prediction_scores_zero_without_crashing():
    scores = language_scores(["", REFS[1], REFS[2]], REFS[:3])
    assert 0.0 < scores["Bleu_1"] < 1.0
    assert scores["ROUGE_L"] == pytest.approx(2 / 3)
    everything_empty = language_scores(["", ""], REFS[:2])
    assert everything_empty["Bleu_1"] == pytest.approx(0.0, abs=1e-6)
    assert everything_empty["ROUGE_L"] == 0.0 and everything_empty["CIDEr"] == 0.0
    with pytest.raises(LiteVLMError):
        language_scores(["a"], [])


# --------------------------------------------------------------------------------------------
# score(): accuracy, buckets, renormalisation, gate
# --------------------------------------------------------------------------------------------


def rec(i, tag, answer, gt, question="Q?", **extra):
    return {"id": f"s_f_{i}", "question": question, "answer": answer, "gt": gt, "tag": tag, **extra}


def test_accuracy_is_raw_string_equality_with_a_normalized_variant():
    records = [rec(0, 0, "Yes", "Yes."), rec(1, [0], "No.", "No."), rec(2, 0, " a. ", "A"), rec(3, 0, "B", "A")]
    result = score(records)
    assert result["accuracy"] == pytest.approx(1 / 4)  # only "No." == "No."
    assert result["accuracy_normalized"] == pytest.approx(3 / 4)
    assert result["counts"]["accuracy"] == 4


def test_final_without_judge_and_with_an_empty_bucket_is_renormalised():
    gt = "<c1,CAM_FRONT,1000.0,500.0> <c2,CAM_BACK,200.0,300.0>"
    records = [
        rec(0, 0, "Yes.", "Yes."),
        rec(1, 0, "Yes", "No."),
        rec(2, 3, "<c1,CAM_FRONT,1001.0,501.0>", gt),  # P = 1, R = 1/2: F1 = 2/3
    ]
    result = score(records)
    assert result["judge"] is None and result["language"] is None and result["language_detail"] is None
    assert result["accuracy"] == pytest.approx(0.5)
    assert result["match"] == pytest.approx(2 / 3, abs=1e-6)
    assert "F1 alone" in result["match_note"]
    assert result["final"] == pytest.approx((0.5 + 2 / 3) / 2, abs=1e-6)
    assert result["weights"] == pytest.approx({"match": 0.5, "accuracy": 0.5})
    assert "no judge: weights renormalised over match, accuracy" in result["final_note"]
    assert "no language items" in result["final_note"]
    assert result["counts"] == {"accuracy": 2, "judge": 0, "language": 0, "match": 1, "closed": 0}


def test_final_without_judge_uses_a_third_each():
    records = [rec(0, 0, "A", "A"), rec(1, 2, REFS[0], REFS[0]), rec(2, 2, REFS[1], REFS[1]), rec(3, 3, "none", GT2)]
    result = score(records)
    assert result["final_note"] == "no judge: weights renormalised over language, match, accuracy"
    assert result["final"] == pytest.approx((1.0 + result["language"] + 0.0) / 3)


def test_official_weights_count_what_is_missing_as_zero():
    """renormalise=False: DriveLM's weights stay; no judge leaves its 0.4 and half of match at 0."""
    gt = "<c1,CAM_FRONT,1000.0,500.0> <c2,CAM_BACK,200.0,300.0>"
    records = [rec(0, 0, "Yes.", "Yes."), rec(1, 0, "Yes", "No."), rec(2, 3, "<c1,CAM_FRONT,1001.0,501.0>", gt)]
    result = score(records, renormalise=False)
    assert result["match_f1"] == pytest.approx(2 / 3, abs=1e-6)  # P = 1, R = 1/2
    assert result["match"] == pytest.approx(1 / 3, abs=1e-6)  # (F1 x 100 + 0) / 2 / 100
    assert result["final"] == pytest.approx(0.2 * 0.5 + 0.2 * 1 / 3, abs=1e-6)  # language (no items) counts 0 too
    assert result["weights"] == {"judge": 0.4, "language": 0.2, "match": 0.2, "accuracy": 0.2}
    assert result["missing"] == ["judge", "language"]
    assert "no language items (tag 2): language counted as 0" in result["final_note"]


def test_closed_accuracy_normalises():
    records = [
        rec(0, 0, "yes", "Yes.", closed=True),
        rec(1, 1, "Going ahead", "Going ahead.", closed=True),
        rec(2, 0, "No.", "Yes.", closed=True),
        rec(3, 0, "wrong", "right"),
    ]
    assert closed_accuracy(records) == pytest.approx(2 / 3)
    assert closed_accuracy(records[3:]) is None
    assert score(records)["closed_accuracy"] == pytest.approx(2 / 3)


def test_gate_drops_questions_about_objects_the_first_answer_missed():
    gt0 = "The important objects are <c1,CAM_FRONT,1000.0,500.0> and <c2,CAM_BACK,200.0,300.0>."
    records = [
        # first record of the frame: the answer finds c1 (3 px off) but not c2 -> graph = {c1}
        rec(0, 2, "The important objects are <c1,CAM_FRONT,1002.0,501.0>.", gt0, frame="f"),
        rec(1, 0, "No.", "No.", question="Is <c2,CAM_BACK,200.0,300.0> a traffic sign?", frame="f"),
        rec(2, 0, "Yes.", "Yes.", question="Is <c1,CAM_FRONT,1000.0,500.0> moving?", frame="f"),
        rec(3, 0, "B", "A", question="Predict the behavior of the ego vehicle.", frame="f"),
        # another frame starts its own graph
        rec(4, 0, "No.", "No.", question="Is <c2,CAM_BACK,200.0,300.0> moving?", frame="g"),
    ]
    gated = score(records, gate=True)
    assert gated["n"] == 5 and gated["n_scored"] == 4 and gated["gated_out"] == 1
    assert gated["counts"]["accuracy"] == 3
    assert gated["accuracy"] == pytest.approx(2 / 3)
    assert "1 of 5 records dropped" in gated["final_note"]
    ungated = score(records)
    assert ungated["n_scored"] == 5 and ungated["accuracy"] == pytest.approx(3 / 4)
    with pytest.raises(LiteVLMError, match="frame"):
        score([rec(0, 0, "A", "A")], gate=True)


def test_bad_records_raise_clear_errors():
    with pytest.raises(LiteVLMError, match="tag"):
        score([rec(0, 7, "A", "A")])
    with pytest.raises(LiteVLMError, match="missing gt"):
        score([{"id": 1, "question": "q", "answer": "a", "tag": 0}])
    with pytest.raises(LiteVLMError, match="answer must be a string"):
        score([rec(0, 0, None, "A")])


# --------------------------------------------------------------------------------------------
# Judge: reply parsing and a stub OpenAI-compatible endpoint on 127.0.0.1
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "reply, expected",
    [
        ("85", 85.0),
        ("Score: 30", 30.0),
        ("I would rate your answer as 10.", 10.0),
        ("I would rate it 85.", 85.0),
        ("85/100", 85.0),
        ("8/10", 80.0),
        ("<think>maybe 20?</think>72", 72.0),
        ("150", 100.0),
        ("The", None),
        ("", None),
        (None, None),
    ],
)
def test_parse_score(reply, expected):
    assert parse_score(reply) == expected


class _StubHandler(BaseHTTPRequestHandler):
    """/<mode>/v1/chat/completions: echo (reply = the answer), fixed<N>, badjson, err500, nochoices."""

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self.server.seen.append({"path": self.path, "auth": self.headers.get("Authorization"), "body": body})
        mode = self.path.split("/")[1]
        if mode == "err500":
            return self._send(500, b"internal error")
        if mode == "badjson":
            return self._send(200, b'{"choices": [{"message": ')
        if mode == "nochoices":
            return self._send(200, json.dumps({"error": {"message": "No available key left!"}}).encode())
        if mode == "echo":
            content = body["messages"][-1]["content"].split("This is my answer: ", 1)[1]
        else:
            content = mode.removeprefix("fixed")
        reply = {"choices": [{"index": 0, "message": {"role": "assistant", "content": content}}]}
        self._send(200, json.dumps(reply).encode())

    def _send(self, status, payload):
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(payload)))
        self.end_headers()
        self.wfile.write(payload)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def stub():
    with loopback_server(_StubHandler) as server:
        yield server


def _judge(stub, mode, **kw):
    return Judge(f"http://127.0.0.1:{stub.server_address[1]}/{mode}/v1", "stub-judge", retry_delay=0, timeout=5, **kw)


def test_judge_parses_replies_through_the_endpoint(stub):
    judge = _judge(stub, "echo", api_key="sk-test")
    replies = ["85", "Score: 30", "I would rate your answer as 10.", "The", "", "85/100"]
    got = [judge.score("What should the ego vehicle do?", "Keep going.", reply) for reply in replies]
    assert got == [85.0, 30.0, 10.0, None, None, 85.0]
    assert judge.unparsed == 2 and judge.calls == 6
    request = stub.seen[-1]
    assert request["path"] == "/echo/v1/chat/completions"
    assert request["auth"] == "Bearer sk-test"
    assert request["body"]["model"] == "stub-judge"
    assert "This is the correct answer: Keep going." in request["body"]["messages"][-1]["content"]
    assert "sk-test" not in repr(judge)


@pytest.mark.parametrize("mode, detail", [("badjson", "not JSON"), ("err500", "HTTP 500"), ("nochoices", "choices")])
def test_judge_endpoint_failures_raise_after_one_retry(stub, mode, detail):
    judge = _judge(stub, mode)
    before = len(stub.seen)
    with pytest.raises(LiteVLMError) as err:
        judge.score("q", "gt", "pred")
    assert len(stub.seen) - before == 2  # one retry
    assert f"127.0.0.1:{stub.server_address[1]}/{mode}/v1/chat/completions" in str(err.value)
    assert detail in str(err.value)


def test_judge_rejects_a_non_http_endpoint():
    with pytest.raises(LiteVLMError, match="not an http"):
        Judge("localhost:8000", "m")


def test_score_with_a_judge_uses_drivelm_weights(stub):
    judge = _judge(stub, "fixed80")
    gt = "<c1,CAM_FRONT,1000.0,500.0>"
    records = [
        rec(0, 0, "A", "A"),
        rec(1, 1, "Slow down.", "Slow down and yield."),
        rec(2, 2, REFS[0], REFS[0]),
        rec(3, 2, REFS[1], REFS[1]),
        rec(4, 3, "<c1,CAM_FRONT,1000.0,500.0>", gt),
    ]
    result = score(records, judge=judge)
    assert result["judge"] == pytest.approx(0.8)
    assert result["match"] == pytest.approx((100 + 80) / 2 / 100, abs=1e-6)  # DriveLM: (F1x100 + judge) / 2
    assert result["language"] == pytest.approx(1.0, abs=1e-6)
    assert result["final"] == pytest.approx(0.4 * 0.8 + 0.2 * 1.0 + 0.2 * 0.9 + 0.2 * 1.0, abs=1e-6)
    assert result["judge_model"] == "stub-judge" and result["judge_unparsed"] == 0
    assert result["final_note"].startswith("DriveLM weights")


def test_unparsed_judge_replies_are_counted_and_left_out(stub):
    judge = _judge(stub, "echo")
    records = [rec(0, 1, "70", "x"), rec(1, 1, "The", "x"), rec(2, 3, "no idea", GT2)]
    result = score(records, judge=judge)
    assert result["judge"] == pytest.approx(0.7)
    assert result["judge_unparsed"] == 2
    assert result["match"] == 0.0 and "no parseable score" in result["match_note"]
