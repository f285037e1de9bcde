"""The draft head's self-distillation on a user's checkpoint and DriveLM data: the target's own greedy answers through
the pipeline's prompts, the offline cache in safetensors shards (its disk cost printed first, a rerun resuming from
it), the head saved where `Pipeline.from_pretrained` finds it and lossless there, and the answer openings counted
from the target's answers."""

from __future__ import annotations

import json
import re
import shutil
from collections import Counter

import pytest
import torch

from litevlm.data.drivelm import load_images
from litevlm.data.source import load_data, scene_split
from litevlm.errors import LiteVLMError
from litevlm.models import load_model
from litevlm.pipeline import Pipeline
from litevlm.spec.openings import Openings
from litevlm.train import draft as recipe_module
from litevlm.train.draft import DraftRecipe, load_shard, shard_path, target_sequences, train_draft
from litevlm.train.openings import build_openings

# Tiny and quick: every question shown with all six views (so one can be asked again through `Pipeline.answer`),
# short answers, a few training steps.
RECIPE = DraftRecipe(
    max_new_tokens=6, view_subset_prob=0.0, gen_batch=8, minutes=0.1, epochs=2, batch=8, threads=1, draft_vocab=64
)


class CountingTarget:
    """`greedy_batch` wrapped to count the target's generation calls, and what was printed before the first."""

    def __init__(self, monkeypatch, capsys):
        self.calls, self.printed_before, self.capsys = 0, None, capsys
        self.real = recipe_module.greedy_batch
        monkeypatch.setattr(recipe_module, "greedy_batch", self)

    def __call__(self, *args, **kwargs):
        if self.printed_before is None:
            self.printed_before = self.capsys.readouterr().out
        self.calls += 1
        return self.real(*args, **kwargs)


@pytest.fixture(scope="module")
def world(tiny_model_dir, tmp_path_factory):
    """A copy of the tiny model and a DriveLM train-v1_1 JSON of two scenes (4 frames each) with its images."""
    from litevlm.data.synthetic import write_dataset

    root = tmp_path_factory.mktemp("draft-data")
    model = root / "model"
    shutil.copytree(tiny_model_dir, model)
    data = write_dataset(root / "data", frames=8, seed=5, size=(112, 63), progress=False)
    return model, data, load_data(data)


@pytest.fixture(scope="module")
def offline_run(world, tmp_path_factory):
    """`train_draft` offline once; the cache folder and what it printed."""
    model, data, samples = world
    cache = tmp_path_factory.mktemp("cache") / "features"
    with pytest.MonkeyPatch.context() as mp:
        printed = []
        mp.setattr("builtins.print", lambda *a, **k: printed.append(" ".join(map(str, a))))
        head_dir = train_draft(model, None, RECIPE, samples=samples, data=str(data), offline=cache, progress=False)
    return head_dir, cache, printed


def test_the_data_are_the_targets_own_answers_through_its_pipeline(world, offline_run):
    model, data, samples = world
    head_dir, cache, printed = offline_run
    assert head_dir == model / "draft"
    index = json.loads((cache / "index.json").read_text())
    seqs = [s for i in range(index["shards"]) for s in load_shard(shard_path(cache, i))]
    assert len(seqs) == len(samples) == index["questions"] and index["shards"] >= 2
    # Validation holds whole scenes out, by the seeded rule.
    held = scene_split(samples, RECIPE.val_fraction, RECIPE.seed)[1]
    assert held and sorted(s.question for s in seqs if s.held_out) == sorted(s.question for s in held)
    pipe = Pipeline.from_loaded(load_model(model), max_new_tokens=RECIPE.max_new_tokens)
    by_question = {s.question: s for s in samples}
    for seq in seqs[:3] + seqs[-2:]:
        sample = by_question[seq.question]
        assert seq.answer == pipe.answer(sample.question, load_images(sample)).tokens  # the target's greedy answer
        # an embedding and a feature for every token of the windowed prompt and the answer (the last one has none)
        assert seq.embeds.shape[0] == seq.prompt_len + len(seq.answer) == seq.features.shape[0] + 1
    head = json.loads((head_dir / "config.json").read_text())
    assert head["recipe"]["answers"] == "target" and head["recipe"]["data"] == str(data)
    assert head["metrics"]["val_sequences"] == len(held) and head["metrics"]["validation"] == "scenes held out"
    assert "prune_prob" not in index["key"]  # a cache made without pruning keys as one made before the option


def test_the_disk_cost_is_printed_before_generation_and_a_rerun_resumes(world, offline_run, monkeypatch, capsys):
    model, data, samples = world
    _, cache, printed = offline_run
    estimate = next(line for line in printed if "bytes/token" in line)
    index = json.loads((cache / "index.json").read_text())
    per_token = 2 * 32 * 2  # an embedding and a feature of the tiny model's 32 channels, in fp16
    assert index["bytes_per_token"] == per_token and f"x {per_token:,} bytes/token" in estimate
    counter = CountingTarget(monkeypatch, capsys)
    before = {p.name: p.stat().st_mtime_ns for p in cache.glob("shard-*")}
    again = target_sequences(load_model(model), RECIPE, samples, str(data), cache, progress=False)
    assert counter.calls == 0 and "resuming" in capsys.readouterr().out  # every shard read back, none regenerated
    assert {p.name: p.stat().st_mtime_ns for p in cache.glob("shard-*")} == before
    shard_path(cache, 1).unlink()  # as if the first run had stopped before its second shard
    resumed = target_sequences(load_model(model), RECIPE, samples, str(data), cache, progress=False)
    assert "bytes/token" in counter.printed_before  # the estimate comes before the target's first call
    in_shard = len(load_shard(shard_path(cache, 1)))
    assert counter.calls == -(-in_shard // RECIPE.gen_batch)  # only that shard's batches
    for a, b in zip(again, resumed):
        assert a.answer == b.answer and torch.equal(a.features, b.features) and a.held_out == b.held_out


def test_the_online_path_computes_what_the_offline_cache_holds(world, offline_run):
    model, data, samples = world
    _, cache, _ = offline_run
    online = target_sequences(load_model(model), RECIPE, samples, str(data), None, progress=False)
    cached = [s for i in range(len(list(cache.glob("shard-*")))) for s in load_shard(shard_path(cache, i))]
    assert len(online) == len(cached)
    for a, b in zip(online, cached):
        assert (a.question, a.answer, a.prompt_len, a.offset, a.held_out) == (
            b.question,
            b.answer,
            b.prompt_len,
            b.offset,
            b.held_out,
        )
        assert torch.equal(a.embeds, b.embeds) and torch.equal(a.features, b.features)


def test_a_cache_made_with_other_settings_is_refused_untouched(world, offline_run):
    model, data, samples = world
    _, cache, _ = offline_run
    before = {p.name: p.read_bytes() for p in cache.iterdir()}
    other = DraftRecipe(**{**RECIPE.__dict__, "max_new_tokens": 7})
    with pytest.raises(LiteVLMError, match="max_new_tokens: 6 there, 7 now"):
        target_sequences(load_model(model), other, samples, str(data), cache, progress=False)
    assert {p.name: p.read_bytes() for p in cache.iterdir()} == before


def test_a_cache_of_pruned_prompts_is_refused_once_the_token_selector_changes(world, tmp_path):
    """The prompts of --prune-prob are the TokenSelector's: a cache made with one selector is not read with another
    (retrained, or storing another r), and is left as it was; the same selector resumes it."""
    from litevlm.select.tokens import SelectorConfig, TokenSelector

    src, data, samples = world
    model = tmp_path / "model"
    shutil.copytree(src, model)
    recipe = DraftRecipe(**{**RECIPE.__dict__, "prune_prob": 0.5})
    TokenSelector.from_model(load_model(model).model, SelectorConfig(reads="embeds", keep_ratio=0.3)).save(model)
    cache = tmp_path / "cache"
    target_sequences(load_model(model), recipe, samples, str(data), cache, progress=False)
    target_sequences(load_model(model), recipe, samples, str(data), cache, progress=False)  # the same: resumes
    before = {p.name: p.read_bytes() for p in cache.iterdir()}
    TokenSelector.from_model(load_model(model).model, SelectorConfig(reads="embeds", keep_ratio=0.5)).save(model)
    with pytest.raises(LiteVLMError, match="token_selector_sha256"):
        target_sequences(load_model(model), recipe, samples, str(data), cache, progress=False)
    assert {p.name: p.read_bytes() for p in cache.iterdir()} == before


def test_pruned_prompts_are_answered_as_the_token_selector_leaves_them(world, tmp_path):
    """--prune-prob: the prompts drawn for pruning are answered as LiteVLM's pipeline answers them, pruned by the
    model's TokenSelector at its stored r with every kept token at its own position; the rest whole. A model without
    a selector that prunes before the decoder is refused before any answer."""
    from litevlm.select.tokens import SelectorConfig, TokenSelector

    src, data, samples = world
    model = tmp_path / "model"
    shutil.copytree(src, model)
    recipe = DraftRecipe(**{**RECIPE.__dict__, "prune_prob": 0.5, "context": 0})  # whole prompts: the skips show
    with pytest.raises(LiteVLMError, match="--prune-prob needs the model's TokenSelector"):
        target_sequences(load_model(model), recipe, samples, str(data), None, progress=False)
    TokenSelector.from_model(load_model(model).model).save(model)  # ranks from inside the decoder
    with pytest.raises(LiteVLMError, match="prunes the prompt before the decoder"):
        target_sequences(load_model(model), recipe, samples, str(data), None, progress=False)
    TokenSelector.from_model(load_model(model).model, SelectorConfig(reads="prompt", keep_ratio=0.3)).save(model)
    seqs = target_sequences(load_model(model), recipe, samples, str(data), None, progress=False)
    whole = Pipeline.from_loaded(load_model(model), max_new_tokens=RECIPE.max_new_tokens)
    pruned = Pipeline.from_pretrained(model, select_tokens=True, max_new_tokens=RECIPE.max_new_tokens)
    once = Counter(s.question for s in samples)
    by_question = {s.question: s for s in samples if once[s.question] == 1}  # a question asked of one frame only
    kinds = set()
    for seq in (s for s in seqs if s.question in by_question):
        sample = by_question[seq.question]
        images = load_images(sample)
        full = whole.prompt(sample.question, images)
        positions = seq.pair_positions(seq.embeds.shape[0])
        skips = not torch.equal(positions, torch.arange(seq.embeds.shape[0]))
        kinds.add(skips)
        pipe = pruned if skips else whole
        assert seq.answer == pipe.answer(sample.question, images).tokens
        if skips:  # fewer tokens than the whole prompt, each at its own place in it, the answer right after
            assert seq.prompt_len < full.embeds.shape[1]
            assert int(positions[seq.prompt_len - 1]) == full.embeds.shape[1] - 1
            assert torch.equal(positions[seq.prompt_len :], torch.arange(len(seq.answer)) + full.embeds.shape[1])
        else:
            assert seq.prompt_len == full.embeds.shape[1]
    assert kinds == {True, False}  # about half of each


def test_the_head_loads_with_the_pipeline_and_is_lossless(world, offline_run):
    model, _, samples = world
    plain = Pipeline.from_pretrained(model, max_new_tokens=12)
    spec = Pipeline.from_pretrained(model, speculative=True, max_new_tokens=12)
    assert spec.draft is not None and spec.draft.recipe["answers"] == "target"
    for s in samples[:: len(samples) // 4]:
        images = load_images(s)
        assert spec.answer(s.question, images).tokens == plain.answer(s.question, images).tokens


def test_openings_count_the_targets_answers_from_the_cache_or_generated(world, offline_run):
    model, data, samples = world
    _, cache, _ = offline_run
    loaded = load_model(model)
    kw = dict(samples=samples, data=str(data), depth=3, max_nodes=6, min_share=0.05, key_words=(2,), progress=False)
    from_cache = Openings.load(build_openings(loaded, offline=cache, **kw).parent, loaded.tokenizer.vocab_size)
    generated = Openings.load(build_openings(loaded, **kw).parent, loaded.tokenizer.vocab_size)
    assert from_cache.table == generated.table and generated.recipe["answers"] == "target"
    eos = loaded.tokenizer.eos_id
    train = [
        s for i in range(len(list(cache.glob("shard-*")))) for s in load_shard(shard_path(cache, i)) if not s.held_out
    ]
    want = Openings.build(
        [(s.question, s.answer[:-1] if s.answer[-1] == eos else s.answer) for s in train],
        eos_id=eos,
        vocab_size=loaded.tokenizer.vocab_size,
        depth=3,
        max_nodes=6,
        min_share=0.05,
        key_words=(2,),
    )
    assert generated.table == want.table and generated.recipe["questions"] == len(train)


def test_a_transformers_checkpoint_with_its_chat_template_gets_a_lossless_head(world, tmp_path):
    from litevlm.model.hf import load_native, save_hf
    from litevlm.model.prompt import PROMPT_FILE

    model_dir, data, samples = world
    hf = tmp_path / "tiny-hf"
    tok = load_model(model_dir).tokenizer
    save_hf(load_native(model_dir), hf, tok)
    config = json.loads((hf / "config.json").read_text())
    config.pop("litevlm")  # as transformers writes it: the special ids come from the tokenizer
    (hf / "config.json").write_text(json.dumps(config))
    (hf / "chat_template.jinja").write_text(
        "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
        "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
    )
    loaded = load_model(hf, system="You drive.")
    few = [s for s in samples if s.scene_id == samples[0].scene_id][:24]
    recipe = DraftRecipe(**{**RECIPE.__dict__, "val_fraction": 0.0})
    out = train_draft(loaded, None, recipe, samples=few, data="few", progress=False)
    assert out == hf / "draft" and json.loads((hf / PROMPT_FILE).read_text())["system"] == "You drive."
    plain = Pipeline.from_pretrained(hf, max_new_tokens=10)
    spec = Pipeline.from_pretrained(hf, speculative=True, max_new_tokens=10)
    assert spec.format.system == "You drive." and spec.draft.metrics["top1"] is None  # one scene: no validation
    for s in few[:4]:
        images = load_images(s)
        assert spec.answer(s.question, images).tokens == plain.answer(s.question, images).tokens


def test_two_ranks_share_the_generation_train_one_head_and_the_cache_fits_one_process(
    world, tmp_path, monkeypatch, capsys
):
    """`torchrun --nproc-per-node 2 -m litevlm train draft`: each rank answers its shards (gloo on the CPU), the head
    trains through DDP and rank 0 alone saves and prints; a single process then finds the whole cache made."""
    import os
    import subprocess
    import sys

    model_dir, data, samples = world
    model = tmp_path / "model"
    shutil.copytree(model_dir, model, ignore=shutil.ignore_patterns("draft", "prompt.json"))
    cache = tmp_path / "features"
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2", "-m", "litevlm"]
    cmd += ["--", "train", "draft", "--model", str(model), "--data", str(data), "--offline", str(cache)]
    cmd += ["--minutes", "0.05", "--threads", "1", "--max-new-tokens", "6", "--gen-batch", "8"]
    done = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.count("saved to") == 1 and done.stdout.count("bytes/token") == 1  # rank 0 alone prints
    share = int(re.search(r"target answers: +0%.*?/(\d+)", done.stderr).group(1))  # rank 0's progress bar
    assert 0 < share < len(samples)  # it answered its shards only
    head = json.loads((model / "draft" / "config.json").read_text())
    held = scene_split(samples, DraftRecipe.val_fraction, DraftRecipe.seed)[1]
    assert head["metrics"]["ranks"] == 2 and head["metrics"]["steps"] >= 1
    assert head["metrics"]["train_sequences"] == len(samples) - len(held)
    assert head["metrics"]["val_sequences"] == len(held)

    torch.set_num_threads(1)  # as each rank ran: the same kernels, so the same bits
    recipe = DraftRecipe(minutes=0.05, threads=1, max_new_tokens=6, gen_batch=8)
    counter = CountingTarget(monkeypatch, capsys)
    cached = target_sequences(load_model(model), recipe, samples, str(data), cache, progress=False)
    assert counter.calls == 0  # both ranks' shards are there, and fit a single process's key
    online = target_sequences(load_model(model), recipe, samples, str(data), None, progress=False)
    assert [s.answer for s in cached] == [s.answer for s in online]
    assert all(torch.equal(a.features, b.features) for a, b in zip(cached, online))

    plain = Pipeline.from_pretrained(model, max_new_tokens=12)
    spec = Pipeline.from_pretrained(model, speculative=True, max_new_tokens=12)
    for s in samples[:: len(samples) // 3]:
        images = load_images(s)
        assert spec.answer(s.question, images).tokens == plain.answer(s.question, images).tokens
