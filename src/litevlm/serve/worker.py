"""The model worker: bounded admission, in-flight batching on one model thread, deadlines, cancellation.

With `Limits.max_batch` > 1 and a pipeline that can batch (`Pipeline.batch_decoder`: the modules or native
backend), the model thread runs one loop: it takes the queued requests while the batch has room, prefills each
(views, token selection, prompt: per request) and adds it to the running batch (`litevlm.batch.BatchDecoder`),
then runs one step for every answer in the batch, streams what each made, and lets go of the finished, the
cancelled, the disconnected and those past their deadline, whose rows are free at once for the next request.
Otherwise it answers one request at a time.

A queued request holds its images as the encoded bytes the client sent (headers checked by the parser), and
the pipeline gets those bytes when its turn comes: it decodes only the views the question needs, and none
that its view cache already holds. The queue's memory is bounded by its length times the body limit.
The model thread iterates the pipeline's stream (`Pipeline.stream`: Deltas as tokens are made, then the
Answer) and between items checks whether the request is still wanted: a client that disconnected or a
deadline that passed stops the work at the next step, and a request dropped while queued is never
decoded at all. A LiteVLMError from the pipeline (a missing or unreadable image the question needs) is the
client's 400, naming the camera.
"""

from __future__ import annotations

import asyncio
import math
import queue
import threading
import time
from collections.abc import Iterator
from concurrent.futures import Future, ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from litevlm.errors import LiteVLMError
from litevlm.pipeline import Answer, TextStream
from litevlm.serve.metrics import Metrics
from litevlm.serve.parse import ChatRequest, Limits
from litevlm.serve.protocol import APIError


def stream_pieces(pipe, ans: Answer) -> list[str]:
    """The answer's text cut into one piece per generated token (those that add text), as `Pipeline.stream`
    cuts it."""
    stream = TextStream(pipe.tokenizer, pipe.tokenizer.eos_id)
    pieces = [stream.push([t]) for t in ans.tokens]
    return [p for p in [*pieces, stream.finish()] if p]


def refusal(err: LiteVLMError) -> APIError:
    """The pipeline's refusal of a request's input as a 400, with its message (which names the camera) and, for a
    camera the question needs (`litevlm.errors.CameraError`), its code: missing_cameras or invalid_image."""
    return APIError(400, str(err), code=getattr(err, "code", "invalid_request"), param="messages")


@dataclass(eq=False)
class Job:
    """One admitted request. The model thread reports on `events` (through the event loop):
    ("delta", text), ("done", Answer), ("cancelled", reason) or ("error", exception)."""

    req: ChatRequest
    arrived: float  # time.monotonic() when the request arrived
    deadline: float  # time.monotonic() past which nobody waits for the answer
    loop: asyncio.AbstractEventLoop
    events: asyncio.Queue = field(default_factory=asyncio.Queue)
    cancel: threading.Event = field(default_factory=threading.Event)
    reason: str = ""
    started: bool = False  # the model thread has taken it
    finished: bool = False  # the model thread has let it go
    answered: bool = False  # its handler has the Answer
    queue_s: float = 0.0
    service_s: float = 0.0
    done: Future = field(default_factory=Future)  # batched: set by the model thread when it lets the job go

    def drop(self, reason: str) -> None:
        """Nobody will read the answer ('disconnected' or 'deadline'): stop at the next check."""
        if not self.cancel.is_set():
            self.reason = reason
            self.cancel.set()

    def dropped(self) -> str | None:
        if not self.cancel.is_set() and time.monotonic() > self.deadline:
            self.drop("deadline")
        return self.reason if self.cancel.is_set() else None

    def put(self, kind: str, value: Any) -> None:
        """From the model thread: hand an event to the request's handler on the event loop."""
        self.loop.call_soon_threadsafe(self.events.put_nowait, (kind, value))


@dataclass(eq=False)
class Running:
    """A job in the running batch: its started answer and what has been streamed of it."""

    job: Job
    started: Any  # `litevlm.pipeline.Started`
    text: TextStream
    start: float
    sent: str = ""


class Worker:
    """Admits requests (429 past the queue limit) and answers them on its model thread, decoded together up to
    `limits.max_batch` at a time where the pipeline can batch, else one at a time.

    `pending` and `jobs` are the admitted requests not yet finished, as the event loop sees them: a job
    dropped by its handler (504, a client gone) stays counted until the model thread has let it go."""

    def __init__(self, pipe, limits: Limits, metrics: Metrics):
        self.pipe, self.limits, self.metrics = pipe, limits, metrics
        self.executor = ThreadPoolExecutor(1, thread_name_prefix="litevlm-model")
        self.pending = 0  # admitted and not finished; touched only on the event loop
        self.jobs: set[Job] = set()  # the admitted jobs themselves (event loop only)
        self.service_ema_s = 0.0
        self.started = 0  # requests the model thread took (only these had any image decoded)
        self.batching = limits.max_batch > 1 and getattr(pipe, "can_batch", False)
        self.waiting: queue.Queue = queue.Queue()  # batched: admitted jobs the model thread has not taken
        self.decoder = None  # batched: the running batch (`litevlm.batch.BatchDecoder`), made on the first job
        self.closing = threading.Event()
        self.looping = False

    @property
    def batch_live(self) -> int:
        """Answers in the running batch now."""
        decoder = self.decoder
        return decoder.live if decoder is not None else 0

    def close(self) -> None:
        """Stop the model thread's loop (batched) and the executor; queued jobs are cancelled."""
        self.closing.set()
        while True:  # the jobs that never joined the batch: cancelled ("shutdown")
            try:
                job = self.waiting.get_nowait()
            except queue.Empty:
                break
            if job is not None:
                job.done.cancel()
        self.waiting.put(None)
        self.executor.shutdown(wait=False, cancel_futures=True)

    # -- admission (event loop) ---------------------------------------------------------------------
    def retry_after_s(self) -> float:
        per = self.service_ema_s or 0.1  # no answer measured yet: a guess
        return min(self.limits.timeout_s, max(0.05, per * max(1, self.pending)))

    def check_capacity(self) -> None:
        """429 with Retry-After (whole seconds, and OpenAI's retry-after-ms) when the queue is full."""
        if self.pending >= self.limits.max_queue + 1:
            wait = self.retry_after_s()
            raise APIError(
                429,
                f"the server is busy: {self.pending} requests in flight, the queue holds "
                f"{self.limits.max_queue}; retry after {wait:.2f} s",
                code="queue_full",
                headers={"Retry-After": str(math.ceil(wait)), "retry-after-ms": str(int(wait * 1000))},
            )

    def submit(self, req: ChatRequest, arrived: float) -> Job:
        """Admit `req` (or 429) and queue it for the model thread."""
        self.check_capacity()
        loop = asyncio.get_running_loop()
        job = Job(req, arrived, arrived + self.limits.timeout_s, loop)
        self.pending += 1
        self.jobs.add(job)
        if self.batching:
            if not self.looping:
                self.looping = True
                self.executor.submit(self._loop)
            fut = asyncio.wrap_future(job.done, loop=loop)
            self.waiting.put(job)
        else:
            fut = loop.run_in_executor(self.executor, self._run, job)
        fut.add_done_callback(lambda f: self._finished(f, job))
        return job

    def _finished(self, fut, job: Job) -> None:
        self.pending -= 1
        self.jobs.discard(job)
        job.finished = True
        if job.service_s:
            self.service_ema_s = (
                job.service_s if not self.service_ema_s else 0.8 * self.service_ema_s + 0.2 * job.service_s
            )
        if fut.cancelled():  # the executor shut down before the job ran
            job.events.put_nowait(("cancelled", "shutdown"))
        elif fut.exception() is not None:
            job.events.put_nowait(("error", fut.exception()))

    # -- the model thread ---------------------------------------------------------------------------
    def _take(self, job: Job) -> float:
        """The model thread takes a queued job: its wait ends now (-> the time its service starts)."""
        start = time.monotonic()
        job.started, job.queue_s = True, start - job.arrived
        self.started += 1
        return start

    def _answered(self, job: Job, ans: Answer, start: float) -> None:
        """Hand a finished answer to the job's handler, with its service time and metrics."""
        job.service_s = time.monotonic() - start
        self.metrics.queue_wait.observe(job.queue_s)
        self.metrics.observe_answer(ans.timings_ms, ans.input_tokens, len(ans.tokens), getattr(ans, "cache", None))
        job.put("done", ans)

    def _run(self, job: Job) -> None:
        if self._stop(job, "queued"):
            return  # never decoded
        start = self._take(job)
        with self._settings(job.req):
            try:  # the encoded bytes: the pipeline decodes only the views the question needs, on a cache miss
                ans = self._answer(job, job.req.images)
            except LiteVLMError as e:
                raise refusal(e) from None
        if ans is not None:
            self._answered(job, ans, start)

    def _answer(self, job: Job, images: dict) -> Answer | None:
        """The pipeline's stream, each piece of text handed on as it comes; None if the job was dropped on the way."""
        sent = ""
        items = self._items(job.req.question, images)
        try:
            for item in items:
                if isinstance(item, Answer):  # its text is what the deltas sent (all of it, if there were none)
                    piece = item.text[len(sent) :] if item.text.startswith(sent) else ""
                else:
                    piece = item.text
                if piece:
                    if not sent:
                        self.metrics.first_token.observe(time.monotonic() - job.arrived)
                    sent += piece
                    job.put("delta", piece)
                if isinstance(item, Answer):
                    return item
                if self._stop(job, "running"):
                    return None
        finally:
            close = getattr(items, "close", None)
            if close is not None:
                close()  # a pipeline stream stops its work here
        raise RuntimeError("the pipeline's stream ended without an Answer")

    # -- the model thread, batched ----------------------------------------------------------------------
    def _loop(self) -> None:
        """Take queued jobs while the batch has room, step the batch, stream, let go of the finished and dropped
        (`_serve`); jobs still running when the worker closes are cancelled."""
        running: dict[Any, Running] = {}
        try:
            self._serve(running)
        except Exception as e:  # a bug in the loop itself: its answers fail with it, the next request starts anew
            for run in running.values():
                _settle(run.job, e)
            self.decoder, self.looping = None, False
            raise
        finally:
            for run in running.values():  # shut down mid-answer
                run.job.done.cancel()

    def _serve(self, running: dict) -> None:
        while not self.closing.is_set():
            if not running and self.decoder is not None and self.decoder.backend is not self.pipe.backend:
                self.decoder = None  # the pipeline was rebuilt: a batch over its new backend
            while self.decoder is None or not self.decoder.full:
                try:  # with nothing to step, wait for a job; else only take those already waiting
                    job = self.waiting.get(timeout=0.5) if not running else self.waiting.get_nowait()
                except queue.Empty:
                    break
                if job is None:
                    return
                self._join(job, running)
            if not running:
                continue
            decoder = self.decoder
            try:
                stepped = decoder.step()
            except Exception as e:  # a failure of the step itself: every answer in it fails, the batch starts anew
                for run in running.values():
                    _settle(run.job, e)
                running.clear()
                self.decoder = None
                continue
            for seq in stepped:
                self._emit(seq, running)
            for seq, run in list(running.items()):
                if not seq.finished and self._stop(run.job, "running"):
                    decoder.cancel(seq)
                    del running[seq]
                    _settle(run.job)

    def _join(self, job: Job, running: dict) -> None:
        """Prefill a queued job and add it to the running batch (or refuse it, or drop it unseen)."""
        if self._stop(job, "queued"):
            _settle(job)  # never decoded
            return
        start = self._take(job)
        pipe = self.pipe
        try:
            with self._settings(job.req):  # the encoded bytes: only the views the question needs are decoded
                if self.decoder is None:
                    self.decoder = pipe.batch_decoder(self.limits.max_batch)
                started = pipe.start_answer(job.req.question, pipe.frame(job.req.images))
                sampling = pipe.sampling
            seq = self.decoder.admit(started.prefilled, sampling, started.timer)
        except LiteVLMError as e:
            _settle(job, refusal(e))
            return
        except Exception as e:
            _settle(job, e)
            return
        running[seq] = Running(job, started, TextStream(pipe.tokenizer, pipe.tokenizer.eos_id), start)
        self._emit(seq, running)

    def _emit(self, seq, running: dict) -> None:
        """Stream what a sequence made; hand over its Answer when it is finished."""
        run = running.get(seq)
        if run is None:
            return
        job = run.job
        piece = run.text.push(seq.new) if seq.new else ""
        if seq.finished:
            piece += run.text.finish()
        if piece:
            if not run.sent:
                self.metrics.first_token.observe(time.monotonic() - job.arrived)
            run.sent += piece
            job.put("delta", piece)
        if not seq.finished:
            return
        del running[seq]
        self._answered(job, self.pipe.finish_answer(run.started, seq.generation), run.start)
        _settle(job)

    def _stop(self, job: Job, where: str) -> bool:
        reason = job.dropped()
        if reason is None:
            return False
        self.metrics.count_cancelled(reason, where)
        job.put("cancelled", reason)
        return True

    def _items(self, question: str, images: dict) -> Iterator:
        """The pipeline's stream of deltas and its Answer (a pipeline without `stream`: the Answer alone)."""
        stream = getattr(self.pipe, "stream", None)
        if stream is not None:
            return stream(question, images)
        return iter([self.pipe.answer(question, images)])

    @contextmanager
    def _settings(self, req: ChatRequest):
        """Per-request sampling settings, applied and always restored: a request changes nothing another sees."""
        pipe, overrides = self.pipe, {}
        if req.max_tokens is not None:  # above the server's --max-new-tokens it is clamped (the KV cache's size)
            overrides["max_new_tokens"] = min(req.max_tokens, pipe.max_new_tokens)
        if req.temperature is not None:
            overrides["temperature"] = req.temperature
        if req.top_p is not None:
            overrides["top_p"] = req.top_p
        if req.seed is not None:  # a fresh generator: a seeded request neither reads nor moves the shared one
            import torch

            overrides["generator"] = torch.Generator(device=pipe.generator.device).manual_seed(req.seed)
        saved = {name: getattr(pipe, name) for name in overrides}
        try:
            for name, value in overrides.items():
                setattr(pipe, name, value)
            yield
        finally:
            for name, value in saved.items():
                setattr(pipe, name, value)


def _settle(job: Job, error: BaseException | None = None) -> None:
    """The model thread lets a batched job go (its handler has had, or will have, its last event)."""
    if job.done.done():
        return
    if error is None:
        job.done.set_result(None)
    else:
        job.done.set_exception(error)
