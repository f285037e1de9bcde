"""View labels from a language model: which cameras does each question need?

The paper's hybrid labelling (arXiv 2506.07416, section 3): questions that name their cameras
(c-tags, camera names, direction phrases) are labelled by the lexical map; implicit ones are sent
to a chat model (the paper used GPT-3.5-Turbo) with the six cameras described, asking for a JSON
list. Any OpenAI-compatible chat-completions endpoint works (`litevlm.eval.judge.Judge` makes the
call: two tries, a clear error). Replies are parsed robustly (a JSON list, a comma list, camera
names or direction words anywhere in prose); a reply naming no camera is asked once more, then
recorded as all six views with "unparsed": true. Output lines are appended as each question is
done and raw replies are cached by question text, so an interrupted run resumes where it stopped
and a rerun never asks twice.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

from tqdm import tqdm

from litevlm.cameras import CAMERAS
from litevlm.errors import LiteVLMError

SYSTEM_PROMPT = (
    "You label driving questions for a car with six cameras (the nuScenes rig). You say which "
    "camera images are needed to answer a question. Reply with a JSON list of camera names only."
)
USER_PROMPT = """The six cameras and what they see:
- CAM_FRONT: straight ahead of the ego vehicle
- CAM_FRONT_LEFT: ahead and to the left
- CAM_FRONT_RIGHT: ahead and to the right
- CAM_BACK: straight behind (a wide lens)
- CAM_BACK_LEFT: behind and to the left
- CAM_BACK_RIGHT: behind and to the right
An object tag such as <c1,CAM_BACK,1088.3,497.5> names the camera that shows the object.
Questions about the whole scene, the ego vehicle's own behavior, or which actions are safe need all six cameras.

Question: {question}

Which cameras are needed to answer this question? Reply with a JSON list, for example """ + (
    '["CAM_FRONT", "CAM_FRONT_LEFT"].'
)
RETRY_PROMPT = 'Reply with a JSON list of camera names only, for example ["CAM_BACK"] or all six names.'

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_LIST = re.compile(r"\[[^\[\]]*\]", re.DOTALL)
_CAMERA_NAME = re.compile(r"\bcam[ _-]?(front|back)(?:[ _-](left|right))?\b", re.IGNORECASE)
_DIRECTION = re.compile(r"\b(front|back|rear)(?:[ _-]?(left|right))?\b", re.IGNORECASE)
_ALL = re.compile(r"\ball (?:six|6|the cameras|cameras|views|camera views|of them)\b", re.IGNORECASE)
# A bare list of direction words ("front left, back left"): nothing else in the reply.
_ONLY_DIRECTIONS = re.compile(
    r"^(?:\s|[,;.\-_/&]|\b(?:and|or|the|front|back|rear|left|right|cam|camera|cameras|view|views)\b)*$", re.IGNORECASE
)


def _camera(end: str, side: str | None) -> str:
    return ("CAM_FRONT" if end.lower() == "front" else "CAM_BACK") + (f"_{side.upper()}" if side else "")


def _names_in(text: str) -> set[str]:
    """Cameras named in a piece of text: CAM_ names anywhere; direction words only when the text is
    nothing but a list of them ("front left, back"); "all six cameras" / a bare "all" means every view."""
    found = {_camera(m.group(1), m.group(2)) for m in _CAMERA_NAME.finditer(text)}
    if not found and _ONLY_DIRECTIONS.match(text):
        found = {_camera(m.group(1), m.group(2)) for m in _DIRECTION.finditer(text)}
    if not found and (_ALL.search(text) or text.strip().strip("\"'.").lower() in ("all", "all six")):
        found = set(CAMERAS)
    return found


def parse_views(reply: str | None) -> tuple[str, ...] | None:
    """The cameras a labeller's reply names, in CAMERAS order, or None when it names none.

    '["CAM_FRONT", "CAM_BACK"]', 'CAM_FRONT, CAM_BACK', 'You need CAM_BACK_LEFT.',
    'front left and back left', '["all"]' all parse; "I am not sure." does not. <think> blocks
    are ignored. A JSON list wins over prose around it.
    """
    if not reply:
        return None
    text = _THINK.sub(" ", reply)
    found: set[str] = set()
    for m in _LIST.finditer(text):
        try:
            items = json.loads(m.group(0))
        except json.JSONDecodeError:
            items = [m.group(0)]
        for item in items if isinstance(items, list) else []:
            found |= _names_in(str(item))
        if found:
            break
    if not found:
        found = _names_in(text)
    return tuple(c for c in CAMERAS if c in found) or None


def messages(question: str) -> list[dict]:
    return [
        {"role": "system", "content": SYSTEM_PROMPT},
        {"role": "user", "content": USER_PROMPT.format(question=question)},
    ]


def _read_jsonl(path: Path, what: str, repair: bool = False) -> list[dict]:
    """Lines of a JSONL file; with `repair`, a torn last line (a run killed mid-write) is cut off the file."""
    if not path.is_file():
        return []
    raw = path.read_text(encoding="utf-8")
    lines = raw.split("\n")
    items = []
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
        except json.JSONDecodeError:
            if repair and n == len(lines) and not raw.endswith("\n"):  # torn tail: cut it off and redo that question
                path.write_text(raw[: len(raw) - len(line)], encoding="utf-8")
                break
            raise LiteVLMError(f"{path}:{n}: not a JSON line; is this a {what} file?") from None
        if not isinstance(item, dict) or not isinstance(item.get("question"), str):
            raise LiteVLMError(f'{path}:{n}: expected an object with a "question" string ({what} file)')
        items.append(item)
    return items


def _append(path: Path, item: dict) -> None:
    with path.open("a", encoding="utf-8") as f:
        f.write(json.dumps(item, ensure_ascii=False) + "\n")
        f.flush()


def label_views(
    endpoint: str,
    model: str,
    in_path: str | Path,
    out_path: str | Path,
    api_key: str | None = None,
    cache_path: str | Path | None = None,
    *,
    ask_all: bool = False,
    timeout: float = 60.0,
    retry_delay: float = 1.0,
    progress: bool = False,
) -> dict:
    """Label every question of `in_path` (`{"question": ...}` lines) into `out_path` (`{"question", "views"}`).

    Questions already in `out_path` are skipped (resume). Explicit questions are labelled by the
    lexical map without a call unless `ask_all`. Raw replies are cached in `cache_path` (default:
    OUT with suffix .cache.jsonl) by (model, question). An endpoint failure raises LiteVLMError
    after every finished question has been written; rerun the same command to continue. Returns
    counts: total, skipped (already done), lexical, llm, cached, unparsed, calls.
    """
    from litevlm.eval.judge import Judge
    from litevlm.select.views import lexical_views  # torch: imported only when labelling

    src, out = Path(in_path), Path(out_path)
    cache = Path(cache_path) if cache_path is not None else out.with_name(out.name + ".cache.jsonl")
    if not src.is_file():
        raise LiteVLMError(f'no questions at {src}: expected a JSONL file of {{"question": ...}} lines')
    questions = []
    for item in _read_jsonl(src, "questions"):
        if item["question"] not in questions:
            questions.append(item["question"])
    out.parent.mkdir(parents=True, exist_ok=True)
    done = {item["question"] for item in _read_jsonl(out, "view labels", repair=True)}
    replies = {
        (item.get("model"), item["question"]): item.get("replies", [])
        for item in _read_jsonl(cache, "reply cache", repair=True)
    }
    client = Judge(endpoint, model, api_key, timeout=timeout, retry_delay=retry_delay)
    counts = {"total": len(questions), "skipped": 0, "lexical": 0, "llm": 0, "cached": 0, "unparsed": 0, "calls": 0}

    def ask(question: str) -> list[str]:
        """The raw replies for a question: one, or two when the first names no camera."""
        got = [client.complete(messages(question))]
        counts["calls"] += 1
        if parse_views(got[0]) is None:
            retry = messages(question) + [
                {"role": "assistant", "content": got[0]},
                {"role": "user", "content": RETRY_PROMPT},
            ]
            got.append(client.complete(retry))
            counts["calls"] += 1
        return got

    for question in tqdm(questions, desc="label views", unit="q", disable=not progress):
        if question in done:
            counts["skipped"] += 1
            continue
        lex = [c for c, v in lexical_views(question).items() if v]
        if lex and not ask_all:
            item = {"question": question, "views": lex, "source": "lexical"}
            counts["lexical"] += 1
        else:
            key = (model, question)
            if key in replies and replies[key]:
                got = replies[key]
                counts["cached"] += 1
            else:
                try:
                    got = ask(question)
                except LiteVLMError as e:
                    raise LiteVLMError(
                        f"label-views stopped at question {questions.index(question) + 1} of {len(questions)}; "
                        f"{out} holds the finished ones and the same command resumes: {e}"
                    ) from None
                replies[key] = got
                _append(cache, {"model": model, "question": question, "replies": got})
            views = next((v for v in map(parse_views, got) if v is not None), None)
            item = {"question": question, "views": list(views or CAMERAS), "source": "llm"}
            if views is None:
                item["unparsed"] = True
                counts["unparsed"] += 1
            counts["llm"] += 1
        _append(out, item)
        done.add(question)
    return counts
