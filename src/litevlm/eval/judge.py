"""An LLM judge for DriveLM's "ChatGPT score", on any OpenAI-compatible chat-completions endpoint.

DriveLM (challenge/gpt_eval.py) asks gpt-3.5-turbo to rate an answer against the correct answer
out of 100, "number only", and passes the reply straight to float(), so a reply such as "Score: 30"
or "The" crashes the official run (DriveLM issues #53, #92, #146). This judge sends the official
text by default (the same system message, the same user message character for character: the
question is not shown, the parts are joined without separators; `prompt="with-question"` adds
the question) and parses the reply robustly: the rating number is taken from free text, "85/100"
reads as 85, a reply without a number counts as unparsed (None) instead of crashing. A judge model
other than the official server's gives other numbers: report the judge model with the score.
Standard library only (urllib); no network is touched unless `score` is called.
"""

from __future__ import annotations

import http.client
import json
import re
import time
import urllib.error
import urllib.parse
import urllib.request

from litevlm.errors import LiteVLMError

SYSTEM_PROMPT = "an evaluator who rates my answer based on the correct answer"
# The official user message: this, then "This is the correct answer: " + GT + "This is my answer: " + answer.
OFFICIAL_INSTRUCTION = (
    "Rate my answer based on the correct answer out of 100, with higher scores indicating that the answer is closer "
    "to the correct answer, and you should be accurate to single digits like 62, 78, 41,etc. Output the number only"
)
PROMPTS = ("official", "with-question")
USER_PROMPT = (  # prompt="with-question": the instruction on its own line, then the question
    "Rate my answer based on the correct answer out of 100, with higher scores indicating that the "
    "answer is closer to the correct answer, and you should be accurate to single digits like 62, "
    "78, 41, etc. Output the number only.\n"
    "This is the question: {question}\n"
    "This is the correct answer: {gt}\n"
    "This is my answer: {pred}"
)

_THINK = re.compile(r"<think>.*?</think>", re.DOTALL | re.IGNORECASE)
_NUMBER = r"(-?\d+(?:\.\d+)?)"
_FRACTION = re.compile(_NUMBER + r"\s*(?:/|out of)\s*(100|10|5)(?![\d.])", re.IGNORECASE)
_KEYWORD = re.compile(r"\b(?:score|rating|rate|grade)\b[^\d\n-]{0,30}?" + _NUMBER, re.IGNORECASE)
_FIRST = re.compile(_NUMBER)
_LOOPBACK = {"127.0.0.1", "localhost", "::1"}


def parse_score(reply: str | None) -> float | None:
    """The 0..100 rating in a judge's reply, or None when it holds no number.

    "85" -> 85, "Score: 30" -> 30, "I would rate your answer as 10." -> 10, "85/100" -> 85,
    "8/10" -> 80, "The" / "" -> None. <think>...</think> blocks are ignored; values are clamped.
    """
    if not reply:
        return None
    text = _THINK.sub(" ", reply)
    fraction = _FRACTION.search(text)
    if fraction:
        value = float(fraction.group(1)) * 100.0 / float(fraction.group(2))
    else:
        found = _KEYWORD.search(text) or _FIRST.search(text)
        if found is None:
            return None
        value = float(found.group(1))
    return min(100.0, max(0.0, value))


def _chat_url(endpoint_url: str) -> str:
    url = endpoint_url.strip().rstrip("/")
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme not in ("http", "https") or not parsed.netloc:
        raise LiteVLMError(f"judge endpoint {endpoint_url!r} is not an http(s) URL; pass e.g. http://127.0.0.1:8000/v1")
    return url if url.endswith("/chat/completions") else url + "/chat/completions"


class Judge:
    """Scores an answer 0..100 against the correct answer with a chat model.

    endpoint_url: an OpenAI-compatible base URL ("http://host:port/v1"; "/chat/completions" is
    appended unless already there). api_key is sent as a Bearer token when given. Each call is
    tried twice (one retry after `retry_delay` seconds); if both fail (HTTP error, connection
    error, timeout, a reply that is not JSON or has no choices[0].message.content) it raises
    LiteVLMError naming the endpoint. A reply without a number is not an error: `score` returns
    None and `unparsed` counts it. temperature defaults to 0 for repeatable scores (DriveLM: 0.6).
    prompt: "official" (DriveLM's text, the question not shown) or "with-question".
    """

    def __init__(
        self,
        endpoint_url: str,
        model: str,
        api_key: str | None = None,
        timeout: float = 30,
        *,
        temperature: float = 0.0,
        max_tokens: int = 256,
        retry_delay: float = 1.0,
        prompt: str = "official",
    ):
        if prompt not in PROMPTS:
            raise LiteVLMError(f"judge prompt {prompt!r} is not one of {', '.join(PROMPTS)}")
        self.url = _chat_url(endpoint_url)
        self.prompt = prompt
        self.model = model
        self.timeout = timeout
        self.temperature = temperature
        self.max_tokens = max_tokens
        self.retry_delay = retry_delay
        self._api_key = api_key
        self.calls = 0
        self.unparsed = 0
        host = urllib.parse.urlparse(self.url).hostname
        # A local judge must not be routed through an http_proxy from the environment.
        handlers = [urllib.request.ProxyHandler({})] if host in _LOOPBACK else []
        self._opener = urllib.request.build_opener(*handlers)

    def __repr__(self) -> str:  # never shows the key
        return f"Judge(endpoint_url={self.url!r}, model={self.model!r})"

    def messages(self, question: str, gt: str, pred: str) -> list[dict]:
        """The chat messages sent for one rating."""
        if self.prompt == "official":
            user = OFFICIAL_INSTRUCTION + "This is the correct answer: " + gt + "This is my answer: " + pred
        else:
            user = USER_PROMPT.format(question=question, gt=gt, pred=pred)
        return [{"role": "system", "content": SYSTEM_PROMPT}, {"role": "user", "content": user}]

    def score(self, question: str, gt: str, pred: str) -> float | None:
        """The judge's 0..100 rating of `pred` against `gt`, or None if the reply has no number."""
        value = parse_score(self.complete(self.messages(question, gt, pred)))
        if value is None:
            self.unparsed += 1
        return value

    def complete(self, messages: list[dict]) -> str:
        """POST one chat-completions request; the reply text ("" when the model returned none)."""
        payload = {
            "model": self.model,
            "messages": messages,
            "temperature": self.temperature,
            "max_tokens": self.max_tokens,
        }
        headers = {"Content-Type": "application/json", "Accept": "application/json"}
        if self._api_key:
            headers["Authorization"] = f"Bearer {self._api_key}"
        body = json.dumps(payload).encode("utf-8")
        self.calls += 1
        problem = ""
        for attempt in range(2):
            if attempt:
                time.sleep(self.retry_delay)
            request = urllib.request.Request(self.url, data=body, headers=headers, method="POST")
            try:
                with self._opener.open(request, timeout=self.timeout) as response:
                    raw = response.read()
            except urllib.error.HTTPError as err:
                detail = err.read()[:200].decode("utf-8", "replace") if err.fp is not None else ""
                problem = f"HTTP {err.code} {err.reason}" + (f": {detail}" if detail else "")
                continue
            except (urllib.error.URLError, http.client.HTTPException, OSError) as err:
                problem = f"{type(err).__name__}: {getattr(err, 'reason', err)}"
                continue
            try:
                data = json.loads(raw)
            except (UnicodeDecodeError, json.JSONDecodeError):
                problem = f"the reply is not JSON: {raw[:200].decode('utf-8', 'replace')!r}"
                continue
            try:
                content = data["choices"][0]["message"]["content"]
            except (KeyError, IndexError, TypeError):
                problem = f"the reply has no choices[0].message.content: {json.dumps(data)[:200]}"
                continue
            if isinstance(content, list):  # content parts: [{"type": "text", "text": ...}, ...]
                content = "".join(part.get("text", "") for part in content if isinstance(part, dict))
            return content if isinstance(content, str) else ""
        raise LiteVLMError(
            f"judge endpoint {self.url} failed twice ({problem}); check the URL, the model name "
            f"{self.model!r} and the API key, or score without a judge"
        )
