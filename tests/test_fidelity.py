"""litevlm.eval.fidelity: an answer's teacher-forced log-likelihood after a prompt, read in one pass, equals the one
decoding reads token by token, on a whole prompt and on one pruned inside the decoder."""

import pytest
import torch

from litevlm.eval.fidelity import answer_loglik
from litevlm.model.backend import ModulesBackend, Sampling
from litevlm.model.generate import drain, prefill_prompt, stream_decode


@pytest.fixture(scope="module")
def pipe():
    from litevlm.pipeline import Pipeline

    return Pipeline.from_pretrained("drive-tiny")


def step_by_step(backend, embeds, positions, tokens, pruning=None) -> float:
    """The same mean log-probability, one decode step per token."""
    pre = prefill_prompt(backend, embeds, positions, pruning=pruning)
    logp = [torch.log_softmax(pre.logits.float(), -1)[0, tokens[0]]]
    start, root = pre.embeds.shape[1], int(pre.positions[0, -1]) + 1
    for i, tok in enumerate(tokens[:-1]):
        logits, _ = backend.decode(torch.tensor([[tok]]), root + i, start + i)
        logp.append(torch.log_softmax(logits.float(), -1)[0, tokens[i + 1]])
    return float(torch.stack(logp).mean())


@torch.no_grad()
def test_one_pass_equals_token_by_token_whole_and_pruned(pipe):
    from litevlm.data.synthetic import make_frame, render_views
    from litevlm.select.tokens import fastv_pruning

    frame = make_frame(1, 3)
    qa = frame.qas[1]
    p = pipe.prompt(qa.question, render_views(frame))
    modules = ModulesBackend(pipe.model)
    pre = prefill_prompt(pipe.backend, p.embeds, p.positions)
    greedy = drain(stream_decode(pipe.backend, pre, Sampling(24, pipe.stop_id)))
    tokens = greedy.tokens
    assert len(tokens) > 3
    for backend in (pipe.backend, modules):  # the native steps and the modules
        whole = answer_loglik(backend, prefill_prompt(backend, p.embeds, p.positions), tokens)
        assert whole == pytest.approx(step_by_step(modules, p.embeds, p.positions, tokens), abs=1e-4)
        assert whole <= 0
        fastv = fastv_pruning(pipe.model, p.positions, p.view_spans, 2, 0.25)
        pruned = answer_loglik(backend, prefill_prompt(backend, p.embeds, p.positions, pruning=fastv), tokens)
        assert pruned == pytest.approx(step_by_step(modules, p.embeds, p.positions, tokens, fastv), abs=1e-4)
        assert pruned != pytest.approx(whole, abs=1e-6)  # the pruning moved the model
    # one token: the prefill's logits alone
    one = answer_loglik(modules, prefill_prompt(modules, p.embeds, p.positions), tokens[:1])
    assert one == pytest.approx(float(torch.log_softmax(pre.logits.float(), -1)[0, tokens[0]]), abs=1e-5)
    with pytest.raises(ValueError, match="at least one token"):
        answer_loglik(modules, pre, [])
    with pytest.raises(ValueError, match="without one"):
        answer_loglik(modules, pre._replace(logits=None), tokens)
