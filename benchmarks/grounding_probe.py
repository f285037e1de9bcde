"""Can a model's decoder learn to read its visual tokens? A focused test on closed questions.

Fine-tunes a checkpoint on closed questions (yes/no, multiple choice) whose needed views are at most
`--max-views`, prompted with those views only, and reports teacher-forced exact-match accuracy on
validation frames (seed 2) with the real images and with every view replaced by an empty road. A gap
that opens means the decoder uses what the visual tokens carry.

--tokens real: the vision tower's own tokens (trained along).
--tokens oracle: each token is a fixed random projection of its cell's true contents (the dense
    targets of `litevlm.train.vlm.aux_targets`), the best the vision side could hand over; it
    separates "the decoder cannot learn to read" from "the tokens do not carry it".

    python benchmarks/grounding_probe.py --model drive-tiny --tokens oracle --steps 300

Last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
import torch.nn.functional as F


def build_items(tok, seed: int, start: int, frames: int, max_views: int, all_views: bool = False, size=(400, 225)):
    from litevlm.cameras import CAMERAS
    from litevlm.data.synthetic import make_frame, render_views
    from litevlm.model.prompt import build_prompt
    from litevlm.model.vlm import image_to_tiles
    from litevlm.train.vlm import aux_targets

    items = []
    for i in range(frames):
        frame = make_frame(seed, start + i)
        views = render_views(frame, size=size)
        cells = aux_targets(frame, 4, 1).float()
        for q in frame.qas:
            if q.closed and len(q.views) <= max_views:
                vs = list(CAMERAS) if all_views else list(q.views)
                items.append(
                    {
                        "pixels": torch.cat([image_to_tiles(views[c], 112, 1) for c in vs]),
                        "cells": torch.cat([cells[CAMERAS.index(c)] for c in vs]),
                        "prompt": build_prompt(tok, q.question, vs, 16).ids,
                        "answer": tok.encode(q.answer) + [tok.eos_id],
                    }
                )
    return items


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="drive-tiny")
    ap.add_argument("--tokens", choices=("real", "oracle"), default="real")
    ap.add_argument("--fresh-decoder", action="store_true", help="re-initialise the decoder first")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--batch", type=int, default=16)
    ap.add_argument("--lr", type=float, default=1e-3)
    ap.add_argument("--frames", type=int, default=600, help="training frames (seed 0, from frame 40000)")
    ap.add_argument("--val-frames", type=int, default=30, help="validation frames (seed 2)")
    ap.add_argument("--max-views", type=int, default=2)
    ap.add_argument("--all-views", action="store_true", help="prompt with all six views, not only the needed ones")
    ap.add_argument("--every", type=int, default=50)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)

    from litevlm.data.synthetic import render_empty_road
    from litevlm.data.tokenizer import Tokenizer
    from litevlm.model.hf import load_native
    from litevlm.model.vlm import image_to_tiles
    from litevlm.models import resolve_model_dir
    from litevlm.train.vlm import aux_fields, init_language

    path = resolve_model_dir(args.model)
    model, tok = load_native(path).float(), Tokenizer.from_dir(path)
    if args.fresh_decoder:
        init_language(model, 0)
    width = model.cfg.text.hidden_size
    project = torch.randn(len(aux_fields()), width, generator=torch.Generator().manual_seed(0)) * 0.5
    empty = image_to_tiles(render_empty_road(size=(400, 225))["CAM_FRONT"], 112, 1)
    train = build_items(tok, 0, 40000, args.frames, args.max_views, args.all_views)
    val = build_items(tok, 2, 500, args.val_frames, args.max_views, args.all_views)

    def visual(batch, blank: bool) -> torch.Tensor:
        if args.tokens == "oracle":
            return torch.cat([(torch.zeros_like(b["cells"]) if blank else b["cells"]) @ project + 0.1 for b in batch])
        pixels = torch.cat([empty.expand(b["pixels"].shape[0], -1, -1, -1) if blank else b["pixels"] for b in batch])
        return model.encode_tiles(pixels).reshape(-1, width)

    def forward(batch, blank: bool = False):
        t = max(len(b["prompt"]) + len(b["answer"]) for b in batch)
        ids = torch.full((len(batch), t), tok.pad_id)
        labels = torch.full((len(batch), t), -100)
        for i, b in enumerate(batch):
            seq = b["prompt"] + b["answer"]
            ids[i, : len(seq)] = torch.tensor(seq)
            labels[i, len(b["prompt"]) - 1 : len(seq) - 1] = torch.tensor(b["answer"])
        x = model.embed(ids, visual(batch, blank))
        hidden = model.language_model(x, torch.arange(t)[None].expand(len(batch), -1))
        return model.lm_head(hidden), labels

    @torch.no_grad()
    def accuracy(blank: bool) -> float:
        model.eval()
        hits = 0
        for i in range(0, len(val), 16):
            logits, labels = forward(val[i : i + 16], blank)
            pred = logits.argmax(-1)
            hits += sum(
                bool((pred[j][labels[j] != -100] == labels[j][labels[j] != -100]).all()) for j in range(len(labels))
            )
        model.train()
        return round(hits / len(val), 4)

    opt = torch.optim.AdamW(model.parameters(), lr=args.lr, weight_decay=0.0)
    rng = random.Random(0)
    curve = [{"step": 0, "images": accuracy(False), "empty": accuracy(True)}]
    print(f"{len(train)} training and {len(val)} validation questions; step 0: {curve[-1]}", flush=True)
    t0 = time.time()
    for step in range(1, args.steps + 1):
        logits, labels = forward(rng.sample(train, args.batch))
        loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        if step % args.every == 0 or step == args.steps:
            curve.append(
                {"step": step, "loss": round(loss.item(), 4), "images": accuracy(False), "empty": accuracy(True)}
            )
            print(f"step {step}: {curve[-1]} ({time.time() - t0:.0f} s)", flush=True)
    last = curve[-1]
    print(
        json.dumps(
            {
                "benchmark": "grounding_probe",
                "model": str(args.model),
                "tokens": args.tokens,
                "fresh_decoder": args.fresh_decoder,
                "all_views": args.all_views,
                "lr": args.lr,
                "train_questions": len(train),
                "val_questions": len(val),
                "gap": round(last["images"] - last["empty"], 4),
                "curve": curve,
            },
            separators=(",", ":"),
        )
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
