"""The execution backends (`litevlm.model.backend`): chosen once, and the CUDA backend's mechanisms tested on the CPU
through its twin (graph capture without the CUDA calls: the warm-up with its side effects, the static buffers, replay
on them; the static steps compiled by inductor). The GPU itself is exercised by the `gpu`-marked tests at the end."""

import functools
import os

import pytest
import torch
from test_spec import EOS, assert_greedy_up_to_a_near_tie, assert_reordered_fp32, prompt, random_draft, tiny_vlm

from litevlm.errors import LiteVLMError
from litevlm.model.backend import (
    CudaBackend,
    ModulesBackend,
    Sampling,
    _decode_static,
    choose_backend,
    round_up,
)
from litevlm.model.generate import generate
from litevlm.spec import speculative_generate
from litevlm.spec.tree import Tree, TreeConfig, ancestor_mask

LIVE = 96  # live cache slots of the tiny models here; the twin's buckets below split them
BUCKETS = dict(kv_buckets=(32, 64), prefill_buckets=(16, 32))


def cached(model, live: int = LIVE, scratch: int = 8):
    model.language_model.setup_cache(1, live, scratch=scratch)
    return model


def live_cache(model, n: int = LIVE) -> list[torch.Tensor]:
    return [
        t[:, :, :n].clone()
        for layer in model.language_model.layers
        for t in (layer.self_attn.kv_cache.k, layer.self_attn.kv_cache.v)
    ]


def test_a_capture_leaves_the_live_cache_untouched():
    """Capturing the decode and verification graphs after a prompt is in the cache changes none of its slots: the
    warm-ups and the capture write only scratch slots past the live ones. The procedure this replaces warmed the
    step up at live slot 0, and the same check sees that."""
    model = cached(tiny_vlm())
    embeds, pos = prompt(model, seed=1)
    with torch.no_grad():
        ModulesBackend(model).prefill(embeds, pos)
    before = live_cache(model)
    CudaBackend(model, tree_nodes=8, twin=True, **BUCKETS)  # captures every bucket's decode and verification
    for a, b in zip(before, live_cache(model)):
        assert torch.equal(a, b)
    zero = torch.zeros(1, 1, dtype=torch.long)
    with torch.no_grad():  # a warm-up at slot 0, as graphs captured after a prefill used to be
        _decode_static(model, zero, zero, torch.zeros(1, dtype=torch.long), 32)
    assert not all(torch.equal(a, b) for a, b in zip(before, live_cache(model)))


@pytest.mark.parametrize("draft", [False, True])
def test_the_first_answer_after_a_capture_equals_the_modules(draft):
    """A prompt prefilled, then the graphs captured, then decoding: the tokens of the modules, plain and
    speculative (a fixed-size tree, so every verification replays its graph)."""
    model = cached(tiny_vlm(vocab=24))
    head = random_draft(model) if draft else None
    embeds, pos = prompt(model, seed=3)
    tree = TreeConfig(top_k=2, depth=3, total_tokens=6)
    ref = ModulesBackend(model, head)
    with torch.no_grad():
        if draft:
            want = speculative_generate(ref, head, embeds, pos, 40, None, tree=tree).tokens
        else:
            want = generate(ref, embeds, pos, 40, None).tokens
    twin = CudaBackend(model, head, tree_nodes=tree.total_tokens if draft else 0, twin=True, **BUCKETS)
    with torch.no_grad():
        if draft:
            got = speculative_generate(twin, head, embeds, pos, 40, None, tree=tree)
            assert got.tokens == want
            assert twin.stats["eager_steps"] == 0 and twin.stats["graph_replays"] == len(got.accept_lengths)
        else:
            assert generate(twin, embeds, pos, 40, None).tokens == want
            assert twin.stats["graph_replays"] == 39  # one replay a token after the first
    # the answer crossed the 32-slot bucket into the 64-slot one: both graphs ran
    assert embeds.shape[1] < 32 < embeds.shape[1] + 40 <= 64


@pytest.mark.parametrize("compiled", [False, pytest.param(True, marks=pytest.mark.once)])  # once: inductor's time
def test_a_fixed_depth_draft_chain_is_one_replayed_step_a_cycle(compiled):
    """A greedy chain of fixed depth (min_value 0) drafts as one replayed step per cycle (`GraphDraft`): the same
    answer as the modules token for token (lossless, and the same drafts: the same acceptance lengths), the first
    chain of each draft-cache bucket captured before it is replayed: every chain a replay (a capture computes
    nothing; the twin's leaves garbage in its outputs, as a GPU's does). Compiled (inductor, the chain whole, as
    with compile_steps) the same."""
    model = cached(tiny_vlm(vocab=24))
    head = random_draft(model)
    embeds, pos = prompt(model, seed=3)
    tree = TreeConfig.chain(4, min_value=0.0, lookup=0)
    with torch.no_grad():
        want = speculative_generate(ModulesBackend(model, head), head, embeds, pos, 40, None, tree=tree)
        plain = generate(ModulesBackend(model), embeds, pos, 40, None).tokens
    twin = CudaBackend(model, head, tree_nodes=tree.total_tokens, twin=True, compile_steps=compiled, **BUCKETS)
    with torch.no_grad():
        got = speculative_generate(twin, head, embeds, pos, 40, None, tree=tree)
    assert got.tokens == want.tokens == plain and got.accept_lengths == want.accept_lengths
    graphs = twin.drafter.graphs
    assert graphs and all(depth == 4 for depth, *_ in graphs)
    cycles = len(got.accept_lengths)
    # each cycle: one verification replay and one draft replay
    assert twin.stats["graph_replays"] == 2 * cycles and twin.stats["eager_steps"] == 0
    assert twin.kernels["draft"] == "flash"


def test_a_replayed_draft_chain_reads_nothing_back_to_the_host(monkeypatch):
    """The replayed chain's argmaxes stay on the device: a cycle's drafting makes no host sync (the twin runs the
    same static step the GPU replays), and it drafts what the head's own steps draft."""
    from test_spec import HostSyncs

    from litevlm.spec.tree import draft_tree

    model = cached(tiny_vlm(vocab=24))
    head = random_draft(model)
    twin = CudaBackend(model, head, tree_nodes=5, twin=True, **BUCKETS)
    drafter = twin.drafter
    head.prepare(LIVE + 8, 200)
    hidden = torch.randn(1, model.cfg.text.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        drafter.draft_chain(hidden, 30, 20, 5, 0.0, EOS)  # the bucket's capture
        with HostSyncs(monkeypatch) as syncs:
            got = drafter.draft_chain(hidden * 0.5, 41, 27, 5, 0.0, EOS)
        got = got.clone()
        want = draft_tree(head, torch.tensor([0]), hidden * 0.5, 27, 41, TreeConfig.chain(5, 0.0, 0), EOS).tokens[1:]
    assert syncs.count == 0 and torch.equal(got, want)


def test_a_chain_cut_by_its_probability_drafts_through_the_head():
    """min_value > 0 reads the chain's value on the host: no graph, the head's own steps, the same answer."""
    model = cached(tiny_vlm(vocab=24))
    head = random_draft(model)
    embeds, pos = prompt(model, seed=5)
    tree = TreeConfig.chain(4, min_value=0.2, lookup=0)
    with torch.no_grad():
        want = speculative_generate(ModulesBackend(model, head), head, embeds, pos, 30, None, tree=tree)
    twin = CudaBackend(model, head, tree_nodes=tree.total_tokens, twin=True, **BUCKETS)
    with torch.no_grad():
        got = speculative_generate(twin, head, embeds, pos, 30, None, tree=tree)
    assert got.tokens == want.tokens and got.accept_lengths == want.accept_lengths and not twin.drafter.graphs


def test_the_static_steps_equal_the_modules_in_every_bucket():
    """Decode and verification as shape-static steps (attention over a bucket of slots under a mask) give the
    modules' logits, hidden states and K/V, in the first bucket, the next one and the whole cache: after a prompt of
    n tokens, the decode step at slot n, then a tree at slots n+1.. ."""
    model = cached(tiny_vlm())
    twin = CudaBackend(model, tree_nodes=5, twin=True, **BUCKETS)
    ref = ModulesBackend(model)
    parents = torch.tensor([-1, 0, 0, 1, 2])
    tree = Tree(torch.tensor([3, 5, 7, 9, 11]), parents, torch.tensor([0, 1, 1, 2, 2]), ancestor_mask(parents, 2))
    for n in (12, 40, 88):  # buckets 32, 64 and the live cache (96)
        embeds, pos = prompt(model, seed=2, n=n)
        outs = []
        for backend in (ref, twin):
            with torch.no_grad():
                for layer in model.language_model.layers:  # each run from a clean cache
                    layer.self_attn.kv_cache.k.zero_()
                    layer.self_attn.kv_cache.v.zero_()
                backend.prefill(embeds, pos)
                step = backend.decode(torch.tensor([[7]]), n + 3, n)
                tr = backend.verify(tree.tokens, tree.depth, tree.mask, n + 1, n + 4)
            outs.append([t.clone() for t in (*step, *tr)] + live_cache(model, n + 6))
        # the same layers over another number of cache slots (masked ones add exact zeros): fp32 sums of up to 96
        # terms reordered (`assert_reordered_fp32`), far below the O(1) change a wrong mask, slot or position makes.
        for a, b in zip(*outs):
            assert_reordered_fp32(a, b, n=LIVE)


def test_a_replay_rewrites_the_graphs_static_outputs():
    """As on a GPU, every replay returns the same output tensors, rewritten: a result kept across steps must be
    copied (the twin keeps that contract so the CPU catches code that forgets it)."""
    model = cached(tiny_vlm())
    twin = CudaBackend(model, twin=True, **BUCKETS)
    with torch.no_grad():
        a, _ = twin.decode(torch.tensor([[5]]), 0, 0)
        first = a.clone()
        b, _ = twin.decode(torch.tensor([[9]]), 1, 1)
    assert a is b and not torch.equal(first, b)


def test_the_compiled_static_steps_equal_the_eager_ones():
    """The CUDA backend's steps compiled by inductor (on the CPU here): the prefill bucket, the decode step and a
    tree verification give the eager steps' tokens and logits."""
    model = cached(tiny_vlm(vocab=24), live=64)
    head = random_draft(model)
    embeds, pos = prompt(model, seed=4)
    tree = TreeConfig(top_k=2, depth=2, total_tokens=4)
    with torch.no_grad():
        want = speculative_generate(ModulesBackend(model, head), head, embeds, pos, 24, None, tree=tree).tokens
        plain = generate(ModulesBackend(model), embeds, pos, 24, None).tokens
    compiled = CudaBackend(
        model, head, tree.total_tokens, twin=True, compile=True, compile_steps=True, kv_buckets=(), prefill_buckets=()
    )
    with torch.no_grad():
        assert speculative_generate(compiled, head, embeds, pos, 24, None, tree=tree).tokens == want
        assert generate(compiled, embeds, pos, 24, None).tokens == plain
    assert compiled.setup_ms > 0 and (64, 0, None) in compiled._prefill_fns


def test_a_compiled_step_compiles_one_layer_that_every_layer_reuses():
    """Regional compilation: a compiled decode step and a compiled prefill bucket are one graph each of one layer's
    operations, however many decoder layers the model has: at 1 and at 4 layers the same graph size (a whole-step
    compile would grow with the layers) and one graph a step (a recompile per layer would make one a layer); the
    answers are the modules'; and `layer_step` runs every layer, in order."""
    from torch._dynamo.utils import counters

    sizes = {}
    for layers in (1, 4):
        model = cached(tiny_vlm(vocab=24, layers=layers), live=64)
        embeds, pos = prompt(model, seed=4)
        with torch.no_grad():
            want = generate(ModulesBackend(model), embeds, pos, 8, None).tokens
        torch._dynamo.reset()
        graphs, ops = counters["stats"]["unique_graphs"], counters["stats"]["calls_captured"]
        compiled = CudaBackend(model, twin=True, compile=True, compile_steps=True, kv_buckets=(), prefill_buckets=())
        assert counters["stats"]["unique_graphs"] - graphs == 1  # the decode step's, captured at setup
        sizes[layers] = counters["stats"]["calls_captured"] - ops
        with torch.no_grad():
            assert generate(compiled, embeds, pos, 8, None).tokens == want
        assert counters["stats"]["unique_graphs"] - graphs == 2  # and the prompt bucket's
    assert sizes[1] == sizes[4] > 0
    calls = []
    lm = model.language_model

    def counted(layer, *args):
        calls.append(layer)
        return layer(*args)

    with torch.no_grad():
        hidden = lm(embeds, pos, slots=torch.arange(embeds.shape[1]), kv_len=embeds.shape[1], layer_step=counted)
    assert calls == list(lm.layers) and hidden.shape == embeds.shape


@pytest.mark.once  # its time is inductor's compiles
@pytest.mark.parametrize("name", ["litevlm", "fastv"])
def test_the_compiled_steps_answer_like_the_modules_with_openings_a_cut_and_a_draft(name, scene):
    """Every step the CUDA backend runs, compiled by inductor (here on the CPU, fp32): LiteVLM's pruned prefill with
    its answer openings (the layers before the TokenSelector's cut, those after under the trie mask), FastV's three
    layer ranges, decode and verification. One KV width and one prompt bucket keep the compiles few."""
    from litevlm.pipeline import Pipeline
    from litevlm.presets import LITEVLM

    images, questions = scene
    opts = {**LITEVLM, "select_tokens": 0.5} if name == "litevlm" else {"fastv_k": 2, "fastv_r": 0.5}
    opts["max_new_tokens"] = 12
    ref = Pipeline.from_pretrained("drive-tiny", backend="modules", **opts)
    pipe = Pipeline.from_pretrained("drive-tiny", backend="cuda-twin", warmup=False, **opts)
    nodes = pipe.tree.total_tokens if pipe.drafting else 0
    pipe.backend = CudaBackend(
        pipe.model, pipe.draft, nodes, twin=True, compile=True, compile_steps=True, kv_buckets=(), prefill_buckets=()
    )
    got = [pipe.answer(q, images) for q in questions[:2]]
    want = [ref.answer(q, images) for q in questions[:2]]
    assert [a.tokens for a in got] == [a.tokens for a in want]
    assert [a.opened_tokens for a in got] == [a.opened_tokens for a in want]
    ranges = {key[1:3] for key in pipe.backend._prefill_fns}
    assert ranges >= ({(0, 1), (1, None)} if name == "litevlm" else {(0, 1), (1, 2), (2, None)})
    if name == "litevlm":
        assert any(key[-1] == "openings" for key in pipe.backend._prefill_fns) and any(a.opened_tokens for a in got)
    assert pipe.backend.stats["eager_prompts"] == 0 and pipe.backend.stats["graph_replays"] > 0


def test_choosing_a_backend():
    model = cached(tiny_vlm())
    with pytest.raises(LiteVLMError, match="unknown backend"):
        choose_backend("fast", model)
    with pytest.raises(LiteVLMError, match="CUDA device"):
        choose_backend("cuda", model)
    assert choose_backend("modules", model).name == "modules"
    assert choose_backend("cuda-twin", model).name == "cuda-twin"
    assert choose_backend("auto", model).name in ("native", "modules")
    model.language_model.setup_cache(1, LIVE)  # no scratch slots: a capture would write live ones
    with pytest.raises(LiteVLMError, match="scratch"):
        CudaBackend(model, twin=True)
    assert round_up(1) == 128 and round_up(128) == 128 and round_up(129) == 256


def test_the_near_tie_check_refuses_a_clear_disagreement():
    """The bf16 GPU tests' check passes equal answers, and refuses answers that part where the modules' choice leads
    clearly (it can fail)."""
    model = cached(tiny_vlm(vocab=24))
    embeds, pos = prompt(model, seed=3)
    with torch.no_grad():
        want = generate(ModulesBackend(model), embeds, pos, 12, None).tokens
    assert_greedy_up_to_a_near_tie(model, embeds, pos, list(want), want, margin=0.05)
    bad = list(want)
    bad[5] = (bad[5] + 1) % 24
    with pytest.raises(AssertionError, match="leads by"):
        assert_greedy_up_to_a_near_tie(model, embeds, pos, bad, want, margin=1e-6)
    assert_greedy_up_to_a_near_tie(model, embeds, pos, bad, want, margin=1e9)  # any gap is a tie at this margin
    with pytest.raises(AssertionError, match="leads by"):  # a margin relative to the row's largest logit
        assert_greedy_up_to_a_near_tie(model, embeds, pos, bad, want, margin=1e-6, relative=True)
    assert_greedy_up_to_a_near_tie(model, embeds, pos, bad, want, margin=2.0, relative=True)  # > any gap of the row


def test_litevlm_cuda_compile_0_keeps_the_prefill_eager(monkeypatch):
    from litevlm.model.backend import compiles

    assert compiles()
    monkeypatch.setenv("LITEVLM_CUDA_COMPILE", "0")
    assert not compiles()


def test_a_step_whose_compile_fails_is_captured_uncompiled_with_a_warning(monkeypatch, tmp_path):
    """A compiler that fails on this machine costs the compiled steps, never the backend: each step so hit is
    named in a warning and in `compile_failures`, and answers as the eager steps do. Compiled steps keep inductor's
    cache on disk (LITEVLM_COMPILE_CACHE)."""
    import litevlm.model.backend as backend

    monkeypatch.setenv("LITEVLM_COMPILE_CACHE", str(tmp_path / "inductor"))
    monkeypatch.delenv("TORCHINDUCTOR_CACHE_DIR", raising=False)

    def broken(*a, **k):
        raise RuntimeError("no compiler here")

    model = cached(tiny_vlm(vocab=24), live=64)
    embeds, pos = prompt(model, seed=4)
    with torch.no_grad():
        plain = generate(ModulesBackend(model), embeds, pos, 12, None).tokens
    monkeypatch.setattr(backend.CudaBackend, "_compiled", lambda self, fn, tag, compile_it, regional=True: (
        functools.partial(lambda *a, **k: broken(), fn) if compile_it else fn))  # fmt: skip
    with pytest.warns(UserWarning, match="compiling the decode_64 step failed"):
        b = CudaBackend(model, None, twin=True, compile=False, compile_steps=True, kv_buckets=(), prefill_buckets=())
    assert b.compile_failures == ["decode_64: RuntimeError"]
    with torch.no_grad():
        assert generate(b, embeds, pos, 12, None).tokens == plain
    assert (tmp_path / "inductor").is_dir() and os.environ["TORCHINDUCTOR_CACHE_DIR"] == str(tmp_path / "inductor")


def test_the_steps_compile_by_default_on_a_gpu_only():
    """compile_steps left to its default: on for a GPU's cuda backend (unless LITEVLM_CUDA_COMPILE=0), off for the
    twin and every CPU backend."""
    from litevlm import Pipeline

    twin = Pipeline.from_pretrained("drive-tiny", backend="cuda-twin", warmup=False)
    assert twin.compile_steps is None and twin.backend.compile_steps is False
    assert Pipeline.from_pretrained("drive-tiny", warmup=False).backend.name == "native"
    if torch.cuda.is_available():
        gpu = Pipeline.from_pretrained("drive-tiny", device="cuda", warmup=False)
        assert gpu.backend.name == "cuda" and gpu.backend.compile_steps is True


def test_sampling_is_one_frozen_value():
    s = Sampling(12, EOS, 0.7, 0.9, torch.Generator().manual_seed(0))
    with pytest.raises(AttributeError):
        s.temperature = 0.0
    assert not s.greedy and Sampling().greedy
    assert Sampling(temperature=0.0).sample(torch.tensor([[0.1, 3.0, 0.2]])).tolist() == [1]


# ------------------------------------------------------------------------------------------------
# Through the pipeline: drive-tiny on the twin against the modules
# ------------------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def scene():
    from litevlm.data.synthetic import make_frame, render_views

    frame = make_frame(11, 2)
    return render_views(frame, size=(400, 225)), [qa.question for qa in frame.qas[:6]]


CONFIGS = {
    "plain": {},
    "speculative, fixed tree": {"speculative": True, "tree_min_value": 0.0, "openings": False},
    "speculative, openings": {"speculative": True},
    "token selector": {"select_views": True, "select_tokens": 0.5, "speculative": True},
    "fastv": {"fastv_k": 2, "fastv_r": 0.5},
}


@pytest.mark.parametrize("name", list(CONFIGS))
def test_a_graphed_pipelines_first_and_later_answers_equal_the_modules(name, scene):
    from litevlm.pipeline import Pipeline

    images, questions = scene
    opts = dict(CONFIGS[name], max_new_tokens=24)
    ref = Pipeline.from_pretrained("drive-tiny", backend="modules", **opts)
    twin = Pipeline.from_pretrained("drive-tiny", backend="cuda-twin", warmup=False, **opts)  # no answer before
    assert twin.backend.name == "cuda-twin" and twin.max_len % 128 == 0
    answers = [twin.answer(q, images) for q in questions]
    expected = [ref.answer(q, images) for q in questions]
    assert [a.tokens for a in answers] == [e.tokens for e in expected]
    assert [a.opened_tokens for a in answers] == [e.opened_tokens for e in expected]
    assert twin.backend.stats["graph_replays"] > 0
    if name == "speculative, fixed tree":
        assert twin.backend.stats["eager_steps"] == 0  # every verification replayed the captured tree
    if name == "speculative, openings":
        assert any(a.opened_tokens for a in answers)  # the openings were verified with graphs on
        # chains cut by their probability, padded to the captured size: no verification ran through the modules
        assert twin.backend.stats["eager_steps"] == 0


@pytest.mark.parametrize("name", ["token selector", "fastv"])
def test_a_pruned_prefill_runs_its_parts_as_bucketed_steps(name, scene):
    """LiteVLM's and FastV's prefill reach the backend's prompt steps too: the layers before the cut on the whole
    prompt and those after on the kept tokens, each a step of its length bucket and layer range, answering as the
    modules do."""
    from litevlm.pipeline import Pipeline

    images, questions = scene
    opts = dict(CONFIGS[name], max_new_tokens=12, openings=False)
    ref = Pipeline.from_pretrained("drive-tiny", backend="modules", **opts)
    twin = Pipeline.from_pretrained("drive-tiny", backend="cuda-twin", warmup=False, **opts)
    assert [twin.answer(q, images).tokens for q in questions[:3]] == [
        ref.answer(q, images).tokens for q in questions[:3]
    ]
    ranges = {(start, end) for _, start, end in twin.backend._prefill_fns}
    cut = 2 if name == "fastv" else 1
    assert (cut, None) in ranges  # the kept tokens through the layers after the cut
    assert name != "fastv" or (0, cut - 1) in ranges  # FastV: the layers before the one whose attention ranks
    assert twin.backend.stats["eager_prompts"] == 0 and twin.backend.kernels["prefill"] == "flash"


@pytest.mark.parametrize("name", ["speculative, openings", "token selector"])
def test_a_prompt_with_answer_openings_runs_as_a_bucketed_step(name, scene):
    """A prompt verified with its answer openings (whole, or the kept tokens after the TokenSelector's cut) is a
    compiled step of its bucket too, under a kernel that takes its trie mask ("openings"): none goes through the
    modules, and the answers and the tokens the openings gave equal the modules'."""
    from litevlm.pipeline import Pipeline

    images, questions = scene
    opts = dict(CONFIGS[name], max_new_tokens=12, openings=True)
    ref = Pipeline.from_pretrained("drive-tiny", backend="modules", **opts)
    twin = Pipeline.from_pretrained("drive-tiny", backend="cuda-twin", warmup=False, **opts)
    got = [twin.answer(q, images) for q in questions[:4]]
    want = [ref.answer(q, images) for q in questions[:4]]
    assert [a.tokens for a in got] == [a.tokens for a in want]
    assert [a.opened_tokens for a in got] == [a.opened_tokens for a in want] and any(a.opened_tokens for a in got)
    assert any(key[-1] == "openings" for key in twin.backend._prefill_fns)
    assert twin.backend.stats["eager_prompts"] == 0 and twin.backend.kernels["openings"] == "flash"


def test_auto_makes_the_cache_its_chosen_backend_needs(monkeypatch, scene):
    """ "auto" is settled before the cache is made: where it picks the CUDA backend (on a GPU; here its twin, patched
    in for the device check), the cache has the scratch slots its captures write, and the answers are the modules'."""
    import litevlm.pipeline as pipeline_module
    from litevlm.pipeline import Pipeline

    images, questions = scene
    opts = {"speculative": True, "max_new_tokens": 12}
    monkeypatch.setattr(pipeline_module, "auto_kind", lambda model, draft=None: "cuda-twin")
    auto = Pipeline.from_pretrained("drive-tiny", warmup=False, **opts)
    assert auto.backend_kind == "auto" and auto.backend.name == "cuda-twin"
    assert auto.backend.scratch >= auto.tree.total_tokens
    ref = Pipeline.from_pretrained("drive-tiny", backend="modules", **opts)
    assert auto.answer(questions[0], images).tokens == ref.answer(questions[0], images).tokens


@pytest.mark.parametrize("compile_steps", [False, True])
def test_compile_steps_reaches_the_captured_steps_from_the_pipeline_and_the_command_line(
    monkeypatch, compile_steps, scene
):
    """`Pipeline(compile_steps=)` and `--compile-steps` (ask, eval, serve, bench) decide whether the CUDA backend's
    decode, verification and draft-chain steps are compiled before capture (recorded here instead of compiled)."""
    from litevlm.cli import build_parser
    from litevlm.options import pipeline_options
    from litevlm.pipeline import Pipeline

    made = []

    def record(self, fn, tag, compile_it, regional=True):
        made.append((tag.split("_")[0], compile_it))
        return fn

    monkeypatch.setattr(CudaBackend, "_compiled", record)
    argv = ["ask", "--images", "x", "--question", "q", "--speculative", "--tree-top-k", "1", "--tree-depth", "4"]
    argv += ["--tree-total", "5", "--tree-min-value", "0"]  # a fixed-depth chain: the replayed draft step
    flag = "--compile-steps" if compile_steps else "--no-compile-steps"
    assert pipeline_options(build_parser().parse_args(argv))["compile_steps"] is None  # the device decides
    opts = pipeline_options(build_parser().parse_args([*argv, flag]))
    assert opts["compile_steps"] is compile_steps
    assert build_parser().parse_args(["bench", flag]).compile_steps is compile_steps
    opts.update(backend="cuda-twin", warmup=False, max_new_tokens=12)
    pipe = Pipeline.from_pretrained("drive-tiny", **{k: v for k, v in opts.items() if v is not None})
    images, questions = scene
    pipe.answer(questions[0], images)  # the draft chain's step is made on its first cycle
    steps = {kind: flag for kind, flag in made if kind in ("decode", "verify", "draft")}
    assert set(steps) == {"decode", "verify", "draft"} and set(steps.values()) == {compile_steps}
    other = Pipeline.from_pretrained("drive-tiny", backend="modules", compile_steps=True, warmup=False)
    assert other.backend.name == "modules"  # no effect off the CUDA backend


def test_a_compile_inside_an_answer_is_setup_not_a_stage(monkeypatch, scene):
    """A prefill step met for the first time inside an answer (a pruned prefill's parts) is compiled there (on a
    GPU, tens of seconds): that time is setup (`setup_ms`), left out of the prefill stage, the total and e2e. Here
    each step's first call moves the clock the timings read on by SLOW seconds, as a compile would take them, without
    waiting: the stages and e2e must come out within the real wall time around the answer, which holds no jump."""
    import time as clock

    from litevlm.pipeline import Pipeline

    SLOW = 3600.0  # an hour a compile: far past any real prefill, and no time at all spent on it
    real = clock.perf_counter
    jumped = [0.0]
    monkeypatch.setattr(clock, "perf_counter", lambda: real() + jumped[0])

    def compiled(self, fn, tag, compile_it, regional=True):
        first = [True]

        def step(*args):
            if first[0]:
                first[0] = False
                jumped[0] += SLOW
            return fn(*args)

        return step

    monkeypatch.setattr(CudaBackend, "_compiled", compiled)
    images, questions = scene
    opts = {"select_views": True, "select_tokens": 0.5, "max_new_tokens": 6}  # the pruned prefill's two parts
    pipe = Pipeline.from_pretrained("drive-tiny", backend="cuda-twin", warmup=False, **opts)
    before, jumps = pipe.setup_ms, jumped[0]
    t0 = real()
    ms = pipe.answer(questions[0], images).timings_ms
    wall = (real() - t0) * 1e3  # the answer's real time, no jump in it
    assert jumped[0] - jumps == 2 * SLOW  # the first calls of both parts' steps, inside the prefill stage
    assert pipe.setup_ms - before >= 2000 * SLOW  # counted as setup
    # neither jump in the prefill, the total or e2e: each within the real time the answer took
    assert ms["prefill"] <= ms["total"] <= ms["e2e"] <= wall
    assert ms["total"] + ms["preprocess"] <= ms["e2e"] + 1e-3


def test_setup_is_reported_apart_from_the_stages():
    from litevlm.pipeline import Pipeline

    pipe = Pipeline.from_pretrained("drive-tiny", speculative=True, max_new_tokens=8)
    assert pipe.setup_ms > 0 and pipe.capture_ms == pipe.setup_ms
    before = pipe.setup_ms
    pipe.rebuild()
    assert pipe.setup_ms > before  # a rebuild is setup too


# ------------------------------------------------------------------------------------------------
# On a GPU
# ------------------------------------------------------------------------------------------------
def _on_cuda(model, dtype=torch.float32, live: int = LIVE, scratch: int = 8):
    model = model.to("cuda", dtype)
    model.language_model.setup_cache(1, live, scratch=scratch)
    return model


def _cuda_case(vocab=24, seed=3, dtype=torch.float32, draft=True):
    """A tiny model, its random draft head and a prompt, all on the GPU in `dtype`."""
    model = tiny_vlm(vocab=vocab)
    head = random_draft(model) if draft else None
    embeds, pos = prompt(model, seed=seed)
    model = _on_cuda(model, dtype)
    if head is not None:
        head.to("cuda", dtype)
    return model, head, embeds.to("cuda", dtype), pos.cuda()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize(
    "dtype,compile_steps", [(torch.float32, False), (torch.bfloat16, False), (torch.bfloat16, True)]
)
def test_cuda_graphs_decode_like_the_modules(dtype, compile_steps):
    """The captured decode and verification replay what the modules compute, after a prompt (the first answer after
    the capture), in fp32 and in bf16 (the fused attention kernels), and compiled in bf16 (each step's compiles, one a
    KV width and step kind, are the session's time: the CPU tests compile in fp32)."""
    model, head, embeds, pos = _cuda_case(dtype=dtype)
    tree = TreeConfig(top_k=2, depth=3, total_tokens=6)
    with torch.no_grad():
        ModulesBackend(model).prefill(embeds, pos)
        buckets = {**BUCKETS, "kv_buckets": ()} if compile_steps else BUCKETS  # one KV width: two compiles
        backend = CudaBackend(model, head, tree.total_tokens, compile_steps=compile_steps, **buckets)
        want = generate(ModulesBackend(model), embeds, pos, 40, None).tokens
        plain = generate(backend, embeds, pos, 40, None).tokens
        spec = speculative_generate(backend, head, embeds, pos, 40, None, tree=tree)
    assert backend.stats["eager_steps"] == 0
    if dtype == torch.float32:
        assert plain == want and spec.tokens == want
    else:  # bf16: another kernel rounds differently; the answers part, if at all, only at a near tie
        # one bf16 step of a logit near 10 is 0.0625, and this model's std-0.5 weights magnify a rounding: a tie is
        # a gap within a tenth of the row's largest logit (a wrong mask or K/V head parts at once, by far more)
        assert_greedy_up_to_a_near_tie(model, embeds, pos, plain, want, margin=0.1, relative=True)
        assert_greedy_up_to_a_near_tie(model, embeds, pos, spec.tokens, want, margin=0.1, relative=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_fp8_layers_inside_graphs_and_the_compiled_prefill():
    """FP8 decoder linears (dynamic per-row scales) captured in the decode graph and compiled in the prefill bucket:
    the same tokens as the same FP8 model run through the modules."""
    from litevlm.quant.fp8 import FP8Recipe, quantize_model

    if torch.cuda.get_device_capability() < (8, 9):
        pytest.skip("this GPU has no FP8 matmuls (compute capability < 8.9)")
    model, _, embeds, pos = _cuda_case(vocab=64, seed=1, dtype=torch.bfloat16, draft=False)
    quantize_model(model, FP8Recipe("fp8-dynamic-per-row"))
    with torch.no_grad():
        want = generate(ModulesBackend(model), embeds, pos, 20, None).tokens
        backend = CudaBackend(model, compile=True, **BUCKETS)
        got = generate(backend, embeds, pos, 20, None).tokens
    # inductor may fuse around the e4m3 casts, so a value can land on the neighbouring FP8 step: a near tie may part
    assert_greedy_up_to_a_near_tie(model, embeds, pos, got, want, margin=0.15, relative=True)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_one_decoder_layer_at_the_2b_shapes_in_bf16():
    """The attention of one InternLM2.5-1.8B-shaped decoder layer (2048 wide, 16 / 8 heads of 128) over a 3214-token
    prompt through its cache, in the fused form (`fused=True`), on each fused kernel offered: bf16 against an fp32
    reference of the same weights. The attention block alone: in the layer's output the residual dominates, so a
    wrong attention would hide there."""
    from test_fused_attention import on_each_offered_kernel

    from litevlm.config import preset
    from litevlm.model.kv_cache import KVCache
    from litevlm.model.layers import rope_cos_sin
    from litevlm.model.lm import DecoderLayer

    cfg = preset("2b").text
    t = 3214
    torch.manual_seed(0)
    layer = DecoderLayer(cfg).cuda().eval()
    cos, sin = rope_cos_sin(torch.arange(t, device="cuda")[None], cfg.head_dim, cfg.rope_theta, torch.float32)
    with torch.no_grad():
        x = layer.input_layernorm(torch.randn(1, t, cfg.hidden_size, device="cuda"))
        ref = layer.self_attn(x, cos, sin)  # no cache: causal over the prompt, fp32
        attn = layer.self_attn.to(torch.bfloat16)
        attn.kv_cache = KVCache(1, cfg.num_kv_heads, t, cfg.head_dim, torch.bfloat16, "cuda")
        slots = torch.arange(t, device="cuda")
        outs = on_each_offered_kernel(lambda: attn(x.bfloat16(), cos.bfloat16(), sin.bfloat16(), slots, None, t, True))
    for kernel, out in outs.items():
        assert ((out - ref).norm() / ref.norm()) < 2e-2, kernel  # bf16 rounding through one block
    assert outs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_sampling_with_a_cuda_generator_on_the_graphs():
    """Sampled speculative decoding with the generator on the GPU: reproducible for a seed, tokens in the
    vocabulary, on the captured graphs."""
    model, head, embeds, pos = _cuda_case(seed=2)
    tree = TreeConfig(top_k=2, depth=3, total_tokens=6)
    backend = CudaBackend(model, head, tree.total_tokens, **BUCKETS)
    runs = []
    for _ in range(2):
        gen = torch.Generator(device="cuda").manual_seed(7)
        with torch.no_grad():
            out = speculative_generate(backend, head, embeds, pos, 30, None, 0.8, 0.9, gen, tree=tree)
        runs.append(out.tokens)
    assert runs[0] == runs[1] and all(0 <= t < 24 for t in runs[0])
