"""drive-tiny on a held-out synthetic split: DriveLM scores with the real images and with every camera
replaced by an empty road (does the model look?), closed-question accuracy per family, and the baseline
stage-latency table. Writes the model card (MODEL.md) beside the weights; last stdout line is JSON.

    python benchmarks/drive_tiny_eval.py --model drive-tiny --data .bench-data/heldout [--n 680] [--select-views]

--select-views answers through the model's ViewSelector, as LiteVLM does (the stage table is then that
pipeline's, not the baseline's).
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import time
from collections import defaultdict
from pathlib import Path

import torch

from litevlm.eval.metrics import normalize_answer
from litevlm.eval.run import evaluate
from litevlm.models import resolve_model_dir
from litevlm.pipeline import STAGES, Pipeline
from litevlm.train.vlm import HEAD_OBJECTIVES


def per_family(records, samples_by_id) -> dict:
    hits = defaultdict(list)
    for r in records:
        if r["closed"]:
            hits[samples_by_id[r["id"]].family or "?"].append(
                normalize_answer(r["answer"]) == normalize_answer(r["gt"])
            )
    return {k: round(sum(v) / len(v), 3) for k, v in sorted(hits.items())}


def stage_table(records_timings) -> dict:
    med = {s: statistics.median(t[s] for t in records_timings) for s in (*STAGES, "total")}
    med["share"] = {s: round(med[s] / med["total"], 3) for s in STAGES}
    return med


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--model", default="drive-tiny")
    ap.add_argument("--data", required=True)
    ap.add_argument("--n", type=int, default=None)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--select-views",
        action="store_true",
        help="answer through the model's ViewSelector (only the views each question needs are encoded)",
    )
    ap.add_argument("--no-card", action="store_true")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)

    from litevlm.data.drivelm import load_samples

    samples = {s.id: s for s in load_samples(args.data)}
    pipe = Pipeline.from_pretrained(args.model, select_views=args.select_views)
    t0 = time.time()
    # The synthetic questions are asked one by one, not as one conversation per frame: every question is
    # scored (no graph gate) and, without a judge, the other parts share its weight (not DriveLM's official final).
    legacy = {"gate": False, "renormalise": True}
    full = evaluate(pipe, args.data, limit=args.n, **legacy)
    blank = evaluate(pipe, args.data, limit=args.n, blank=True, **legacy)
    # Latency: the pipeline re-run on the first 60 questions, medians per stage (warm).
    timings = []
    from litevlm.data.drivelm import load_images

    for s in list(samples.values())[:60]:
        timings.append(pipe.answer(s.question, load_images(s)).timings_ms)
    table = stage_table(timings[5:])
    keys = (
        "n",
        "final",
        "accuracy",
        "language",
        "match",
        "judge",
        "closed_accuracy",
        "views_per_question",
        "visual_tokens",
    )
    result = {
        "model": args.model,
        "data": str(args.data),
        "pipeline": pipe.config_name,
        "full": {k: full.get(k) for k in keys},
        "blank": {k: blank.get(k) for k in keys},
        "closed_accuracy_gap": round(full["closed_accuracy"] - blank["closed_accuracy"], 4),
        "per_family_closed": per_family(full["records"], samples),
        "per_family_closed_blank": per_family(blank["records"], samples),
        "final_note": full.get("final_note"),
        "latency_ms": table,
        "machine": f"{platform.machine()} {torch.get_num_threads()} threads, torch {torch.__version__}",
        "eval_seconds": round(time.time() - t0, 1),
    }
    print(
        f"closed-question accuracy: {full['closed_accuracy']:.3f} with images, "
        f"{blank['closed_accuracy']:.3f} with empty roads"
    )
    print(f"DriveLM final (no judge): {full['final']:.4f}   blank: {blank['final']:.4f}")
    print("stage medians (ms): " + ", ".join(f"{s} {table[s]:.1f} ({100 * table['share'][s]:.0f}%)" for s in STAGES))
    if not args.no_card:
        write_card(resolve_model_dir(args.model), result)
    print(json.dumps(result, separators=(",", ":")))


# VLMRecipe fields that `litevlm train vlm` takes as flags (the rest are in the full recipe JSON).
FLAGS = (
    "frames",
    "seed",
    "first_frame",
    "minutes",
    "batch_frames",
    "threads",
    "lr",
    "warmup",
    "closed_weight",
    "init",
    "reinit_vision",
    "reinit_language",
    "aux_weight",
    "aux_scale",
    "patch_aux_weight",
    "token_probe_weight",
    "vision_warmup",
    "view_subset_prob",
    "token_drop_prob",
    "token_drop_min_keep",
    "token_drop_selector",
    "token_drop_ratios",
    "visual_norm",
    "probe_frames",
    "grow_after",
    "unshuffle",
    "tiles",
    "name",
    "store_dtype",
    "light_contrast",
    *(f"{n}_{k}" for n in HEAD_OBJECTIVES for k in ("weight", "layer")),
)
# What the model card calls each head objective.
OBJECTIVE_LABELS = {
    "attn": "tag attention",
    "option": "option attention",
    "letter": "letter attention",
    "readout": "answer readout",
}


def train_command(recipe: dict) -> str:
    """The `litevlm train vlm` command line that reproduces a recipe (flags that differ from the defaults)."""
    from litevlm.train.vlm import VLMRecipe

    default = VLMRecipe()
    parts = ["litevlm train vlm --out DIR"]
    for name in FLAGS:
        value, unset = recipe.get(name, getattr(default, name)), getattr(default, name)
        if isinstance(unset, tuple) and isinstance(value, list):  # JSON gives lists where the recipe holds tuples
            value = tuple(value)
        if value == unset or (name.endswith("_layer") and not recipe.get(name.replace("layer", "weight"))):
            continue
        flag = "--" + name.replace("_", "-")
        words = " ".join(map(str, value)) if isinstance(value, (list, tuple)) else value
        parts.append(flag if value is True else f"{flag} {words}")
    parts += [f"--family-weight {k}={v:g}" for k, v in (recipe.get("family_weights") or {}).items()]
    return " ".join(parts)


def stages(meta: dict) -> list[str]:
    """The `--init` chain behind the weights (oldest first), with what each stage re-initialised; the stages of an
    averaged checkpoint (`litevlm train average`) follow the lineage they share, marked "mean of"."""
    last = {
        "checkpoint": "(these weights)",
        "steps": meta.get("steps"),
        "train_seconds": meta.get("train_seconds"),
        "recipe": meta.get("recipe", {}),
        "looks_probe": meta.get("looks_probe"),
        "averaged": meta.get("averaged"),
    }
    chain = [
        part
        for st in [*meta.get("lineage", []), last]  # an averaged stage (these weights or one before): a row per part
        for part in ([{**a, "mean": True} for a in st["averaged"]] if st.get("averaged") else [st])
    ]
    if len(chain) == 1:
        return []
    lines = [
        "## Training stages",
        "",
        "Each stage continued from the one before (`--init`); a re-initialised part starts afresh there.",
        *(
            [
                'Adjacent rows marked "mean of" each continued from the stage before them; their element-wise mean '
                "is these weights, or the checkpoint the next stage continued from."
            ]
            if any(st.get("mean") for st in chain)
            else []
        ),
        "",
        "| stage | steps | minutes | re-initialised | lr | closed weight | view-subset share | other | "
        "looks-probe at the end, six views (images / empty) | needed views (images / empty) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for i, st in enumerate(chain, start=1):
        r = st.get("recipe") or {}
        fresh = (
            "everything"
            if not r.get("init")
            else ", ".join([x for x, k in (("vision", "reinit_vision"), ("decoder", "reinit_language")) if r.get(k)])
            or "-"
        )
        probe = (st.get("looks_probe") or [{}])[-1]
        other = [f"decoder grown after layers {', '.join(map(str, r['grow_after']))}"] if r.get("grow_after") else []
        if r.get("unshuffle"):
            other.append(f"no pixel shuffle (one token a patch, projector folded), {r.get('tiles') or 1} tiles a view")
        if r.get("token_drop_prob") and r.get("token_drop_selector"):
            ratios = "/".join(f"{x:g}" for x in r.get("token_drop_ratios") or (0.1, 0.2, 0.3))
            other.append(
                f"visual tokens thinned in {r['token_drop_prob']:.0%} of frames by the TokenSelector (r = {ratios}, "
                "one question a frame)"
            )
        elif r.get("token_drop_prob"):
            keep = r.get("token_drop_min_keep", 0.3)
            other.append(f"visual tokens thinned in {r['token_drop_prob']:.0%} of frames (keep {keep:.0%}-95%)")
        other += [f"{k} x{v:g}" for k, v in (r.get("family_weights") or {}).items()]
        other += [
            f"{OBJECTIVE_LABELS[n]} {r[n + '_weight']:g} (layer {r.get(n + '_layer')})"
            for n in HEAD_OBJECTIVES
            if r.get(n + "_weight")
        ]
        other += ["light-colour contrast questions"] if r.get("light_contrast") else []
        label = f"{i} (mean of)" if st.get("mean") else i
        lines.append(
            f"| {label} | {st.get('steps')} | {(st.get('train_seconds') or 0) / 60:.1f} | {fresh} | {r.get('lr')} | "
            f"{r.get('closed_weight')} | {r.get('view_subset_prob')} | {', '.join(other) or '-'} "
            f"| {probe.get('images', '-')} / {probe.get('empty', '-')} | "
            f"{probe.get('images_needed', '-')} / {probe.get('empty_needed', '-')} |"
        )
    total = sum((st.get("train_seconds") or 0) for st in chain) / 60
    lines += ["", f"Total training time over all stages: {total:.0f} min.", ""]
    return lines


HISTORY = "## Training history"
FOOTER = "Produced by `python benchmarks/drive_tiny_eval.py`."  # the last generated line of a card


def kept_history(card: Path) -> list[str]:
    """The hand-written sections at the end of an existing card (what follows its generated part, whatever their
    headings: the training history, where the model stands), kept when the card is rewritten. A card without the
    generated footer keeps its training history."""
    if not card.exists():
        return []
    text = card.read_text()
    if FOOTER in text:
        tail = text[text.index(FOOTER) + len(FOOTER) :].strip()
    else:
        tail = text[text.index(HISTORY) :].rstrip() if HISTORY in text else ""
    return ["", *tail.splitlines()] if tail else []


INTROS = {  # what each bundled model is for, above its card's figures
    "drive-tiny": [
        "An InternVL-architecture vision-language model trained from scratch by `litevlm train vlm` on the",
        "project's synthetic six-camera driving world. It is litevlm's embedded default model.",
    ],
    "drive-hd": [
        "The embedded model shaped like the paper's workload: drive-tiny's towers, each camera cut into two 112 px",
        "tiles and no pixel shuffle, so 128 visual tokens a camera and 768 of an all-views prompt's 851 tokens (90%;",
        "drive-tiny's are half text). It is the model of the figures that depend on that share: token selection",
        "against the training-free pruners, and Table 1. It started from drive-tiny's weights, its projector folded",
        "for one token a patch (`--unshuffle`: a uniform 2x2 block maps to the token it made before).",
    ],
}


def write_card(model_dir: Path, result: dict) -> None:
    meta = json.loads((model_dir / "config.json").read_text())
    parts = meta.get("averaged") or [meta]
    recipe = parts[-1].get("recipe", {})
    f, b = result["full"], result["blank"]
    lines = [
        f"# {model_dir.name}",
        "",
        *INTROS.get(
            model_dir.name,
            [
                "An InternVL-architecture vision-language model trained by `litevlm train vlm` on the project's",
                "synthetic six-camera driving world.",
            ],
        ),
        "",
        "## Shapes",
        "",
        "```json",
        json.dumps(meta["litevlm"], indent=1),
        "```",
        "",
        "## Recipe",
        "",
    ]
    if meta.get("averaged"):
        lines.append(
            f"- the element-wise mean of {len(parts)} stages, each continued from the same checkpoint: "
            f"`litevlm train average {' '.join(f'STAGE{i}' for i in range(1, len(parts) + 1))} --out DIR`"
        )
    for i, part in enumerate(parts, start=1):
        r = part.get("recipe", {})
        name = f"stage {i} of the mean" if meta.get("averaged") else "last stage"
        lines.append(
            f"- command ({name}): `{train_command(r)}`; {part.get('steps')} steps, "
            f"{(part.get('train_seconds') or 0) / 60:.1f} min on one core of the 2-core CPU machine"
        )
    lines += [
        f"- data: {recipe.get('frames')} synthetic frames of seed {recipe.get('seed')} (indices "
        f"{recipe.get('first_frame', 0)}..{recipe.get('first_frame', 0) + recipe.get('frames', 1) - 1}), "
        f"every QA family, rendered at {recipe.get('render_size')} then resized like inference input",
        f"- full recipe: `{json.dumps(recipe)}`",
        "",
        *stages(meta),
        "## Scores (held-out split: seed 1, scenes never trained on)",
        "",
        f"Data: `{result['data']}`, {f['n']} questions, pipeline `{result['pipeline']}`. DriveLM scoring "
        f"without a judge ({result['final_note']}).",
        "",
        "| | final | accuracy | language | match | closed-question accuracy |",
        "|---|---|---|---|---|---|",
        f"| with the camera images | {f['final']:.4f} | {f['accuracy']:.4f} | {f['language']:.4f} "
        f"| {f['match']:.4f} | {f['closed_accuracy']:.4f} |",
        f"| every image an empty road | {b['final']:.4f} | {b['accuracy']:.4f} | {b['language']:.4f} "
        f"| {b['match']:.4f} | {b['closed_accuracy']:.4f} |",
        "",
        "Closed-question accuracy per family (with images / empty roads):",
        "",
        "| family | images | empty road |",
        "|---|---|---|",
    ]
    for k, v in result["per_family_closed"].items():
        lines.append(f"| {k} | {v} | {result['per_family_closed_blank'].get(k)} |")
    t = result["latency_ms"]
    lines += [
        "",
        f"Stage latency, pipeline `{result['pipeline']}` ({result['machine']}): "
        + ", ".join(f"{s} {t[s]:.1f} ms ({100 * t['share'][s]:.0f}%)" for s in STAGES)
        + f", total {t['total']:.1f} ms.",
        "",
        FOOTER,
        *kept_history(model_dir / "MODEL.md"),
    ]
    (model_dir / "MODEL.md").write_text("\n".join(lines) + "\n")


if __name__ == "__main__":
    main()
