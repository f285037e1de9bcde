"""`Pipeline.stream`: the answer's text and tokens as they are made, equal to `Pipeline.answer`'s."""

import pytest
import torch

from litevlm import LiteVLMError, Pipeline
from litevlm.pipeline import Answer, Delta, TextStream

QUESTIONS = (
    "What are objects to the front of the ego car?",
    "Is there a red car to the front of the ego car?",
    "What is the moving status of <c1,CAM_BACK,800.0,500.0>?",
)


@pytest.fixture(scope="module")
def images():
    from litevlm.data.synthetic import make_frame, render_views

    return render_views(make_frame(1, 0))


def collect(stream):
    items = list(stream)
    *deltas, answer = items
    assert isinstance(answer, Answer) and all(isinstance(d, Delta) for d in deltas)
    return deltas, answer


@pytest.mark.parametrize(
    "options",
    [
        {},
        {"speculative": True},  # drive-tiny's draft head, with its answer openings
        {"speculative": True, "openings": False},
        {"select_tokens": 0.5},
        {"select_tokens": 0.5, "speculative": True},  # an opening verified inside the pruned prefill
        {"fastv_k": 1, "fastv_r": 0.5},
    ],
)
def test_streamed_answers_equal_plain_answers(images, options):
    streaming = Pipeline.from_pretrained("drive-tiny", max_new_tokens=24, **options)
    plain = Pipeline.from_pretrained("drive-tiny", max_new_tokens=24, **options)
    for q in QUESTIONS:
        deltas, answer = collect(streaming.stream(q, images))
        expected = plain.answer(q, images)
        assert "".join(d.text for d in deltas) == answer.text == expected.text
        assert [t for d in deltas for t in d.tokens] == answer.tokens == expected.tokens
        assert answer.views == expected.views and answer.num_visual_tokens == expected.num_visual_tokens
        assert answer.accept_lengths == expected.accept_lengths and answer.opened_tokens == expected.opened_tokens
        assert answer.input_tokens == expected.input_tokens and set(answer.timings_ms) == set(expected.timings_ms)


def test_a_long_answer_streams_before_its_last_decode_step(images, monkeypatch):
    """Events in order: every decode step and every delta the consumer receives. The first delta comes before the
    last decode step runs, so text reaches the consumer while the answer is still being made."""
    events = []
    pipe = Pipeline.from_pretrained("drive-tiny", max_new_tokens=24)
    step = pipe.backend.decode

    def recorded(*args, **kwargs):
        events.append("step")
        return step(*args, **kwargs)

    monkeypatch.setattr(pipe.backend, "decode", recorded)
    for item in pipe.stream(QUESTIONS[0], images):
        if isinstance(item, Delta) and item.text:
            events.append("delta")
    assert events.count("delta") > 1 and events.count("step") > 1
    last_step = len(events) - 1 - events[::-1].index("step")
    assert events.index("delta") < last_step


def test_speculative_cycles_stream_their_runs(images):
    """A speculative answer comes in one delta per emitting pass: the prefill's (with its opening), then one per
    cycle, each carrying that cycle's accepted run."""
    pipe = Pipeline.from_pretrained("drive-tiny", speculative=True, max_new_tokens=24)
    deltas, answer = collect(pipe.stream(QUESTIONS[0], images))
    runs = [len(d.tokens) for d in deltas if d.tokens]
    assert runs == [answer.opened_tokens + 1, *answer.accept_lengths]
    assert len(runs) > 1


@pytest.mark.parametrize("options", [{}, {"speculative": True}, {"select_tokens": 0.5, "speculative": True}])
def test_closing_a_stream_stops_it_and_leaves_the_pipeline_ready(images, options):
    pipe = Pipeline.from_pretrained("drive-tiny", max_new_tokens=24, **options)
    fresh = Pipeline.from_pretrained("drive-tiny", max_new_tokens=24, **options)
    stream = pipe.stream(QUESTIONS[0], images)
    first = next(stream)
    assert isinstance(first, Delta)
    stream.close()
    assert torch.is_grad_enabled()  # the generation's no_grad scope is left
    with pytest.raises(StopIteration):
        next(stream)
    for q in QUESTIONS:
        assert pipe.answer(q, images).tokens == fresh.answer(q, images).tokens


def test_bad_input_fails_when_the_stream_is_asked_for(images):
    pipe = Pipeline.from_pretrained("drive-tiny", max_new_tokens=4)
    with pytest.raises(LiteVLMError, match="empty"):
        pipe.stream("  ", images)
    with pytest.raises(LiteVLMError, match="missing"):
        pipe.stream(QUESTIONS[0], {"CAM_FRONT": images["CAM_FRONT"]})


def test_text_stream_never_splits_a_character_and_strips_like_the_answer(tiny_tokenizer):
    """Multi-byte characters span several byte-level tokens: no piece holds half of one (U+FFFD), leading space is
    dropped, trailing space waits for the text after it, and the pieces join to the stripped decoded text."""
    text = "  naïve café ☃ 漢字  ahead.  "
    ids = tiny_tokenizer.encode(text)
    assert len(ids) > len(text.split())  # the non-ASCII characters take several tokens each
    stream = TextStream(tiny_tokenizer, tiny_tokenizer.eos_id)
    pieces = [stream.push([i]) for i in ids] + [stream.push([tiny_tokenizer.eos_id]), stream.finish()]
    assert "".join(pieces) == tiny_tokenizer.decode(ids).strip()
    assert all("\ufffd" not in p for p in pieces)
    assert not pieces[0].startswith(" ") and sum(1 for p in pieces if p) > 3
