"""Does a cue reach the row that answers? Linear probes on the answer row's hidden state, layer by layer.

    python research/answer_row_probe.py --model drive-tiny --data DIR [--train-share 0.7]

For every closed question of a family, the prompt is built as the pipeline builds it (the ViewSelector's views,
no pruning) and run through the decoder once. The last prompt row, the one whose next token is the answer, is
kept after the embeddings and after each decoder layer. A ridge classifier per layer, fitted on one part of the
questions and scored on the rest, says whether that row can tell:
  - is_moving: whether the tagged object moves (from the answer and the question's polarity: "moving?" or
    "stationary?"), and the answer itself (Yes / No);
  - light_state: the light's state (red / yellow / green), at the row before the colour word of the answer
    "The traffic light is <state>.", teacher-forced.
A cue the visual tokens carry but the answer row never does is lost between them; one the row carries but the
answer ignores is lost in the last layers. The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import json
import re

import torch

from litevlm.data.drivelm import load_images, load_samples
from litevlm.pipeline import Pipeline

MOVING_Q = re.compile(r"\b(moving|in motion)\b", re.IGNORECASE)
STATES = ("red", "yellow", "green")


def layer_rows(pipe: Pipeline, question: str, images, answer_prefix: str = "") -> torch.Tensor:
    """(layers + 1, C): the hidden state of the row that predicts the next token after the prompt (and after
    `answer_prefix`, teacher-forced), after the embeddings and after each decoder layer."""
    model, tok = pipe.model, pipe.tokenizer
    x = pipe.prompt(question, images).embeds
    if answer_prefix:
        x = torch.cat([x, model.embed(torch.tensor([tok.encode(answer_prefix)]), None)], 1)
    n = x.shape[1]
    lm = model.language_model
    lm.setup_cache(1, n + 8)
    rows = [x[0, -1]]
    hooks = [layer.register_forward_hook(lambda _m, _i, out: rows.append(out[0, -1])) for layer in lm.layers]
    try:
        lm(x, torch.arange(n)[None], slots=torch.arange(n), mask=None, kv_len=n)
    finally:
        for h in hooks:
            h.remove()
    return torch.stack(rows)


def ridge_accuracy(x: torch.Tensor, y: torch.Tensor, n_train: int, classes: int, lam: float) -> float:
    """Fit one-vs-rest ridge on the first n_train rows, accuracy on the rest."""
    mu, sd = x[:n_train].mean(0), x[:n_train].std(0) + 1e-6
    z = (x - mu) / sd
    z = torch.cat([z, torch.ones(len(z), 1)], 1)
    onehot = torch.nn.functional.one_hot(y, classes).float() * 2 - 1
    a = z[:n_train]
    w = torch.linalg.solve(a.T @ a + lam * torch.eye(a.shape[1]), a.T @ onehot[:n_train])
    pred = (z[n_train:] @ w).argmax(1)
    return float((pred == y[n_train:]).float().mean())


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="drive-tiny")
    ap.add_argument("--data", required=True)
    ap.add_argument("--train-share", type=float, default=0.7)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--lam", type=float, default=50.0, help="ridge penalty (features are standardised)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)

    pipe = Pipeline.from_pretrained(args.model, select_views=True)
    samples = load_samples(args.data)
    tasks = {"is_moving": [], "light_state": []}
    for s in samples:
        if s.family == "is_moving":
            yes = s.answer.strip().lower().startswith("yes")
            moving = yes == bool(MOVING_Q.search(s.question))
            tasks["is_moving"].append((s, "", {"moves": int(moving), "answer": int(yes)}))
        elif s.family == "light_state":
            state = next((k for k, w in enumerate(STATES) if w in s.answer.lower()), None)
            if state is not None:
                tasks["light_state"].append((s, "The traffic light is", {"state": state}))

    result = {"model": args.model, "data": str(args.data), "lam": args.lam, "families": {}}
    for family, items in tasks.items():
        if len(items) < 20:
            print(f"{family}: only {len(items)} questions, skipped")
            continue
        feats = torch.stack(
            [layer_rows(pipe, s.question, load_images(s), prefix) for s, prefix, _ in items]
        )  # (N, L+1, C)
        n_train = int(len(items) * args.train_share)
        out = {"questions": len(items)}
        for label in items[0][2]:
            y = torch.tensor([lab[label] for *_, lab in items])
            classes = int(y.max()) + 1
            majority = float(torch.bincount(y[n_train:], minlength=classes).max()) / (len(y) - n_train)
            per_layer = [
                round(ridge_accuracy(feats[:, i], y, n_train, classes, args.lam), 3) for i in range(feats.shape[1])
            ]
            out[label] = {"majority": round(majority, 3), "by_layer": per_layer}
            print(f"{family:12s} {label:7s} majority {majority:.3f}  after embeddings, layers 1..: {per_layer}")
        result["families"][family] = out
    print(json.dumps(result))


if __name__ == "__main__":
    main()
