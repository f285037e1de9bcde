"""Many answers at once (`litevlm.batch`): batched greedy answers equal batch-1 answers token for token, with rows
of different prompt lengths and accepted lengths, rows that finish early and rows that join late; a cancelled row
frees its caches and leaves the others' answers as they were; the native steps really stack the rows."""

import pytest
import torch

from litevlm import LiteVLMError, Pipeline
from litevlm.batch import BatchDecoder
from litevlm.data.synthetic import make_frame, render_views

QUESTIONS = (
    "What are the important objects in the current scene?",  # every view, a long answer
    "Is there a car behind the ego car?",  # one view, a short one
    "What is the moving status of the ego car?",
    "Is there a pedestrian to the front left of the ego car?",
    "What actions should the ego vehicle take?",
    "Is there a barrier to the back left of the ego car?",
)


@pytest.fixture(scope="module")
def images():
    return render_views(make_frame(3, 1), size=(320, 180))


@pytest.fixture(scope="module")
def lite():
    """drive-tiny with every LiteVLM module: native steps, speculative greedy chains, pruned prompts."""
    return Pipeline.from_pretrained("drive-tiny", select_views=True, select_tokens=True, speculative=True)


@pytest.fixture(scope="module")
def alone(lite, images):
    frame = lite.frame(images)
    return [frame.answer(q) for q in QUESTIONS]


def test_batched_speculative_answers_equal_batch_one_with_late_joins(lite, images, alone):
    assert lite.backend.name == "native" and lite.drafting
    lengths = {a.input_tokens for a in alone}
    assert len(lengths) > 2  # the rows' prompts differ in length (views and kept tokens)
    assert len({len(a.tokens) for a in alone}) > 2  # and so do their answers: some finish long before others
    frame = lite.frame(images)
    got = frame.answer_all(list(QUESTIONS), max_batch=3)  # three join as others finish
    assert [a.tokens for a in got] == [a.tokens for a in alone]
    assert [a.text for a in got] == [a.text for a in alone]
    accepted = {n for a in got for n in a.accept_lengths}
    assert len(accepted) > 2  # rows accepted different runs in the same cycles


def test_the_native_steps_stack_the_rows_of_every_sequence(lite, images, alone, monkeypatch):
    seen = []
    real = lite.backend.batch_verify_chain

    def spy(tokens, counts, starts, roots, caches):
        seen.append(counts.numel())
        assert len(caches) == counts.numel()  # each sequence on its own caches
        return real(tokens, counts, starts, roots, caches)

    monkeypatch.setattr(lite.backend, "batch_verify_chain", spy)
    got = lite.frame(images).answer_all(list(QUESTIONS))
    assert [a.tokens for a in got] == [a.tokens for a in alone]
    assert max(seen) > 1  # verifications of several sequences in one call


def test_plain_decoding_batched_equals_batch_one(base, images):
    assert base.backend.name == "native" and not base.drafting
    frame = base.frame(images)
    want = [frame.answer(q).tokens for q in QUESTIONS]
    calls = []
    real = base.backend.batch_decode
    base.backend.batch_decode = lambda tokens, *rest: calls.append(tokens.numel()) or real(tokens, *rest)
    try:
        got = [a.tokens for a in frame.answer_all(list(QUESTIONS), max_batch=4)]
    finally:
        del base.backend.batch_decode
    assert got == want
    assert max(calls) == 4


def test_the_modules_backend_batches_the_same_answers(images):
    pipe = Pipeline.from_pretrained("drive-tiny", backend="modules", select_views=True, speculative=True)
    frame = pipe.frame(images)
    want = [frame.answer(q).tokens for q in QUESTIONS[:4]]
    assert [a.tokens for a in frame.answer_all(list(QUESTIONS[:4]))] == want


@pytest.fixture(scope="module")
def base():
    """drive-tiny's baseline: plain decoding on the native steps, one token a step."""
    return Pipeline.from_pretrained("drive-tiny", max_new_tokens=24)


def test_a_cancelled_row_frees_its_caches_and_the_others_answer_as_alone(base, images):
    frame = base.frame(images)
    order = (QUESTIONS[0], QUESTIONS[4], QUESTIONS[1], QUESTIONS[3])  # long, long, short, short
    want = [frame.answer(q).tokens for q in order]
    decoder = base.batch_decoder(max_batch=4)
    seqs = [decoder.admit(base.start_answer(q, frame).prefilled, base.sampling) for q in order[:3]]
    decoder.step()
    assert decoder.live == 3  # all mid-flight
    free = len(decoder._free)
    decoder.cancel(seqs[0])
    assert len(decoder._free) == free + 1 and decoder.live == 2 and seqs[0].caches is None
    decoder.step()
    late = decoder.admit(base.start_answer(order[3], frame).prefilled, base.sampling)  # joins two steps in
    decoder.run()
    assert seqs[1].generation.tokens == want[1] and len(want[1]) == 24
    assert seqs[2].generation.tokens == want[2]
    assert late.generation.tokens == want[3]


def test_sampled_rows_draw_what_they_draw_alone(images):
    pipe = Pipeline.from_pretrained("drive-tiny", max_new_tokens=12, temperature=1.0)
    frame = pipe.frame(images)

    def sampling(seed):
        return pipe.sampling.__class__(12, pipe.stop_id, 1.0, 1.0, torch.Generator().manual_seed(seed))

    want = []
    for i, q in enumerate(QUESTIONS[:3]):
        decoder = pipe.batch_decoder(1)
        seq = decoder.admit(pipe.start_answer(q, frame).prefilled, sampling(i))
        decoder.run()
        want.append(seq.generation.tokens)
    decoder = pipe.batch_decoder(3)
    seqs = [decoder.admit(pipe.start_answer(q, frame).prefilled, sampling(i)) for i, q in enumerate(QUESTIONS[:3])]
    decoder.run()
    assert [s.generation.tokens for s in seqs] == want
    assert len({tuple(w) for w in want}) == 3


def test_a_full_batch_and_a_graph_backend_are_refused(lite, images):
    frame = lite.frame(images)
    decoder = lite.batch_decoder(max_batch=1)
    decoder.admit(lite.start_answer(QUESTIONS[0], frame).prefilled, lite.sampling)  # a long answer: still in flight
    with pytest.raises(LiteVLMError, match="the batch is full"):
        decoder.admit(lite.start_answer(QUESTIONS[2], frame).prefilled, lite.sampling)
    decoder.run()
    with pytest.raises(LiteVLMError, match="max_batch must be at least 1"):
        BatchDecoder(lite.backend, drafting=True, max_batch=0)

    class Graphs:
        name, graphs = "cuda-twin", object()

    with pytest.raises(LiteVLMError, match="modules or native backend"):
        BatchDecoder(Graphs(), drafting=False)


def test_answer_all_checks_every_question_before_answering(lite, images):
    frame = lite.frame({k: v for k, v in images.items() if k != "CAM_BACK"})
    with pytest.raises(LiteVLMError, match="CAM_BACK"):
        frame.answer_all([QUESTIONS[3], QUESTIONS[1]])
    assert frame.encoded == 0  # nothing was read or encoded


def test_the_server_batches_only_where_the_backend_can(lite, monkeypatch):
    """A CUDA backend's graphs live on the model's own caches: its server answers one request at a time rather than
    failing every request on a batch it cannot make."""
    from types import SimpleNamespace

    from litevlm.serve.limits import Limits
    from litevlm.serve.metrics import Metrics
    from litevlm.serve.worker import Worker

    def batching(**limits) -> bool:
        worker = Worker(lite, Limits(**limits), Metrics(lambda: 0, 4))
        worker.close()
        return worker.batching

    assert lite.can_batch and batching() and not batching(max_batch=1)
    monkeypatch.setattr(lite, "backend", SimpleNamespace(name="cuda-twin"))
    assert not lite.can_batch and not batching()


def test_answer_many_over_several_frames_gives_each_question_its_own_answer(lite, images, alone):
    """Questions about two frames interleaved, three decoding at a time: each answer (by index) is the one its
    frame gives alone, every index once, and the decoder's counters saw batching."""
    other_images = render_views(make_frame(3, 2), size=(320, 180))
    other = lite.frame(other_images)
    other_alone = [other.answer(q) for q in QUESTIONS[:3]]
    a, b = lite.frame(images), lite.frame(other_images)
    work = [(q, f) for pair in zip(QUESTIONS, (*QUESTIONS[:3], None, None, None)) for q, f in zip(pair, (a, b)) if q]
    want = []
    for pair in zip(alone, (*other_alone, None, None, None)):
        want += [x.tokens for x in pair if x is not None]
    decoder = lite.batch_decoder(3)
    got = dict(lite.answer_many(work, max_batch=3, decoder=decoder))
    assert sorted(got) == list(range(len(work)))
    assert [got[i].tokens for i in range(len(work))] == want
    assert decoder.occupancy > 1.5 and decoder.decoded > 0 and decoder.seconds > 0


def test_eval_with_a_batch_gives_the_records_batch_one_gives(tiny_drivelm):
    from litevlm.eval.run import evaluate

    pipe = Pipeline.from_pretrained("drive-tiny", max_new_tokens=12, speculative=True)
    one = evaluate(pipe, tiny_drivelm, limit=10, progress=False, score=False)
    many = evaluate(pipe, tiny_drivelm, limit=10, progress=False, score=False, batch=4)
    assert [r["answer"] for r in many["records"]] == [r["answer"] for r in one["records"]]
    assert [r["id"] for r in many["records"]] == [r["id"] for r in one["records"]]
    assert many["closed_accuracy"] == one["closed_accuracy"]


def test_eval_batch_is_refused_where_the_backend_cannot_batch(tiny_drivelm):
    from litevlm.eval.run import evaluate

    pipe = Pipeline.from_pretrained("drive-tiny", backend="cuda-twin")
    with pytest.raises(LiteVLMError, match="batched decoding runs on the modules or native backend"):
        evaluate(pipe, tiny_drivelm, limit=2, progress=False, score=False, batch=4)


def test_bench_batch_mode_compares_batch_one_and_b_on_the_same_questions(capsys):
    from litevlm.cli import main

    code = main(["bench", "--model", "drive-tiny", "--batch", "3", "--n", "6", "--warmup", "1", "--no-score",
                 "--max-new-tokens", "12", "--json"])  # fmt: skip
    assert code == 0
    import json

    result = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert result["mode"] == "batch" and result["batch"] == 3 and result["questions"] == 6
    assert [r["config"] for r in result["batch_rows"]] == ["baseline", "litevlm"]
    for r in result["batch_rows"]:
        assert r["identical_to_batch_1"] == "6/6"
        assert r["batch_1"]["mean_in_flight"] == 1.0 and r["batch_3"]["mean_in_flight"] > 1.0
        assert r["batch_1"]["decode_tokens"] == r["batch_3"]["decode_tokens"] > 0
        ratio = r["batch_3"]["decode_tokens_per_s"] / r["batch_1"]["decode_tokens_per_s"]
        assert r["decode_tokens_per_s_ratio"] == pytest.approx(ratio, rel=0.01)


@pytest.mark.parametrize("flag", [["--questions-per-frame", "3"], ["--shape", "tiny-test"]])
def test_bench_batch_refuses_what_it_does_not_measure(flag, capsys):
    from litevlm.cli import main

    assert main(["bench", "--model", "drive-tiny", "--batch", "2", "--no-score", *flag]) == 2
    assert f"drop {flag[0]}" in capsys.readouterr().err
