"""Do drive-tiny's visual tokens carry an object's motion, light state and colour? A linear probe.

For every object on the synthetic frames, the visual tokens the decoder receives (after pixel shuffle
and the projector) over the cells the object covers are averaged into one feature; a logistic
regression is fitted on training frames (seed 0) and scored on held-out frames (seed 1), beside the
majority class. The same is done on the vision tower's own patch features (before pixel shuffle, four
times the cells) and on the raw input pixels of those patches (their mean and maximum over the
object). A small convolutional network trained on each object's crop of the input tile (with an object
width of margin on either side, where a motion trail is drawn) says whether the tile's pixels carry the
cue at all. A cue the probe reads well but the model answers at chance is lost in the decoder; a cue the
probe cannot read is lost before it.

    python research/cue_probe.py --model drive-tiny --train-frames 800 --test-frames 200

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
CROP = (16, 48)  # (h, w) of an object's crop for the CNN, resized from
CROP_MARGIN = 1.2  # the object and this many object widths either side (where a motion trail is drawn)


def crop_reader_score(xtr, ytr, xte, yte, classes: int, epochs: int = 12) -> float:
    """Test accuracy of a small CNN trained on the crops (N, 3, h, w)."""
    net = torch.nn.Sequential(
        torch.nn.Conv2d(3, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.Conv2d(32, 32, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.MaxPool2d(2),
        torch.nn.Conv2d(32, 64, 3, padding=1),
        torch.nn.ReLU(),
        torch.nn.AdaptiveMaxPool2d(1),
        torch.nn.Flatten(),
        torch.nn.Linear(64, classes),
    )
    opt = torch.optim.AdamW(net.parameters(), lr=2e-3, weight_decay=1e-4)
    for _ in range(epochs):
        for idx in torch.randperm(len(xtr)).split(128):
            opt.zero_grad()
            F.cross_entropy(net(xtr[idx]), ytr[idx]).backward()
            opt.step()
    with torch.no_grad():
        return float((net(xte).argmax(-1) == yte).float().mean())


def features(pipe, seed: int, frames: int, size=(400, 225), margin: float = 0.0):
    """{cue: (token features (M, C), patch features (M, Cv), pixel features (M, 6 p p), crops (M, 3, h, w),
    labels (M,))} over every object of the frames; labels are 0/1 for moving, the LIGHT_STATES index for
    light, the colour's name for colour. margin: the linear probes pool over the object's box widened by this
    many object widths on either side (a motion trail is drawn beside the object, outside its box)."""
    from litevlm.cameras import CAMERAS, IMAGE_HEIGHT, IMAGE_WIDTH
    from litevlm.data.synthetic import LIGHT_STATES, MOVERS, VEHICLES, make_frame, render_views
    from litevlm.model.vlm import image_to_tiles
    from litevlm.train.vlm import cells_of

    model, cfg = pipe.model, pipe.cfg
    g, tpv = cfg.vision.grid, cfg.tiles_per_view
    out = {cue: ([], [], [], [], []) for cue in CUES}
    s = cfg.vision.image_size
    p = s // g  # pixels per patch side
    for i in tqdm(range(frames), desc=f"frames (seed {seed})"):
        frame = make_frame(seed, i)
        views = render_views(frame, size=size)
        pixels = torch.cat([image_to_tiles(views[c], s, tpv) for c in CAMERAS])
        with torch.no_grad():
            tokens, patches = model.encode_tiles_and_patches(pixels)  # (6 tpv, g*g/4, C), (6 tpv, g*g, Cv)
        tokens = tokens.reshape(len(CAMERAS), -1, tokens.shape[-1])
        patches = patches.reshape(len(CAMERAS), -1, patches.shape[-1])
        raw = pixels.unfold(2, p, p).unfold(3, p, p).permute(0, 2, 3, 1, 4, 5).reshape(len(CAMERAS), g * g * tpv, -1)
        for o in frame.objects:
            for cam, box in o.views.items():
                v = CAMERAS.index(cam)
                u0, v0, u1, v1 = box.clipped()
                w = u1 - u0
                pooled = (max(0.0, u0 - margin * w), v0, min(IMAGE_WIDTH - 0.1, u1 + margin * w), v1)
                tok = sorted(cells_of(pooled, g // 2, tpv))
                pat = sorted(cells_of(pooled, g, tpv))
                if not tok or not pat:
                    continue
                ft, fp = tokens[v, tok].mean(0), patches[v, pat].mean(0)
                fr = torch.cat([raw[v, pat].mean(0), raw[v, pat].amax(0)])
                x0 = max(0, int((u0 - CROP_MARGIN * w) / IMAGE_WIDTH * s * tpv))
                x1 = min(s * tpv, int((u1 + CROP_MARGIN * w) / IMAGE_WIDTH * s * tpv) + 1)
                y0, y1 = max(0, int(v0 / IMAGE_HEIGHT * s)), min(s, int(v1 / IMAGE_HEIGHT * s) + 1)
                view = pixels[v * tpv : (v + 1) * tpv].permute(1, 2, 0, 3).reshape(3, s, s * tpv)  # tiles side by side
                crop = F.interpolate(
                    view[None, :, y0 : max(y1, y0 + 1), x0 : max(x1, x0 + 1)],
                    size=CROP,
                    mode="bilinear",
                    align_corners=False,
                )[0]
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
                    out[cue][3].append(crop)
                    out[cue][4].append(y)
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
    ap.add_argument(
        "--margin",
        type=float,
        default=0.0,
        help="the linear probes pool over the object's box widened by this many object widths either side",
    )
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    t0 = time.time()
    pipe = Pipeline.from_pretrained(args.model)
    train = features(pipe, 0, args.train_frames, margin=args.margin)
    test = features(pipe, 1, args.test_frames, margin=args.margin)
    rows = {}
    for cue in CUES:
        names = sorted(set(train[cue][4])) if cue == "colour" else None  # colours as class indices
        code = (lambda y: names.index(y)) if names else (lambda y: y)
        ytr = torch.tensor([code(y) for y in train[cue][4]])
        keep = [j for j, y in enumerate(test[cue][4]) if names is None or y in names]
        yte = torch.tensor([code(test[cue][4][j]) for j in keep])
        classes = int(ytr.max()) + 1
        majority = float((yte == torch.bincount(ytr, minlength=classes).argmax()).float().mean())
        row = {"train": len(ytr), "test": len(yte), "majority": round(majority, 3)}
        for name, k in (("tokens", 0), ("patches", 1), ("pixels", 2)):
            xtr = torch.stack(train[cue][k]).float()
            xte = torch.stack([test[cue][k][j] for j in keep]).float()
            row[name] = round(fit_and_score(xtr, ytr, xte, yte, classes), 3)
        crops_tr, crops_te = torch.stack(train[cue][3]), torch.stack([test[cue][3][j] for j in keep])
        row["crop_cnn"] = round(crop_reader_score(crops_tr, ytr, crops_te, yte, classes), 3)
        rows[cue] = row
        print(
            f"{cue:8s} n={row['train']}/{row['test']}  majority {row['majority']:.3f}  "
            f"probe on visual tokens {row['tokens']:.3f}  on vision patches {row['patches']:.3f}  "
            f"on pixels {row['pixels']:.3f}  "
            f"CNN on crops {row['crop_cnn']:.3f}"
        )
    print(
        json.dumps(
            {
                "benchmark": "cue_probe",
                "model": args.model,
                "train_frames": args.train_frames,
                "test_frames": args.test_frames,
                "margin": args.margin,
                "cues": rows,
                "wall_s": round(time.time() - t0, 1),
            }
        )
    )


if __name__ == "__main__":
    main()
