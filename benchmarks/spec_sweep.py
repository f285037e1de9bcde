"""Sweep EAGLE-2 tree sizes against plain decoding on the same questions, side by side.

    python benchmarks/spec_sweep.py --model src/litevlm/weights/drive-tiny --data .bench-data/heldout --n 100

For every question the prompt (all six views) is embedded once; then plain greedy decoding and every
tree configuration decode it in turn (interleaved, so machine load hits all alike). Reported per
configuration: tau (tokens per target forward, bonus included), draft and verify milliseconds per
cycle, decode-stage tokens/s, the decode-stage speed-up over plain decoding, and whether every
output equals plain greedy decoding token for token. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time

import torch

from litevlm.cameras import CAMERAS
from litevlm.model import cpu_steps
from litevlm.model.generate import StageTimer, generate
from litevlm.spec import DraftHead, TreeConfig, speculative_generate

SWEEP = [
    TreeConfig(),  # the default: a depth-16 chain cut at draft probability 0.1
    TreeConfig.chain(16, 0.2),
    TreeConfig.chain(16, 0.3),
    TreeConfig.chain(16, 0.5),
    TreeConfig.chain(10, 0.3),
    TreeConfig.chain(3),
    TreeConfig.chain(5),
    TreeConfig.chain(7),
    TreeConfig(2, 6, 8),
    TreeConfig(4, 4, 8),
    TreeConfig(4, 6, 16),
    TreeConfig(8, 5, 16),
    TreeConfig(4, 6, 32),
    TreeConfig(8, 6, 32),
]


def parse_tree(s: str) -> TreeConfig:
    """ "k4d6n16", "chain5" or "chain8v0.2" (a chain cut where its draft probability < 0.2)."""
    if s.startswith("chain"):
        depth, _, value = s[5:].partition("v")
        return TreeConfig.chain(int(depth), float(value or 0))
    k, rest = s[1:].split("d")
    d, n = rest.split("n")
    return TreeConfig(int(k), int(d), int(n))


def prompts(model, tokenizer, data: str, n: int, every: int):
    from litevlm.data.drivelm import load_images, load_samples
    from litevlm.model.prompt import build_prompt
    from litevlm.model.vlm import image_to_tiles

    samples = load_samples(data)[::every][:n]
    cfg = model.cfg
    out, cache = [], {}
    for s in samples:
        if s.frame_id not in cache:
            imgs = load_images(s, CAMERAS)
            pixels = torch.cat([image_to_tiles(imgs[c], cfg.vision.image_size, cfg.tiles_per_view) for c in CAMERAS])
            with torch.no_grad():
                cache = {s.frame_id: model.encode_tiles(pixels)}
        ids = build_prompt(tokenizer, s.question, list(CAMERAS), cfg.tokens_per_tile * cfg.tiles_per_view).ids
        with torch.no_grad():
            embeds = model.embed(torch.tensor([ids]), cache[s.frame_id])
        out.append((s.id, embeds, torch.arange(len(ids))[None]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="src/litevlm/weights/drive-tiny")
    ap.add_argument("--draft", default=None, help="draft folder (default MODEL/draft)")
    ap.add_argument("--data", required=True, help="a folder written by `litevlm data synth` (held-out: --seed 1)")
    ap.add_argument("--n", type=int, default=100, help="questions")
    ap.add_argument("--every", type=int, default=1, help="take every k-th question of the split")
    ap.add_argument("--max-new-tokens", type=int, default=96)
    ap.add_argument("--threads", type=int, default=1, help="torch intra-op threads (1 is fastest for this model size)")
    ap.add_argument("--trees", nargs="*", default=None, help="e.g. chain3 k4d6n16 (default: the built-in sweep)")
    args = ap.parse_args()

    from litevlm.data.tokenizer import Tokenizer
    from litevlm.model.hf import load_native

    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_native(args.model).float().eval()
    tokenizer = Tokenizer.from_dir(args.model)
    draft = DraftHead.load(args.draft or args.model, model)
    trees = [parse_tree(t) for t in args.trees] if args.trees else SWEEP
    qs = prompts(model, tokenizer, args.data, args.n, args.every)
    longest = max(e.shape[1] for _, e, _ in qs)
    model.language_model.setup_cache(1, longest + args.max_new_tokens + max(t.total_tokens for t in trees) + 8)
    eos = tokenizer.eos_id

    def run(cfg, embeds, pos):
        timer = StageTimer("cpu")
        if cfg is None:
            return generate(model, embeds, pos, args.max_new_tokens, eos, timer=timer)
        return speculative_generate(model, draft, embeds, pos, args.max_new_tokens, eos, timer=timer, tree=cfg)

    for _, e, p in qs[:3]:  # warm-up
        for cfg in [None, *trees]:
            run(cfg, e, p)
    configs = [None, *trees]
    stats = {
        i: {"decode_ms": [], "draft_ms": 0.0, "verify_ms": 0.0, "cycles": 0, "emitted": 0, "tokens": 0, "mismatch": 0}
        for i in range(len(configs))
    }
    t0 = time.time()
    for qi, (_, e, p) in enumerate(qs):
        ref = None
        for i, cfg in enumerate(configs):
            g = run(cfg, e, p)
            s = stats[i]
            s["decode_ms"].append(g.timings_ms.get("decode", 0.0))
            s["tokens"] += len(g.tokens) - 1  # tokens produced by the decode stage
            if cfg is None:
                ref = g.tokens
                continue
            s["draft_ms"] += g.timings_ms.get("draft", 0.0)
            s["verify_ms"] += g.timings_ms.get("verify", 0.0)
            s["cycles"] += len(g.accept_lengths)
            s["emitted"] += sum(g.accept_lengths)
            s["mismatch"] += g.tokens != ref
        print(f"\r{qi + 1}/{len(qs)} questions", end="", file=sys.stderr, flush=True)
    print(file=sys.stderr)
    wall = time.time() - t0

    plain_ms = sum(stats[0]["decode_ms"])
    rows = []
    for i, cfg in enumerate(configs):
        s = stats[i]
        dec = sum(s["decode_ms"])
        row = {
            "config": "plain" if cfg is None else cfg.label(),
            "top_k": None if cfg is None else cfg.top_k,
            "depth": None if cfg is None else cfg.depth,
            "total_tokens": None if cfg is None else cfg.total_tokens,
            "tau": 1.0 if cfg is None else round(s["emitted"] / max(1, s["cycles"]), 3),
            "draft_ms": None if cfg is None else round(s["draft_ms"] / max(1, s["cycles"]), 3),
            "verify_ms": None if cfg is None else round(s["verify_ms"] / max(1, s["cycles"]), 3),
            "decode_ms_per_question": round(statistics.median(s["decode_ms"]), 2),
            "tokens_per_s": round(s["tokens"] / (dec / 1e3), 1) if dec else None,
            "speedup": round(plain_ms / dec, 3) if dec else None,
            "mismatches": s["mismatch"],
        }
        rows.append(row)
    hdr = f"{'config':<18}{'tau':>7}{'draft ms':>10}{'verify ms':>11}{'tok/s':>9}{'speed-up':>10}{'mismatch':>10}"
    print(hdr)
    print("-" * len(hdr))
    for r in rows:
        f = lambda v, fmt: "-" if v is None else format(v, fmt)  # noqa: E731
        print(
            f"{r['config']:<18}{r['tau']:>7.2f}{f(r['draft_ms'], '.2f'):>10}{f(r['verify_ms'], '.2f'):>11}"
            f"{f(r['tokens_per_s'], '.1f'):>9}{f(r['speedup'], '.2f'):>10}{r['mismatches']:>10}"
        )
    best = max(rows[1:], key=lambda r: r["speedup"] or 0)
    print(
        json.dumps(
            {
                "benchmark": "spec_sweep",
                "model": args.model,
                "data": args.data,
                "questions": len(qs),
                "max_new_tokens": args.max_new_tokens,
                "threads": args.threads,
                "dtype": "float32",
                "cpu_steps": cpu_steps.backend(),
                "cpu": platform.processor() or platform.machine(),
                "wall_s": round(wall, 1),
                "plain_tokens_per_s": rows[0]["tokens_per_s"],
                "best": best["config"],
                "best_speedup": best["speedup"],
                "best_tau": best["tau"],
                "lossless": all(r["mismatches"] == 0 for r in rows),
                "rows": rows,
            },
            separators=(",", ":"),
        )
    )


if __name__ == "__main__":
    main()
