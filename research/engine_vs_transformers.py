"""Our engine against transformers' InternVLForConditionalGeneration on the same random weights (CPU, fp32).

A mid-size random InternVL (sizes from the flags) is built in transformers, saved with `save_pretrained`
and loaded with our `load_hf`, so both run identical weights. Median wall milliseconds after warm-up
are reported for the vision tower, prompt prefill, one-token extension and end-to-end greedy
generation; the last line of stdout is one JSON object with every number and the HF/ours ratios.

    python research/engine_vs_transformers.py
    python research/engine_vs_transformers.py --tiles 2 --new-tokens 8 --repeats 2
"""

from __future__ import annotations

import argparse
import copy
import json
import statistics
import tempfile
import time
import warnings

import torch

from litevlm.eval.timing import median_ms as median_wall_ms


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--vision-width", type=int, default=256)
    p.add_argument("--vision-layers", type=int, default=6)
    p.add_argument("--vision-heads", type=int, default=4)
    p.add_argument("--image-size", type=int, default=224, help="tile side in pixels (patch 14: must give an even grid)")
    p.add_argument("--text-width", type=int, default=512)
    p.add_argument("--text-layers", type=int, default=8)
    p.add_argument("--text-heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--text-intermediate", type=int, default=1408)
    p.add_argument("--vocab", type=int, default=4096)
    p.add_argument("--arch", choices=("qwen2", "llama"), default="qwen2")
    p.add_argument("--tiles", type=int, default=6)
    p.add_argument("--text-tokens", type=int, default=100, help="text tokens around the image placeholders")
    p.add_argument("--new-tokens", type=int, default=32)
    p.add_argument("--repeats", type=int, default=3, help="timed repeats after one warm-up")
    p.add_argument("--hf-attn", default="sdpa", help="transformers attn_implementation (sdpa is its default)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    return p.parse_args(argv)


def median_ms(fn, repeats: int, setup=None) -> float:
    """Median wall ms of fn() over `repeats` runs after one warm-up; setup() runs untimed before each."""
    return median_wall_ms(fn, repeats, warmup=1, setup=setup)


def build_hf(a: argparse.Namespace):
    from transformers import InternVLConfig, InternVLForConditionalGeneration

    image_token = a.vocab - 1
    grid = a.image_size // 14
    text = dict(
        model_type=a.arch,
        vocab_size=a.vocab,
        hidden_size=a.text_width,
        intermediate_size=a.text_intermediate,
        num_hidden_layers=a.text_layers,
        num_attention_heads=a.text_heads,
        num_key_value_heads=a.kv_heads,
        max_position_embeddings=4096,
        rope_theta=1e6,
        rms_norm_eps=1e-6,
        tie_word_embeddings=False,
    )
    if a.arch == "llama":
        text["attention_bias"] = False
    cfg = InternVLConfig(
        vision_config=dict(
            hidden_size=a.vision_width,
            num_hidden_layers=a.vision_layers,
            num_attention_heads=a.vision_heads,
            intermediate_size=4 * a.vision_width,
            image_size=a.image_size,
            patch_size=14,
            attention_bias=True,
            layer_norm_eps=1e-6,
            layer_scale_init_value=0.1,
            use_mean_pooling=True,
        ),
        text_config=text,
        image_token_id=image_token,
        image_seq_length=(grid // 2) ** 2,
        downsample_ratio=0.5,
        vision_feature_layer=-1,
        vision_feature_select_strategy="default",
        projector_hidden_act="gelu",
        tie_word_embeddings=False,
    )
    hf = InternVLForConditionalGeneration._from_config(copy.deepcopy(cfg), attn_implementation=a.hf_attn)
    g = torch.Generator().manual_seed(a.seed)
    with torch.no_grad():  # transformers zero-initialises cls/position embeddings: make every weight random
        for name, p in hf.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            p.copy_(1.0 + 0.05 * noise if "norm" in name and name.endswith("weight") else 0.05 * noise)
    return hf.eval(), image_token, (grid // 2) ** 2


def main(argv=None) -> dict:
    a = parse_args(argv)
    torch.set_num_threads(a.threads)
    warnings.filterwarnings("ignore")
    from transformers import DynamicCache, LogitsProcessorList
    from transformers.utils import logging as hf_logging

    from litevlm.model.generate import decode_step, generate, prefill
    from litevlm.model.hf import load_hf

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    hf, image_token, per_tile = build_hf(a)
    with tempfile.TemporaryDirectory() as d:
        hf.save_pretrained(d)
        ours, _ = load_hf(d)

    g = torch.Generator().manual_seed(a.seed + 1)
    head = torch.randint(0, image_token, (a.text_tokens // 3,), generator=g)
    tail = torch.randint(0, image_token, (a.text_tokens - a.text_tokens // 3,), generator=g)
    ids = torch.cat([head, torch.full((a.tiles * per_tile,), image_token), tail])[None]  # (1, L)
    pix = torch.randn(a.tiles, 3, a.image_size, a.image_size, generator=g)
    L, N = ids.shape[1], a.new_tokens
    positions = torch.arange(L)[None]  # (1, L)
    r: dict[str, float] = {}

    with torch.inference_mode():
        # -- vision: tiles -> projected visual tokens ------------------------------------------------------
        r["vision_ours_ms"] = median_ms(lambda: ours.encode_tiles(pix), a.repeats)
        r["vision_hf_ms"] = median_ms(lambda: hf.model.get_image_features(pixel_values=pix).pooler_output, a.repeats)

        embeds = ours.embed(ids, ours.encode_tiles(pix))  # (1, L, C), shared by both prefills

        # -- prefill: the whole prompt into the cache, last-token logits -----------------------------------
        ours.language_model.setup_cache(1, L + N)
        r["prefill_ours_ms"] = median_ms(lambda: prefill(ours, embeds, positions), a.repeats)
        r["prefill_hf_ms"] = median_ms(
            lambda: hf(inputs_embeds=embeds, cache=DynamicCache(config=hf.config), use_cache=True, logits_to_keep=1),
            a.repeats,
        )

        # -- extend by one token: N-1 single-token steps after a prefill, per token --------------------------
        def ours_steps():
            for i in range(N - 1):
                decode_step(ours, torch.tensor([[7]]), L + i, L + i)

        state = {}

        def hf_setup():
            cache = DynamicCache(config=hf.config)
            hf(inputs_embeds=embeds, cache=cache, use_cache=True, logits_to_keep=1)
            state["cache"] = cache

        def hf_steps():
            cache = state["cache"]
            for i in range(N - 1):
                hf(
                    input_ids=torch.tensor([[7]]),
                    position_ids=torch.tensor([[L + i]]),
                    cache=cache,
                    use_cache=True,
                    logits_to_keep=1,
                )

        r["extend_ours_ms"] = median_ms(ours_steps, a.repeats, setup=lambda: prefill(ours, embeds, positions)) / (N - 1)
        r["extend_hf_ms"] = median_ms(hf_steps, a.repeats, setup=hf_setup) / (N - 1)

        # -- end to end greedy generation: pixels + ids -> N new tokens -------------------------------------
        # Per new token = the time between the first and the last sampled token of the same run, / (N-1):
        # our generate() times its decode loop; for HF a logits processor stamps every sampling step.
        out, per_token = {}, {"ours": [], "hf": []}

        def ours_e2e():
            e = ours.embed(ids, ours.encode_tiles(pix))
            gen = generate(ours, e, positions, N, eos_id=None)
            out["ours"] = gen.tokens
            per_token["ours"].append(gen.timings_ms["decode"] / (N - 1))

        stamps: list[float] = []

        def stamp(input_ids, scores):  # a LogitsProcessor that only records when each step samples
            stamps.append(time.perf_counter())
            return scores

        def hf_e2e():
            stamps.clear()
            seq = hf.generate(
                input_ids=ids,
                pixel_values=pix,
                attention_mask=torch.ones_like(ids),
                do_sample=False,
                max_new_tokens=N,
                min_new_tokens=N,
                pad_token_id=0,
                logits_processor=LogitsProcessorList([stamp]),
            )
            out["hf"] = seq[0, L:].tolist()
            per_token["hf"].append((stamps[-1] - stamps[0]) * 1e3 / (N - 1))

        r["generate_ours_ms"] = median_ms(ours_e2e, a.repeats)
        r["generate_hf_ms"] = median_ms(hf_e2e, a.repeats)
    for who in ("ours", "hf"):
        r[f"generate_{who}_per_token_ms"] = statistics.median(per_token[who][1:])  # the warm-up run dropped
    rows = [
        ("vision", "vision"),
        ("prefill", "prefill"),
        ("extend-one (per token)", "extend"),
        ("generate end-to-end", "generate"),
        ("generate, per new token", "generate_per_token"),
    ]
    ratios = {}
    for _, key in rows:
        o, h = (
            (r[f"{key}_ours_ms"], r[f"{key}_hf_ms"])
            if key != "generate_per_token"
            else (r["generate_ours_per_token_ms"], r["generate_hf_per_token_ms"])
        )
        ratios[f"{key}_hf_over_ours"] = h / o

    print(
        f"engine vs transformers {__import__('transformers').__version__} (attn={a.hf_attn}), fp32 CPU, "
        f"{a.threads} threads, {a.tiles} tiles x {per_tile} tokens + {a.text_tokens} text = {L} prompt tokens, {N} new"
    )
    print(f"{'stage':<26}{'ours ms':>10}{'HF ms':>10}{'HF/ours':>9}")
    for label, key in rows:
        o = r["generate_ours_per_token_ms"] if key == "generate_per_token" else r[f"{key}_ours_ms"]
        h = r["generate_hf_per_token_ms"] if key == "generate_per_token" else r[f"{key}_hf_ms"]
        print(f"{label:<26}{o:>10.2f}{h:>10.2f}{ratios[f'{key}_hf_over_ours']:>9.2f}")
    match = out["ours"] == out["hf"]
    print(f"greedy tokens identical: {match}")
    result = {
        "benchmark": "engine_vs_transformers",
        "device": "cpu",
        "dtype": "float32",
        "threads": a.threads,
        "hf_attn": a.hf_attn,
        "prompt_tokens": L,
        "image_tokens": a.tiles * per_tile,
        "tiles": a.tiles,
        "new_tokens": N,
        "repeats": a.repeats,
        "tokens_identical": match,
        **{k: round(v, 3) for k, v in r.items()},
        **{k: round(v, 3) for k, v in ratios.items()},
    }
    print(json.dumps(result))
    return result


if __name__ == "__main__":
    main()
