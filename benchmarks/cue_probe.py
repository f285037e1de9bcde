"""Do drive-tiny's visual tokens carry an object's motion, light state and colour? A linear probe.

For every object on the synthetic frames, the visual tokens the decoder receives (after pixel shuffle
and the projector) over the cells the object covers are averaged into one feature; a logistic
regression is fitted on training frames (seed 0) and scored on held-out frames (seed 1), beside the
majority class. The same is done on the vision tower's own patch features (before pixel shuffle, four
times the cells) and on the raw input pixels of those patches (their mean and maximum over the
object), the most a linear reader could get from the tower's input. A cue the probe reads well but the
model answers at chance is lost in the decoder; a cue the probe cannot read is lost before it.

    python benchmarks/cue_probe.py --model drive-tiny --train-frames 800 --test-frames 200

Last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import time

import torch
import torch.nn.functional as F
from tqdm import tqdm


CUES = ("moving", "light", "colour")


def features(pipe, seed: int, frames: int, size=(400, 225)):
    """{cue: (token features (M, C), patch features (M, Cv), pixel features (M, 6 p p), labels (M,))} over
    every object of the frames; labels are 0/1 for moving, the LIGHT_STATES index for light, the colour's
    name for colour."""
    from litevlm.cameras import CAMERAS
    from litevlm.data.synthetic import LIGHT_STATES, MOVERS, VEHICLES, make_frame, render_views
    from litevlm.model.vlm import image_to_tiles
    from litevlm.train.vlm import cells_of

    model, cfg = pipe.model, pipe.cfg
    g, tpv = cfg.vision.grid, cfg.tiles_per_view
    out = {cue: ([], [], [], []) for cue in CUES}
    p = cfg.vision.image_size // g
    for i in tqdm(range(frames), desc=f"frames (seed {seed})"):
        frame = make_frame(seed, i)
        views = render_views(frame, size=size)
        pixels = torch.cat([image_to_tiles(views[c], cfg.vision.image_size, tpv) for c in CAMERAS])
        with torch.no_grad():
            patches = model.vision_tower(pixels)  # (6 tpv, g*g, Cv)
            tokens = model.encode_tiles(pixels)  # (6 tpv, g*g/4, C)
        tokens = tokens.reshape(len(CAMERAS), -1, tokens.shape[-1])
        patches = patches.reshape(len(CAMERAS), -1, patches.shape[-1])
        raw = pixels.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(len(CAMERAS), g * g * tpv, -1)
        for o in frame.objects:
            for cam, box in o.views.items():
                v = CAMERAS.index(cam)
                tok = sorted(cells_of(box.clipped(), g // 2, tpv))
                pat = sorted(cells_of(box.clipped(), g, tpv))
                if not tok or not pat:
                    continue
                ft, fp = tokens[v, tok].mean(0), patches[v, pat].mean(0)
                fr = torch.cat([raw[v, pat].mean(0), raw[v, pat].amax(0)])
                labels = []
                if o.cls in MOVERS:
                    labels.append(("moving", int(o.moving)))
                if o.light:
                    labels.append(("light", LIGHT_STATES.index(o.light)))
                if o.colour and o.cls in VEHICLES:
                    labels.append(("colour", o.colour))
                for cue, y in labels:
                    out[cue][0].append(ft)
                    out[cue][1].append(fp)
                    out[cue][2].append(fr)
                    out[cue][3].append(y)
    return out


def fit_and_score(xtr, ytr, xte, yte, classes: int, steps: int = 600) -> float:
    mu, sd = xtr.mean(0), xtr.std(0) + 1e-6
    xtr, xte = (xtr - mu) / sd, (xte - mu) / sd
    lin = torch.nn.Linear(xtr.shape[1], classes)
    opt = torch.optim.AdamW(lin.parameters(), lr=1e-2, weight_decay=1e-2)
    for _ in range(steps):
        opt.zero_grad()
        F.cross_entropy(lin(xtr), ytr).backward()
        opt.step()
    with torch.no_grad():
        return float((lin(xte).argmax(-1) == yte).float().mean())


def main() -> None:
    from litevlm.pipeline import Pipeline

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="drive-tiny")
    ap.add_argument("--train-frames", type=int, default=800)
    ap.add_argument("--test-frames", type=int, default=200)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.time()
    pipe = Pipeline.from_pretrained(args.model)
    train = features(pipe, 0, args.train_frames)
    test = features(pipe, 1, args.test_frames)
    rows = {}
    for cue in CUES:
        names = sorted(set(train[cue][3])) if cue == "colour" else None  # colours as class indices
        code = (lambda y: names.index(y)) if names else (lambda y: y)
        ytr = torch.tensor([code(y) for y in train[cue][3]])
        keep = [j for j, y in enumerate(test[cue][3]) if names is None or y in names]
        yte = torch.tensor([code(test[cue][3][j]) for j in keep])
        classes = int(ytr.max()) + 1
        majority = float((yte == torch.bincount(ytr, minlength=classes).argmax()).float().mean())
        row = {"train": len(ytr), "test": len(yte), "majority": round(majority, 3)}
        for name, k in (("tokens", 0), ("patches", 1), ("pixels", 2)):
            xtr = torch.stack(train[cue][k]).float()
            xte = torch.stack([test[cue][k][j] for j in keep]).float()
            row[name] = round(fit_and_score(xtr, ytr, xte, yte, classes), 3)
        rows[cue] = row
        print(f"{cue:8s} n={row['train']}/{row['test']}  majority {row['majority']:.3f}  "
              f"probe on visual tokens {row['tokens']:.3f}  on vision patches {row['patches']:.3f}  on pixels {row['pixels']:.3f}")
    print(json.dumps({"benchmark": "cue_probe", "model": args.model, "train_frames": args.train_frames,
                      "test_frames": args.test_frames, "cues": rows, "wall_s": round(time.time() - t0, 1)}))


if __name__ == "__main__":
    main()
