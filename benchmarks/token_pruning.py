"""Accuracy against kept visual tokens: TokenSelector vs FastV (K=1, K=2) vs random vs uniform, one run.

Every method answers the same questions over the same views (by default the views each question
needs, i.e. what view selection feeds the token stage) at keep ratios r (fraction of visual
tokens KEPT), with greedy decoding; the DriveLM final score (no judge: the other weights
renormalised) and closed-question accuracy are reported per method and r, beside the unpruned
model. Timing, side by side in the same process on the first --timing-n prompts: unpruned prefill,
the selector's own cost, prefill of the pruned prompt, and FastV's prefill (median ms).

    python benchmarks/token_pruning.py --model src/litevlm/weights/drive-tiny --data /tmp/heldout --n 400 --plot tokens.png

The last line of stdout is one JSON object with every number.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
import zlib
from pathlib import Path

import torch

from litevlm.eval.timing import median_ms as median_wall_ms

METHODS = ("selector", "fastv_k1", "fastv_k2", "random", "uniform")
LABELS = {
    "selector": "TokenSelector",
    "fastv_k1": "FastV K=1",
    "fastv_k2": "FastV K=2",
    "random": "random",
    "uniform": "uniform",
}


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    p.add_argument("--model", default="drive-tiny", help="model directory (with token_selector/) or bundled name")
    p.add_argument("--selector", default=None, help="TokenSelector directory if not MODEL/token_selector")
    p.add_argument("--data", required=True, help="folder from `litevlm data synth` or a DriveLM JSON file")
    p.add_argument("--n", type=int, default=300, help="questions, spread evenly over the file (every len/N-th)")
    p.add_argument("--ratios", default="0.2,0.3,0.5,0.7,0.9")
    p.add_argument("--methods", default=",".join(METHODS))
    p.add_argument(
        "--views", choices=("needed", "all"), default="needed", help="the views each question needs, or all six"
    )
    p.add_argument("--min-per-view", type=int, default=None, help="selector quota per view (default: the checkpoint's)")
    p.add_argument("--max-new-tokens", type=int, default=160, help="as the pipeline and `litevlm eval`")
    p.add_argument("--timing-n", type=int, default=24, help="prompts timed (0: no timing)")
    p.add_argument("--repeats", type=int, default=3, help="timed repeats per prompt (the median is kept)")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--plot", default=None, help="save the accuracy curves as this PNG")
    p.add_argument("--predictions", default=None, help="write every record to this JSON file")
    return p.parse_args(argv)


class Prompts:
    """Embeddings of each sample's prompt over its views; each frame's views are encoded once."""

    def __init__(self, model, tokenizer, views_mode: str):
        self.model, self.tokenizer, self.views_mode = model, tokenizer, views_mode
        self.visual: dict[str, dict] = {}

    def views(self, sample) -> list[str]:
        from litevlm.cameras import CAMERAS

        if self.views_mode == "all" or not sample.views:
            return list(CAMERAS)
        return [c for c in CAMERAS if c in sample.views]

    @torch.no_grad()
    def __call__(self, sample):
        from litevlm.data.drivelm import load_images
        from litevlm.model.vlm import image_to_tiles
        from litevlm.train.tokens import prompt_embeds

        cfg = self.model.cfg
        key = sample.frame_id or sample.id
        views = self.views(sample)
        cache = self.visual.setdefault(key, {})
        missing = [c for c in views if c not in cache]
        if missing:
            imgs = load_images(sample, missing)
            pixels = torch.cat([image_to_tiles(imgs[c], cfg.vision.image_size, cfg.tiles_per_view) for c in missing])
            visual = self.model.encode_tiles(pixels.to(self.model.device)).reshape(
                len(missing), -1, cfg.text.hidden_size
            )
            cache.update({c: visual[i] for i, c in enumerate(missing)})
        if len(self.visual) > 64:  # samples come frame by frame: keep the cache small
            self.visual.pop(next(iter(self.visual)))
        _, embeds, positions, spans = prompt_embeds(self.model, self.tokenizer, cache, sample.question, views)
        return embeds, positions, spans


def answer_text(tokenizer, tokens: list[int]) -> str:
    return tokenizer.decode([t for t in tokens if t != tokenizer.eos_id]).strip()


@torch.no_grad()
def run_accuracy(
    model, tokenizer, selector, samples, prompts: Prompts, ratios, methods, max_new, min_per_view, progress=True
):
    """records[(method, r)] -> list of DriveLM records; ('unpruned', 1.0) included. Also kept visual-token counts."""
    from tqdm import tqdm

    from litevlm.model.generate import fastv_generate, generate, selector_prefill
    from litevlm.select.tokens import (
        prune_prompt,
        random_select,
        select_by_scores,
        uniform_select,
        view_sizes,
    )

    eos = tokenizer.eos_id
    records: dict[tuple[str, float], list[dict]] = {}
    kept_tokens: dict[tuple[str, float], list[int]] = {}

    def add(key, sample, tokens, n_visual):
        records.setdefault(key, []).append(
            {
                "id": sample.id,
                "question": sample.question,
                "answer": answer_text(tokenizer, tokens),
                "gt": sample.answer,
                "tag": sample.tag,
                "closed": sample.closed,
                "category": sample.category,
                "frame": sample.frame_id,
            }
        )
        kept_tokens.setdefault(key, []).append(n_visual)

    for sample in tqdm(samples, desc="answering", disable=not progress):
        embeds, positions, spans = prompts(sample)
        n_vis = sum(view_sizes(spans))
        add(("unpruned", 1.0), sample, generate(model, embeds, positions, max_new, eos).tokens, n_vis)
        sel_scores = None
        if "selector" in methods and not selector.cfg.shared_layer:
            sel_scores = selector.scores(
                embeds, positions, spans, selector.tag_features(model, sample.question, spans)
            )[0]
        for r in ratios:
            for m in methods:
                if (
                    m == "selector" and selector.cfg.shared_layer
                ):  # selection inside the decoder, as the pipeline runs it
                    pre = selector_prefill(model, selector, embeds, positions, spans, r, min_per_view, sample.question)
                    gen = generate(model, embeds, positions, max_new, eos, prefilled=pre.prefilled(embeds, positions))
                elif m == "selector":
                    kept = select_by_scores(sel_scores, view_sizes(spans), r, min_per_view)
                    e, p, idx = prune_prompt(embeds, positions, spans, kept)
                    gen = generate(model, e, p, max_new, eos)
                elif m.startswith("fastv_k"):
                    gen = fastv_generate(model, embeds, positions, spans, int(m[-1]), r, max_new, eos)
                elif m == "random":
                    g = torch.Generator().manual_seed(zlib.crc32(f"{sample.id}/{r}".encode()))
                    e, p, idx = random_select(embeds, positions, spans, r, 0, g)
                    gen = generate(model, e, p, max_new, eos)
                elif m == "uniform":
                    e, p, idx = uniform_select(embeds, positions, spans, r)
                    gen = generate(model, e, p, max_new, eos)
                else:
                    raise SystemExit(f"unknown method {m!r}; known: {', '.join(METHODS)}")
                add((m, r), sample, gen.tokens, gen.prompt_len - (embeds.shape[1] - n_vis))
    return records, kept_tokens


def _median_ms(fn, repeats: int, device) -> float:
    return median_wall_ms(fn, repeats, warmup=0, device=device)


@torch.no_grad()
def run_timing(model, selector, samples, prompts: Prompts, ratios, repeats: int, min_per_view) -> dict:
    """Median ms over prompts: unpruned prefill; per r: selector, pruned prefill, FastV K=1/K=2 prefill.

    A selector sharing decoder layer 0 selects inside the decoder: its "selector" time is its head (and
    the c-tag read), its "pruned prefill" the decoder layers (layer 0 on the whole prompt, the rest on
    the kept tokens), both from the stage timer of one `TokenSelector.prefill` call (median of repeats)."""
    from litevlm.model.generate import StageTimer, fastv_prefill, prefill, selector_prefill
    from litevlm.select.tokens import prune_prompt, select_by_scores, view_sizes

    dev = model.device
    rows: dict[str, list[float]] = {}

    def rec(name, ms):
        rows.setdefault(name, []).append(ms)

    inputs = [(*prompts(s), s.question) for s in samples]
    embeds, positions, spans, _ = inputs[0]
    for _ in range(2):  # warm-up
        prefill(model, embeds, positions)
        selector.scores(embeds, positions, spans)
        fastv_prefill(model, embeds, positions, spans, 1, 0.5)
        if selector.cfg.shared_layer:
            selector_prefill(model, selector, embeds, positions, spans, 0.5)
    for embeds, positions, spans, question in inputs:
        rec("prefill_unpruned", _median_ms(lambda: prefill(model, embeds, positions), repeats, dev))
        for r in ratios:
            if selector.cfg.shared_layer:
                split = {"select_tokens": [], "prefill": []}
                for _ in range(repeats):
                    timer = StageTimer(dev)
                    selector_prefill(model, selector, embeds, positions, spans, r, min_per_view, question, timer)
                    for stage in split:
                        split[stage].append(timer.ms[stage])
                rec(f"selector@{r}", statistics.median(split["select_tokens"]))
                rec(f"prefill_pruned@{r}", statistics.median(split["prefill"]))
                for k in (1, 2):
                    rec(
                        f"fastv_k{k}@{r}",
                        _median_ms(lambda: fastv_prefill(model, embeds, positions, spans, k, r), repeats, dev),
                    )
                continue

            def select():
                s = selector.scores(embeds, positions, spans, selector.tag_features(model, question, spans))[0]
                return prune_prompt(embeds, positions, spans, select_by_scores(s, view_sizes(spans), r, min_per_view))

            rec(f"selector@{r}", _median_ms(select, repeats, dev))
            e, p, _ = select()
            rec(f"prefill_pruned@{r}", _median_ms(lambda: prefill(model, e, p), repeats, dev))
            for k in (1, 2):
                rec(
                    f"fastv_k{k}@{r}",
                    _median_ms(lambda: fastv_prefill(model, embeds, positions, spans, k, r), repeats, dev),
                )
    return {name: statistics.median(v) for name, v in rows.items()}


def plot(path, table: dict, unpruned: float, ratios, methods, subtitle: str = "") -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6.4, 4.2), dpi=120)
    styles = {
        "selector": ("C3", "o", 2.4),
        "fastv_k1": ("C0", "s", 1.5),
        "fastv_k2": ("C2", "^", 1.5),
        "random": ("0.55", "x", 1.2),
        "uniform": ("0.35", "d", 1.2),
    }
    for m in methods:
        colour, marker, lw = styles.get(m, ("C4", ".", 1.2))
        ax.plot(
            ratios, [table[(m, r)]["final"] for r in ratios], marker=marker, color=colour, lw=lw, label=LABELS.get(m, m)
        )
    ax.axhline(unpruned, color="k", ls="--", lw=1, label="unpruned")
    ax.set_xlabel("keep ratio r (fraction of visual tokens kept)")
    ax.set_ylabel("DriveLM final score (no judge)")
    ax.set_title("Accuracy against kept visual tokens" + (f"\n{subtitle}" if subtitle else ""), fontsize=10)
    ax.grid(alpha=0.3)
    ax.legend(loc="lower right", fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def main(argv=None) -> dict:
    args = parse_args(argv)
    from litevlm.data.drivelm import load_samples
    from litevlm.data.tokenizer import Tokenizer
    from litevlm.eval.metrics import closed_accuracy, score
    from litevlm.model.hf import load_native
    from litevlm.models import resolve_model_dir
    from litevlm.select.tokens import TokenSelector

    torch.set_num_threads(args.threads)
    ratios = [float(r) for r in args.ratios.split(",")]
    methods = [m for m in args.methods.split(",") if m]
    path = resolve_model_dir(args.model)
    model = load_native(path).eval()
    tokenizer = Tokenizer.from_dir(path)
    selector = TokenSelector.load(args.selector or path, model)
    quota = selector.cfg.min_per_view if args.min_per_view is None else args.min_per_view
    tpv = model.cfg.tokens_per_tile * model.cfg.tiles_per_view
    model.language_model.setup_cache(1, 64 + 6 * (tpv + 16) + 256 + args.max_new_tokens)
    every = load_samples(args.data)
    step = max(1.0, len(every) / args.n)  # spread over all frames, deterministically
    samples = [every[int(i * step)] for i in range(min(args.n, len(every)))]
    prompts = Prompts(model, tokenizer, args.views)

    t0 = time.time()
    records, kept = run_accuracy(
        model, tokenizer, selector, samples, prompts, ratios, methods, args.max_new_tokens, quota
    )
    answer_s = time.time() - t0
    table = {}
    for key, recs in records.items():
        s = score(recs)
        table[key] = {
            "final": s["final"],
            "closed_accuracy": closed_accuracy(recs),
            "accuracy": s["accuracy"],
            "language": s["language"],
            "match": s["match"],
            "visual_tokens": statistics.fmean(kept[key]),
        }
    unpruned = table[("unpruned", 1.0)]
    base_answers = [r["answer"] for r in records[("unpruned", 1.0)]]
    for key, recs in records.items():  # how much pruning perturbs the model: answers that differ from unpruned
        table[key]["changed"] = sum(r["answer"] != a for r, a in zip(recs, base_answers)) / len(recs)
    timing = (
        run_timing(model, selector, samples[: args.timing_n], prompts, ratios, args.repeats, quota)
        if args.timing_n
        else {}
    )

    # -- report ---------------------------------------------------------------------------------
    print(
        f"\n{len(samples)} questions, views={args.views}, selector quota {quota}/view, greedy, max {args.max_new_tokens} new tokens"
    )
    print(
        f"unpruned: final {unpruned['final']:.4f}  closed acc {unpruned['closed_accuracy']:.4f}  "
        f"visual tokens {unpruned['visual_tokens']:.1f}\n"
    )
    head = "| method | " + " | ".join(f"r={r}" for r in ratios) + " |"
    print("DriveLM final score (closed-question accuracy)\n")
    print(head)
    print("|" + "---|" * (len(ratios) + 1))
    for m in methods:
        cells = [f"{table[(m, r)]['final']:.4f} ({table[(m, r)]['closed_accuracy']:.3f})" for r in ratios]
        print(f"| {LABELS.get(m, m)} | " + " | ".join(cells) + " |")
    print(f"| unpruned | {unpruned['final']:.4f} ({unpruned['closed_accuracy']:.3f}) |" + " |" * (len(ratios) - 1))
    print("\nAnswers that differ from the unpruned model's (fraction of questions)\n")
    print(head)
    print("|" + "---|" * (len(ratios) + 1))
    for m in methods:
        print(f"| {LABELS.get(m, m)} | " + " | ".join(f"{table[(m, r)]['changed']:.3f}" for r in ratios) + " |")
    if timing:
        print(
            f"\nprefill ms (median of {min(args.timing_n, len(samples))} prompts, {args.repeats} repeats each, {model.device}, "
            f"{torch.get_num_threads()} threads); unpruned prefill {timing['prefill_unpruned']:.2f} ms\n"
        )
        print(
            "| r | visual tokens | selector ms | pruned prefill ms | selector + prefill ms | speed-up | FastV K=1 ms | FastV K=2 ms |"
        )
        print("|---|---|---|---|---|---|---|---|")
        for r in ratios:
            tot = timing[f"selector@{r}"] + timing[f"prefill_pruned@{r}"]
            vt = table[("selector", r)]["visual_tokens"] if ("selector", r) in table else float("nan")
            print(
                f"| {r} | {vt:.1f} | {timing[f'selector@{r}']:.2f} | {timing[f'prefill_pruned@{r}']:.2f} | {tot:.2f} | "
                f"{timing['prefill_unpruned'] / tot:.2f}x | {timing[f'fastv_k1@{r}']:.2f} | {timing[f'fastv_k2@{r}']:.2f} |"
            )
    if args.plot:
        plot(
            args.plot,
            table,
            unpruned["final"],
            ratios,
            methods,
            f"{path.name}, {len(samples)} held-out questions, views: {args.views}",
        )
        print(f"\nplot saved to {args.plot}")
    if args.predictions:
        Path(args.predictions).write_text(json.dumps({f"{m}@{r}": v for (m, r), v in records.items()}, indent=1))
    sel_vs_fastv = {
        r: round(
            table[("selector", r)]["final"]
            - max(table[(f, r)]["final"] for f in ("fastv_k1", "fastv_k2") if (f, r) in table),
            4,
        )
        for r in ratios
        if ("selector", r) in table and any((f, r) in table for f in ("fastv_k1", "fastv_k2"))
    }
    result = {
        "model": str(path),
        "data": str(args.data),
        "n": len(samples),
        "views": args.views,
        "min_per_view": quota,
        "ratios": ratios,
        "unpruned": unpruned,
        "scores": {f"{m}@{r}": v for (m, r), v in table.items() if m != "unpruned"},
        "selector_minus_best_fastv": sel_vs_fastv,
        "timing_ms": {k: round(v, 3) for k, v in timing.items()},
        "answer_seconds": round(answer_s, 1),
        "plot": args.plot,
    }
    print(json.dumps(result, separators=(",", ":")))
    return result


if __name__ == "__main__":
    sys.exit(0 if main() else 1)
