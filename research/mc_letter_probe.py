"""Can drive-tiny's decoder map a known answer to its multiple-choice letter? A text-only probe.

    python research/mc_letter_probe.py --model src/litevlm/weights/drive-tiny --minutes 4

The colour is stated in the question ("The vehicle is red. What colour is the vehicle? Please select
the correct answer from the following options: A. Blue. B. Red. ..."), so the only thing to learn is
which letter names it. The decoder (from the given weights, no images) is fine-tuned on fresh random
questions of this form and scored every 100 steps on 256 new ones. The last stdout line is JSON.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch
import torch.nn.functional as F


def main() -> None:
    from litevlm.data.synthetic import COLOURS, MC_SUFFIX
    from litevlm.data.tokenizer import Tokenizer
    from litevlm.model.hf import load_native
    from litevlm.model.prompt import question_suffix

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="src/litevlm/weights/drive-tiny")
    ap.add_argument("--minutes", type=float, default=4.0)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=3e-4)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.manual_seed(0)
    model = load_native(args.model).float()
    tok = Tokenizer.from_dir(args.model)
    lm = model.language_model
    colours = list(COLOURS)
    rng = random.Random(0)

    def sample() -> tuple[list[int], int]:
        c = rng.choice(colours)
        others = rng.sample([x for x in colours if x != c], 3)
        slot = rng.randrange(4)
        opts = others[:slot] + [c] + others[slot:]
        q = f"The vehicle is {c}. What colour is the vehicle?{MC_SUFFIX} " + " ".join(
            f"{'ABCD'[i]}. {o.capitalize()}." for i, o in enumerate(opts)
        )
        return question_suffix(tok, tok.encode(q)), tok.encode("ABCD"[slot])[0]

    def batch(n: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        rows = [sample() for _ in range(n)]
        t = max(len(x) for x, _ in rows)
        ids = torch.full((n, t), tok.pad_id)
        for i, (x, _) in enumerate(rows):
            ids[i, t - len(x) :] = torch.tensor(x)  # left-padded: every answer row is the last one
        pos = torch.arange(t)[None].expand(n, t)
        return ids, pos, torch.tensor([y for _, y in rows])

    def letter_logits(ids, pos):
        return model.lm_head(lm(lm.embed_tokens(ids), pos)[:, -1])

    opt = torch.optim.AdamW(lm.parameters(), lr=args.lr, weight_decay=0.0)
    curve, step, t0 = [], 0, time.time()
    while time.time() - t0 < args.minutes * 60:
        ids, pos, y = batch(args.batch)
        loss = F.cross_entropy(letter_logits(ids, pos), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        step += 1
        if step % 100 == 0:
            with torch.no_grad():
                ids, pos, y = batch(256)
                acc = (letter_logits(ids, pos).argmax(-1) == y).float().mean().item()
            curve.append(
                {
                    "step": step,
                    "seconds": round(time.time() - t0, 1),
                    "loss": round(loss.item(), 4),
                    "accuracy": round(acc, 3),
                }
            )
            print(
                f"step {step:5d}  {curve[-1]['seconds']:6.1f} s  loss {loss.item():.3f}  "
                f"held-out letter accuracy {acc:.3f}",
                flush=True,
            )
    first = next((c["step"] for c in curve if c["accuracy"] >= 0.95), None)
    print(
        json.dumps(
            {
                "benchmark": "mc_letter_probe",
                "model": args.model,
                "steps": step,
                "minutes": args.minutes,
                "steps_to_95": first,
                "final_accuracy": curve[-1]["accuracy"] if curve else None,
                "curve": curve,
            }
        )
    )


if __name__ == "__main__":
    main()
