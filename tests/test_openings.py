"""Answer openings (`litevlm.spec.openings`): the table, its trie, its file, and the one thing that matters most: an
opening verified inside the prefill leaves greedy output unchanged token for token, whether it is right, partly
right or wrong, natively and eagerly."""

import json

import pytest
import torch
from test_spec import prompt, random_draft, tiny_vlm

from litevlm.errors import LiteVLMError
from litevlm.model.backend import choose_backend
from litevlm.model.generate import accept_opening, generate, selector_prefill
from litevlm.spec import speculative_generate
from litevlm.spec.openings import Opening, Openings, question_key

EOS = 2


def cache_upto(model, slots: int) -> list[torch.Tensor]:
    return [
        t[:, :, :slots].clone()
        for layer in model.language_model.layers
        for t in (layer.self_attn.kv_cache.k, layer.self_attn.kv_cache.v)
    ]


def assert_same_cache(a, b):
    for x, y in zip(a, b):
        # K/V written by a prefill with the openings' rows and by one without: the same layers over prompts of other
        # lengths, so fp32 sums of another length and order through the decoder; ~1e-4 of these O(1)-O(10) values, a
        # wrong slot or position moves them by O(1).
        torch.testing.assert_close(x, y, atol=1e-4, rtol=1e-4)


def test_the_key_is_the_first_two_words():
    assert question_key("Is <c1,CAM_FRONT,1.0,2.0> a car?") == "is c"
    assert question_key("  What will the car do next?") == "what will"
    assert question_key("?") == ""


def test_the_table_keeps_the_frequent_openings_within_the_node_budget():
    pairs = (
        [("Is there a car?", [10, 11])] * 6 + [("Is there a bus?", [12, 11])] * 3 + [("Is there x?", [13, 14, 15, 16])]
    )
    pairs += [("What will it do?", [20, 21, 22, 23])] * 2
    table = Openings.build(pairs, eos_id=EOS, vocab_size=64, depth=3, max_nodes=6, min_share=0.15)
    assert table.table["is there"] == [[10, 11, EOS], [12, 11, EOS]]  # the rare opening (10%) is under min_share
    assert table.table["what will"] == [[20, 21, 22]]  # cut at depth
    small = Openings.build(pairs, eos_id=EOS, vocab_size=64, depth=3, max_nodes=4)
    assert small.table["is there"] == [[10, 11, EOS]]  # a second branch would need 6 nodes
    assert small.for_question("Where is it?") is None


def test_a_question_takes_its_longest_known_key():
    pairs = (
        [("What will the car do?", [10, 11])] * 4 + [("What will it do?", [12])] * 4 + [("What will the bus do?", [13])]
    )
    table = Openings.build(pairs, eos_id=EOS, vocab_size=64, depth=3, max_nodes=8, min_share=0.3, key_words=(3, 2))
    assert table.for_question("What will the truck do?").tokens.tolist() == [10, 11, EOS]  # "what will the"
    assert table.for_question("What will we do?").tokens.tolist() == [10, 11, EOS, 12, EOS]  # only "what will" is known
    assert table.for_question("Why?") is None


def test_a_trie_lists_parents_first_and_masks_ancestors():
    trie = Opening.from_sequences([[10, 11, EOS], [10, 12], [13, 11, EOS]])
    assert trie.tokens.tolist() == [10, 11, EOS, 12, 13, 11, EOS]
    assert trie.parents.tolist() == [-1, 0, 1, 0, -1, 4, 5]
    assert trie.depth.tolist() == [0, 1, 2, 1, 0, 1, 2]
    for i, p in enumerate(trie.parents.tolist()):
        assert p < i
        expect = {i}
        while p >= 0:
            expect.add(p)
            p = trie.parents[p].item()
        assert set(trie.mask[i].nonzero().flatten().tolist()) == expect


def test_greedy_acceptance_walks_the_trie():
    trie = Opening.from_sequences([[10, 11, EOS], [12, 13, 14]])
    logits = torch.zeros(len(trie), 64)
    for node, nxt in enumerate([11, EOS, 9, 13, 30, 7]):  # what the target predicts after each node
        logits[node, nxt] = 1.0
    assert accept_opening(trie, 10, logits, EOS, 100) == ([0, 1], [10, 11, EOS])  # the whole answer
    assert accept_opening(trie, 12, logits, EOS, 100) == ([3, 4], [12, 13, 30])  # 12, 13 accepted; then 30, not 14
    assert accept_opening(trie, 40, logits, EOS, 100) == ([], [40])  # no root matches
    assert accept_opening(trie, 10, logits, EOS, 2) == ([0], [10, 11])  # max_new_tokens
    assert accept_opening(trie, EOS, logits, EOS, 100) == ([], [EOS])


def test_openings_save_and_load_and_refuse_what_does_not_fit(tmp_path):
    table = Openings.build([("Is it?", [10, 11])], eos_id=EOS, vocab_size=64, key_words=(3, 1), recipe={"frames": 1})
    table.save(tmp_path)
    back = Openings.load(tmp_path, 64)
    assert back.table == table.table and back.recipe == {"frames": 1} and back.key_words == (3, 1)
    assert Openings.load(tmp_path / "elsewhere", 64) is None
    with pytest.raises(LiteVLMError, match="vocabulary of 64"):
        Openings.load(tmp_path, 128)
    meta = json.loads((tmp_path / "openings.json").read_text())
    meta["table"]["is it"] = [[10, 99]]
    (tmp_path / "openings.json").write_text(json.dumps(meta))
    with pytest.raises(LiteVLMError, match="outside the vocabulary"):
        Openings.load(tmp_path, 64)
    (tmp_path / "openings.json").write_text("{not json")
    with pytest.raises(LiteVLMError, match="cannot read the answer openings"):
        Openings.load(tmp_path, 64)


@pytest.mark.parametrize("native", [True, False])
def test_an_opening_verified_in_the_prefill_is_lossless(native, monkeypatch):
    """Against plain greedy decoding of the same prompt: an opening that is the answer to its EOS (no decode step
    follows), one right for two tokens then wrong, and one wrong from the first token."""
    model = tiny_vlm(vocab=48)
    head = random_draft(model)
    target = choose_backend("native" if native else "modules", model, head)  # native: one prompt call under the mask
    for seed in range(4):
        embeds, pos = prompt(model, seed=seed)
        ref = generate(target, embeds, pos, 12, None).tokens
        eos = ref[3]  # ends the answer at its fourth token (a token the model does emit)
        ref = ref[: ref.index(eos) + 1]
        consumed = embeds.shape[1] + len(ref) - 1  # cache slots of the prompt and the answer's tokens but the last
        generate(target, embeds, pos, 12, eos)
        want_cache = cache_upto(model, consumed)
        cases = {
            "whole answer": ([ref[:4]], len(ref) - 1, 0),
            "two right, then wrong": ([[ref[0], ref[1], (ref[2] + 1) % 48]], 2, None),
            "a second branch": ([[(ref[0] + 1) % 48, 9, 9], ref[:3]], 3, None),
            "wrong": ([[(ref[0] + 1) % 48]], 0, None),
        }
        for name, (sequences, opened, cycles) in cases.items():
            trie = Opening.from_sequences(sequences)
            out = speculative_generate(target, head, embeds, pos, 12, eos, opening=trie)
            assert out.tokens == ref, (seed, name)
            assert out.opened == min(opened, len(ref) - 1), (seed, name)
            if cycles is not None:
                assert len(out.accept_lengths) == cycles, (seed, name)
            assert sum(out.accept_lengths) + out.opened == len(out.tokens) - 1
            assert_same_cache(
                cache_upto(model, consumed), want_cache
            )  # accepted nodes' K/V where plain decoding puts them


def test_an_opening_verified_with_a_prompt_pruned_inside_the_decoder_is_lossless():
    """The TokenSelector sharing decoder layer 0: the nodes run layer 0 over the kept prompt tokens once the cache is
    compacted, then the other layers with them; greedy output equals plain greedy decoding of the same pruning."""
    from test_tokens import tiny_prompt, trained_looking_selector
    from test_tokens import tiny_vlm as selector_vlm

    model = selector_vlm(seed=1)
    embeds, positions, spans = tiny_prompt(model, seed=1)
    sel = trained_looking_selector(model)
    head = random_draft(model)
    vocab = model.cfg.text.vocab_size
    plain = generate(
        model,
        embeds,
        positions,
        10,
        None,
        prefilled=selector_prefill(model, sel, embeds, positions, spans, 0.3).prefilled(embeds, positions),
    ).tokens
    eos = plain[3]
    ref = plain[: plain.index(eos) + 1]
    consumed = selector_prefill(model, sel, embeds, positions, spans, 0.3).kept_count + len(ref) - 1
    generate(
        model,
        embeds,
        positions,
        10,
        eos,
        prefilled=selector_prefill(model, sel, embeds, positions, spans, 0.3).prefilled(embeds, positions),
    )
    want_cache = cache_upto(model, consumed)
    for sequences, opened in [
        ([ref[:4]], len(ref) - 1),
        ([[(ref[0] + 1) % vocab, 9], ref[:3]], min(3, len(ref) - 1)),
        ([[(ref[0] + 1) % vocab]], 0),
    ]:
        pre = selector_prefill(
            model, sel, embeds, positions, spans, 0.3, opening=Opening.from_sequences(sequences), eos_id=eos, limit=10
        )
        out = speculative_generate(model, head, embeds, positions, 10, eos, prefilled=pre.prefilled(embeds, positions))
        assert out.tokens == ref and out.opened == opened, sequences
        assert_same_cache(cache_upto(model, consumed), want_cache)


def test_an_opening_without_room_in_the_cache_is_left_out():
    """A prompt that fills the cache but for the answer: the opening is skipped, not an error."""
    model = tiny_vlm(vocab=48, cache=20)
    head = random_draft(model)
    embeds, pos = prompt(model, seed=1, n=12)
    ref = generate(model, embeds, pos, 6, None).tokens
    out = speculative_generate(
        model, head, embeds, pos, 6, None, opening=Opening.from_sequences([ref[:3], [9, 9, 9, 9, 9, 9]])
    )
    assert out.tokens == ref and out.opened == 0


def test_the_openings_command_counts_synthetic_reference_answers_without_data(full_model_dir, tmp_path, capsys):
    import shutil

    from litevlm.cli import main
    from litevlm.data.synthetic import make_frame
    from litevlm.models import load_model

    model = tmp_path / "model"
    shutil.copytree(full_model_dir, model)
    assert main(["train", "openings", "--model", str(model), "--offline", str(tmp_path / "c")]) not in (0, None)
    assert "--offline reads the target's answers to --data" in capsys.readouterr().err
    assert main(["train", "openings", "--model", str(model), "--out", str(tmp_path / "no"), "--frames", "2"]) != 0
    assert "has no draft head" in capsys.readouterr().err and not (model / "draft" / "openings.json").exists()
    assert main(["train", "openings", "--model", str(model), "--frames", "2", "--key-words", "2"]) in (0, None)
    table = Openings.load(model / "draft", load_model(model).tokenizer.vocab_size)
    assert table.recipe["answers"] == "reference" and table.recipe["frames"] == 2
    tok = load_model(model).tokenizer
    pairs = [(qa.question, tok.encode(qa.answer)) for i in range(2) for qa in make_frame(0, i).qas]
    want = Openings.build(pairs, eos_id=tok.eos_id, vocab_size=tok.vocab_size, depth=4, max_nodes=12, min_share=0.03)
    assert table.table == want.table
