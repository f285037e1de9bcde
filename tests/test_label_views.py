"""`label-views` against a local stub that speaks the OpenAI chat-completions API.

The stub (http.server on 127.0.0.1, a thread) answers by the question in the prompt: good replies
in several shapes, a malformed reply (asked once more, then recorded as all six, unparsed), and a
failure after k questions (the run stops, the finished lines are on disk, a rerun resumes without
asking the finished questions again).
"""

from __future__ import annotations

import json
import re
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from litevlm.cameras import CAMERAS
from litevlm.cli import build_parser
from litevlm.errors import LiteVLMError
from litevlm.select.label_views import label_views, parse_views

IMPLICIT = {  # question -> the stub's reply
    "Can the ego vehicle safely turn right now?": '["CAM_FRONT_RIGHT", "CAM_BACK_RIGHT"]',
    "Is it safe to change lanes to the left?": "CAM_FRONT_LEFT, CAM_BACK_LEFT",
    "What is the traffic signal that the ego vehicle should pay attention to?": "You would need CAM_FRONT for that.",
    "In this scenario, what are safe actions to take for the ego vehicle?": "All six cameras are needed.",
    "What is the target action of the ego vehicle?": "front left, front, front right",
}
MALFORMED = "Predict the behavior of the ego vehicle."
FIXED_ON_RETRY = "Is it safe to reverse now?"


class Stub:
    """The endpoint: records every question asked; fails (HTTP 500) once `fail_after` calls were served."""

    def __init__(self):
        self.asked: list[str] = []
        self.fail_after: int | None = None
        self.retried: set[str] = set()
        stub = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):  # keep pytest output clean
                pass

            def do_POST(self):
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                assert self.path == "/v1/chat/completions"
                if stub.fail_after is not None and len(stub.asked) >= stub.fail_after:
                    self.send_response(500)
                    self.end_headers()
                    self.wfile.write(b"overloaded")
                    return
                prompt = body["messages"][1]["content"]
                question = re.search(r"Question: (.*)\n", prompt).group(1)
                stub.asked.append(question)
                retry = len(body["messages"]) > 2
                if question == MALFORMED:
                    reply = "I am not sure." if not retry else "Hard to say, sorry."
                elif question == FIXED_ON_RETRY:
                    reply = "Let me think." if not retry else '["CAM_BACK"]'
                else:
                    reply = IMPLICIT.get(question, "[]")
                data = json.dumps(
                    {
                        "id": "x",
                        "object": "chat.completion",
                        "model": body["model"],
                        "choices": [
                            {"index": 0, "message": {"role": "assistant", "content": reply}, "finish_reason": "stop"}
                        ],
                    }
                ).encode()
                self.send_response(200)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}/v1"
        self.thread = threading.Thread(target=self.server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self):
        self.server.shutdown()
        self.server.server_close()


@pytest.fixture
def stub():
    s = Stub()
    yield s
    s.close()


def write_questions(path, questions):
    path.write_text("".join(json.dumps({"question": q}) + "\n" for q in questions))


def read_out(path):
    return [json.loads(line) for line in path.read_text().splitlines()]


def test_parse_views_shapes():
    assert parse_views('["CAM_FRONT", "CAM_BACK"]') == ("CAM_FRONT", "CAM_BACK")
    assert parse_views("CAM_BACK, CAM_FRONT") == ("CAM_FRONT", "CAM_BACK")
    assert parse_views("You need CAM_BACK_LEFT.") == ("CAM_BACK_LEFT",)
    assert parse_views("front left and back-left") == ("CAM_FRONT_LEFT", "CAM_BACK_LEFT")
    assert parse_views('<think>maybe CAM_FRONT</think>["cam_back_right"]') == ("CAM_BACK_RIGHT",)
    assert parse_views('["all"]') == CAMERAS and parse_views("All six cameras are needed.") == CAMERAS
    for bad in ("I am not sure.", "Not at all sure", "Go back.", "", None, "[]"):
        assert parse_views(bad) is None, bad


def test_good_replies_and_lexical_questions(stub, tmp_path):
    explicit = "What are objects to the back left of the ego car?"
    write_questions(tmp_path / "q.jsonl", list(IMPLICIT) + [explicit])
    counts = label_views(stub.url, "stub-llm", tmp_path / "q.jsonl", tmp_path / "l.jsonl", retry_delay=0)
    out = {item["question"]: item for item in read_out(tmp_path / "l.jsonl")}
    assert out[explicit] == {"question": explicit, "views": ["CAM_BACK_LEFT"], "source": "lexical"}
    assert explicit not in stub.asked  # explicit questions never cost a call
    assert out["Can the ego vehicle safely turn right now?"]["views"] == ["CAM_FRONT_RIGHT", "CAM_BACK_RIGHT"]
    assert out["Is it safe to change lanes to the left?"]["views"] == ["CAM_FRONT_LEFT", "CAM_BACK_LEFT"]
    assert out["What is the traffic signal that the ego vehicle should pay attention to?"]["views"] == ["CAM_FRONT"]
    assert out["In this scenario, what are safe actions to take for the ego vehicle?"]["views"] == list(CAMERAS)
    assert out["What is the target action of the ego vehicle?"]["views"] == [
        "CAM_FRONT",
        "CAM_FRONT_LEFT",
        "CAM_FRONT_RIGHT",
    ]
    assert counts == {"total": 6, "skipped": 0, "lexical": 1, "llm": 5, "cached": 0, "unparsed": 0, "calls": 5}
    assert not any(item.get("unparsed") for item in out.values())

    # The trainer reads the file as it is.
    from litevlm.train.views import read_labels

    assert dict(read_labels(tmp_path / "l.jsonl"))[explicit] == ("CAM_BACK_LEFT",)


def test_malformed_reply_retried_once_then_all_six(stub, tmp_path):
    write_questions(tmp_path / "q.jsonl", [MALFORMED, FIXED_ON_RETRY])
    counts = label_views(stub.url, "stub-llm", tmp_path / "q.jsonl", tmp_path / "l.jsonl", retry_delay=0)
    out = {item["question"]: item for item in read_out(tmp_path / "l.jsonl")}
    assert out[MALFORMED]["views"] == list(CAMERAS) and out[MALFORMED]["unparsed"] is True
    assert out[FIXED_ON_RETRY]["views"] == ["CAM_BACK"] and "unparsed" not in out[FIXED_ON_RETRY]
    assert stub.asked.count(MALFORMED) == 2 and stub.asked.count(FIXED_ON_RETRY) == 2
    assert counts["unparsed"] == 1 and counts["calls"] == 4


def test_interrupted_run_resumes_without_reasking(stub, tmp_path):
    questions = list(IMPLICIT)
    write_questions(tmp_path / "q.jsonl", questions)
    stub.fail_after = 2  # the third call fails (both tries): the run stops there
    with pytest.raises(LiteVLMError, match="resumes"):
        label_views(stub.url, "stub-llm", tmp_path / "q.jsonl", tmp_path / "l.jsonl", retry_delay=0)
    assert [item["question"] for item in read_out(tmp_path / "l.jsonl")] == questions[:2]

    stub.fail_after = None
    counts = label_views(stub.url, "stub-llm", tmp_path / "q.jsonl", tmp_path / "l.jsonl", retry_delay=0)
    assert counts["skipped"] == 2 and counts["calls"] == 3
    assert [item["question"] for item in read_out(tmp_path / "l.jsonl")] == questions  # each once, in order
    assert sorted(stub.asked) == sorted(questions)  # nobody was asked twice

    # A run killed in the middle of writing a line: the torn line is cut off and that question redone.
    out = tmp_path / "l.jsonl"
    text = out.read_text()
    out.write_text(text[: len(text) - len(text.splitlines()[-1]) // 2 - 1])  # half the last line, no newline
    counts = label_views(stub.url, "stub-llm", tmp_path / "q.jsonl", out, retry_delay=0)
    assert counts["skipped"] == 4 and counts["cached"] == 1 and counts["calls"] == 0  # its reply was cached
    assert [item["question"] for item in read_out(out)] == questions


def test_cache_serves_a_new_output_and_cli(stub, tmp_path, capsys):

    write_questions(tmp_path / "q.jsonl", list(IMPLICIT))
    label_views(
        stub.url, "stub-llm", tmp_path / "q.jsonl", tmp_path / "a.jsonl", cache_path=tmp_path / "c.jsonl", retry_delay=0
    )
    asked = len(stub.asked)

    args = build_parser().parse_args(
        [
            "label-views",
            "--endpoint",
            stub.url,
            "--model",
            "stub-llm",
            "--in",
            str(tmp_path / "q.jsonl"),
            "--out",
            str(tmp_path / "b.jsonl"),
            "--cache",
            str(tmp_path / "c.jsonl"),
            "--json",
        ]
    )
    args.func(args)
    counts = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert counts["cached"] == len(IMPLICIT) and counts["calls"] == 0 and len(stub.asked) == asked
    assert read_out(tmp_path / "a.jsonl") == read_out(tmp_path / "b.jsonl")


def test_bad_inputs_are_clear_errors(stub, tmp_path):
    with pytest.raises(LiteVLMError, match="no questions"):
        label_views(stub.url, "m", tmp_path / "missing.jsonl", tmp_path / "l.jsonl")
    (tmp_path / "q.jsonl").write_text("not json\n")
    with pytest.raises(LiteVLMError, match=r"q.jsonl:1"):
        label_views(stub.url, "m", tmp_path / "q.jsonl", tmp_path / "l.jsonl")
    write_questions(tmp_path / "q.jsonl", ["Can the ego vehicle safely turn right now?"])
    with pytest.raises(LiteVLMError, match="http"):
        label_views("ftp://nowhere", "m", tmp_path / "q.jsonl", tmp_path / "l.jsonl")
