"""DriveLM's official score of a set of answers, and the `litevlm score` command.

The DriveLM challenge (OpenDriveLab/DriveLM, challenge/evaluation.py) scores a submission, a list of
{id, question, answer}, against a test file whose QA carry metric tags. Frame by frame, in the file's
order (perception, prediction, planning, behavior), the first answer's matched object coordinates
become the frame's graph and a later question counts only if every coordinate it names is in that
graph (the graph gate); each kept item goes to every bucket its tags name, and the final is
0.4 judge + 0.2 language + 0.2 match + 0.2 accuracy. `drivelm_score` computes that by default; a
result says whether its final is the official one, and why not when it is not (no judge, say).
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

from litevlm.errors import LiteVLMError
from litevlm.eval.metrics import score


def drivelm_score(records: Sequence[dict], judge=None, gate: bool = True, renormalise: bool = False) -> dict:
    """DriveLM scores of answered records, the official evaluation by default.

    Records are `litevlm.eval.metrics.score` records whose `tag` lists every tag of the item; items with no
    tag are not part of the official evaluation (the challenge's test set leaves them out) and are only
    counted (`unrouted`). gate=False scores every item; renormalise=True spreads the weight of a part that
    cannot be computed over the others (without a judge: the older one-third mix). `official` is True only
    for the official computation with a judge: gate on, official weights, every part present, every judge
    reply a number.
    """
    routed = [r for r in records if r["tag"] not in ((), [], None)]
    result = score(routed, judge=judge, gate=gate, renormalise=renormalise) if routed else _nothing(len(records))
    reasons = []
    if judge is None:
        reasons.append("no judge (pass --judge-endpoint and --judge-model)")
    if not gate:
        reasons.append("graph gate off")
    if renormalise:
        reasons.append("weights renormalised")
    if result["missing"] and judge is not None:
        reasons.append("no items for " + ", ".join(result["missing"]))
    if result["judge_unparsed"]:
        reasons.append(f"{result['judge_unparsed']} judge replies without a number")
    if result["final"] is None:
        reasons.append("nothing to score")
    official = not reasons
    head = "official DriveLM final" if official else "not the official DriveLM final: " + "; ".join(reasons)
    answers = [r["answer"] for r in records]
    if answers and not any(a.strip() for a in answers):
        head += "; every answer is empty"
    result["final_note"] = head + ("; " + result["final_note"] if result["final_note"] else "")
    result["official"] = official
    result["unrouted"] = len(records) - len(routed)
    result["n"] = len(records)
    result["scoring"] = {
        "gate": gate,
        "renormalise": renormalise,
        "judge": getattr(judge, "model", "custom") if judge is not None else None,
    }
    return result


def _nothing(n: int) -> dict:
    parts = ("accuracy", "language", "match", "judge")
    return {
        "n": n,
        "n_scored": 0,
        "gated_out": 0,
        "counts": {},
        **{name: None for name in parts},
        "judge_unparsed": 0,
        "final": None,
        "final_note": "no item carries a metric tag",
        "missing": list(parts),
    }


# ---------------------------------------------------------------------------------------------
# Files: a GT file (any DriveLM layout) and a submission list
# ---------------------------------------------------------------------------------------------


def record(sample, answer: str) -> dict:
    """The scoring record of one answered DriveLM sample; frames are keyed per scene, as the official loop."""
    return {
        "id": sample.id,
        "question": sample.question,
        "answer": answer,
        "gt": sample.answer,
        "tag": list(sample.tags),
        "closed": sample.closed,
        "frame": f"{sample.scene_id}_{sample.frame_id}",
    }


def has_answers(samples) -> bool:
    """Whether a DriveLM file holds GT answers (the released challenge questions hold none)."""
    return any(s.answer.strip() for s in samples)


def load_predictions(path) -> dict[str, str]:
    """id -> answer from a submission: a list of {id, question, answer} (or {"results": [...]}, the upload)."""
    p = Path(path)
    try:
        data = json.loads(p.read_text(encoding="utf-8"))
    except OSError as e:
        raise LiteVLMError(f"cannot read predictions {p}: {e.strerror or e}") from None
    except json.JSONDecodeError as e:
        raise LiteVLMError(f"{p}: malformed JSON at line {e.lineno}, column {e.colno}: {e.msg}") from None
    if isinstance(data, dict) and isinstance(data.get("results"), list):
        data = data["results"]
    if not isinstance(data, list):
        raise LiteVLMError(f"{p}: expected a list of {{id, question, answer}} (the challenge's submission format)")
    answers: dict[str, str] = {}
    for i, item in enumerate(data):
        if not isinstance(item, dict) or not isinstance(item.get("id"), str) or not isinstance(item.get("answer"), str):
            raise LiteVLMError(f"{p}: item {i} needs a string 'id' and a string 'answer'")
        if item["id"] in answers:
            raise LiteVLMError(f"{p}: id {item['id']!r} appears twice")
        answers[item["id"]] = item["answer"]
    return answers


def score_files(predictions, gt, judge=None, gate: bool = True, renormalise: bool = False) -> dict:
    """`drivelm_score` of a submission file against a GT file (challenge, training or llama layout)."""
    from litevlm.data.drivelm import load_samples

    samples = load_samples(gt, require_images=False)
    if not has_answers(samples):
        raise LiteVLMError(
            f"{gt} holds no answers (the released challenge questions have none): there is nothing to score against"
        )
    answers = load_predictions(predictions)
    missing = [s.id for s in samples if s.id not in answers]
    if missing:
        raise LiteVLMError(
            f"{predictions} has no answer for {len(missing)} of the {len(samples)} questions of {gt} "
            f"(first: {', '.join(missing[:3])}); the official evaluation needs every one"
        )
    result = drivelm_score([record(s, answers[s.id]) for s in samples], judge, gate, renormalise)
    extra = len(answers) - len(samples)
    if extra:
        result["final_note"] += f"; {extra} predictions with ids not in {gt} ignored"
    return result


def write_submission(path, samples, answers: Sequence[str]) -> Path:
    """Write the challenge's submission list [{id, question, answer}] for every sample, atomically."""
    if len(samples) != len(answers):
        raise LiteVLMError(f"{len(answers)} answers for {len(samples)} questions: a submission needs every one")
    items = [{"id": s.id, "question": s.question, "answer": a} for s, a in zip(samples, answers)]
    p = Path(path)
    tmp = p.with_name(p.name + ".part")
    tmp.write_text(json.dumps(items, indent=1, ensure_ascii=False), encoding="utf-8")
    tmp.replace(p)
    return p


# ---------------------------------------------------------------------------------------------
# Command line
# ---------------------------------------------------------------------------------------------

SCORE_HELP = """\
DriveLM's official score of a submission (the challenge's list of {id, question, answer}, made by any
model) against a DriveLM file with answers: the challenge's val/test layout (QA with "tag" lists), the
training layout (tags by the official rule) or a llama-adapter list.

By default the official computation: the graph gate (a frame's later questions count only if their
coordinates were matched by the frame's first answer), every tag an item carries, the official weights
0.4 judge + 0.2 language + 0.2 match + 0.2 accuracy, match = (coordinate F1 x 100 + judge) / 2.
The judge is any OpenAI-compatible endpoint, sent DriveLM's own prompt (0..100, number only):
    litevlm score --predictions output.json --gt test_eval.json \\
        --judge-endpoint http://127.0.0.1:8000/v1 --judge-model gpt-3.5-turbo --api-key-env OPENAI_API_KEY
Without a judge the final counts the judge's parts as 0 and the output says it is not the official
final. --no-gate and --renormalise give the older, unofficial mixes.
"""


def add_scoring_options(p) -> None:
    """The judge and scoring flags shared by `litevlm score` and `litevlm eval`."""
    g = p.add_argument_group("DriveLM scoring (default: the official evaluation)")
    g.add_argument("--judge-endpoint", default=None, metavar="URL", help="OpenAI-compatible base URL of the judge")
    g.add_argument("--judge-model", default=None, metavar="NAME", help="the judge's model name")
    g.add_argument(
        "--api-key-env", default=None, metavar="VAR", help="environment variable holding the judge's API key"
    )
    g.add_argument("--no-gate", action="store_true", help="score every question (not official: no graph gate)")
    g.add_argument(
        "--renormalise",
        action="store_true",
        help="spread the weight of a missing part (no judge) over the others (not official)",
    )


def scoring_from_args(args) -> dict:
    """judge, gate and renormalise for `drivelm_score` from the parsed flags."""
    from litevlm.eval.judge import Judge

    if (args.judge_endpoint is None) != (args.judge_model is None):
        raise LiteVLMError("a judge needs both --judge-endpoint and --judge-model")
    judge = None
    if args.judge_endpoint is not None:
        key = None
        if args.api_key_env:
            key = os.environ.get(args.api_key_env)
            if not key:
                raise LiteVLMError(f"--api-key-env {args.api_key_env}: that environment variable is not set")
        judge = Judge(args.judge_endpoint, args.judge_model, key)
    elif args.api_key_env:
        raise LiteVLMError("--api-key-env needs --judge-endpoint and --judge-model")
    return {"judge": judge, "gate": not args.no_gate, "renormalise": args.renormalise}


def print_scores(result: dict) -> None:
    """The scores as a few readable lines."""

    def f(value):
        return "-" if value is None else f"{value:.4f}"

    print(f"final     {f(result['final'])}   ({result['final_note']})")
    print(f"judge     {f(result['judge'])}   model {result['scoring']['judge'] or '-'}")
    print(f"language  {f(result['language'])}")
    print(f"match     {f(result['match'])}   coordinate F1 {f(result.get('match_f1'))}")
    print(f"accuracy  {f(result['accuracy'])}")
    counts = ", ".join(f"{k} {v}" for k, v in result["counts"].items())
    print(
        f"questions {result['n']}: {result['n_scored']} scored, {result['gated_out']} gated out, "
        f"{result['unrouted']} without a metric tag" + (f"; per bucket: {counts}" if counts else "")
    )
