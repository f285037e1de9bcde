"""The `litevlm` command line: every command in one table, `COMMANDS`. Every command with `--json` ends its
standard output with one JSON line.

A command is its help line, a function that adds its arguments and a function that runs it; a group holds
commands. Pipeline options come from `litevlm.options`, recipe flags are generated from the recipe dataclasses
(`litevlm.options.add_recipe_options`), and what a command runs is imported only when it runs.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from litevlm.errors import LiteVLMError
from litevlm.options import add_pipeline_options, add_recipe_options, pipeline_from_args, recipe_from_args
from litevlm.presets import BACKENDS


@dataclass(frozen=True)
class Command:
    help: str
    add_arguments: Callable[[argparse.ArgumentParser], None]
    run: Callable[[argparse.Namespace], None]


@dataclass(frozen=True)
class Group:
    help: str
    commands: dict[str, Command]


def _print_json(obj) -> None:
    print(json.dumps(obj, separators=(",", ":")))


@contextlib.contextmanager
def _ranks(args: argparse.Namespace):
    """This process's place in a `torchrun` job (a world of one without torchrun): `args.device` becomes the rank's
    own device (its GPU under torchrun on GPUs), and the process group is closed when the work is done."""
    from litevlm.dist import close, init_dist

    d = init_dist(args.device)
    args.device = d.device
    try:
        yield d
    except BaseException:
        close(d, synced=False)
        raise
    close(d)


def _positive_int(text: str) -> int:
    """An argparse type: a whole number of at least 1."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be a whole number of at least 1; got {text!r}")
    return value


def _json_flag(p: argparse.ArgumentParser, help: str | None = None) -> None:
    p.add_argument("--json", action="store_true", help=help or "end the output with one JSON line")


# ------------------------------------------------------------------------------------------------
# demo, ask, views
# ------------------------------------------------------------------------------------------------
def demo_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--model",
        default="drive-hd",
        help="a bundled model's name or a checkpoint folder (default: %(default)s; drive-tiny is the smaller one)",
    )
    p.add_argument("--seed", type=int, default=2026, help="the synthetic scene's seed")
    p.add_argument("--questions", type=int, default=6)
    p.add_argument("--out", default="demo.png", help="where to save the 2x3 picture of the six views")
    p.add_argument(
        "--explain",
        default=None,
        metavar="FIG.png",
        help="where to draw what LiteVLM kept for one answer (default: demo_explain.png beside --out)",
    )
    only = p.add_mutually_exclusive_group()
    only.add_argument("--baseline-only", action="store_true", help="only the baseline (six views, plain decoding)")
    only.add_argument("--litevlm-only", action="store_true", help="only the LiteVLM configuration (--litevlm)")
    p.add_argument(
        "--no-llama-cpp",
        action="store_true",
        help="leave out llama.cpp's row (added where llama-cpp-python, the llamacpp extra, is installed)",
    )
    _json_flag(p)


def run_demo(args) -> None:
    from litevlm.demo import run_demo

    configs = ("baseline",) if args.baseline_only else ("litevlm",) if args.litevlm_only else ("litevlm", "baseline")
    run_demo(
        args.model,
        out=args.out,
        seed=args.seed,
        n_questions=args.questions,
        as_json=args.json,
        configs=configs,
        explain=args.explain,
        llama_cpp=not args.no_llama_cpp,
    )


def ask_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--images",
        required=True,
        help="folder with one image per camera, named CAM_FRONT.png etc.; a missing camera fails only the questions "
        "that need it",
    )
    p.add_argument(
        "--question",
        required=True,
        action="append",
        help="the question; give it again to ask several about the same images (each view is read and encoded "
        "once), answered in order",
    )
    p.add_argument("--stream", action="store_true", help="print each answer as it is made, then its summary")
    p.add_argument(
        "--explain",
        metavar="FILE.png",
        default=None,
        help="save a figure of the answer: the six views, those encoded, the visual tokens kept on them, the times; "
        "with several questions one figure per answered question, FILE-1.png, FILE-2.png, ... (by question number)",
    )
    _json_flag(
        p,
        "end with the answer as one JSON line (with several questions: a list, {'error': ...} for those not answered)",
    )
    add_pipeline_options(p)


def _streamed(frame, question: str):
    """The answer of `Frame.stream`, its text printed piece by piece as the pipeline makes it."""
    from litevlm.pipeline import Delta

    for item in frame.stream(question):
        if isinstance(item, Delta):
            print(item.text, end="", flush=True)
        else:
            print(flush=True)
            return item
    raise LiteVLMError("the pipeline's stream ended without an answer")


def run_ask(args) -> None:
    """Every --question asked of one frame of the images, in order. With several, a question that fails (its
    camera missing, say) is reported on stderr where it comes and the others still answer; the command then fails
    (exit code 2) once all are printed. One question fails as every command does."""
    from litevlm.explain import check_out, explain
    from litevlm.models import images_from_dir

    questions = args.question
    several = len(questions) > 1
    figures = [None] * len(questions)
    if args.explain:  # checked before the model loads
        out = check_out(args.explain)
        if out.parent.resolve() == Path(args.images).resolve():
            raise LiteVLMError(
                f"--explain {args.explain}: save the figure outside the images folder, where a .png reads as a camera "
                "image the next time"
            )
        figures = [out.with_name(f"{out.stem}-{i}{out.suffix}") for i in range(1, len(questions) + 1)]
        figures = figures if several else [out]
    images = images_from_dir(args.images)
    pipe = pipeline_from_args(args)
    frame = pipe.frame(images)
    results, failed = [], []
    for i, question in enumerate(questions, 1):
        if several and not args.json:
            print(f"[{i}] {question}")
        try:
            ans = _streamed(frame, question) if args.stream else frame.answer(question)
        except LiteVLMError as e:
            if not several:
                raise
            failed.append(i)
            results.append({"error": str(e)})
            print(f"error: question {i}: {e}", file=sys.stderr, flush=True)  # as `main` reports an error
            continue
        results.append(ans.to_dict())
        if figures[i - 1] is not None:
            explain(pipe, images, ans, question, figures[i - 1])
        if not args.json:
            if not args.stream:
                print(ans.text)
            ms = ans.timings_ms
            print(
                f"views: {', '.join(ans.views)}   e2e {ms['e2e']:.1f} ms (images to answer)   "
                f"total {ms['total']:.1f} ms (the paper's stages)"
            )
            if figures[i - 1] is not None:
                print(f"explained: {figures[i - 1]}")
    if args.json:
        _print_json(results if several else results[0])
    if failed:
        raise LiteVLMError(
            f"{len(failed)} of {len(questions)} questions not answered (question {', '.join(map(str, failed))}); "
            "the reasons are above"
        )


def views_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--question", required=True)
    p.add_argument(
        "--model",
        default="drive-tiny",
        help="bundled model name, model directory (with view_selector/) or a view_selector directory",
    )
    _json_flag(p, 'print {"views": [...], "scores": {camera: score}}')


def run_views(args) -> None:
    from litevlm.select.views import load_for_model

    selector = load_for_model(args.model)
    views, scores = selector.select(args.question)
    if args.json:
        _print_json({"views": views, "scores": {c: round(s, 4) for c, s in scores.items()}})
        return
    for c in selector.cameras:
        print(f"{'*' if c in views else ' '} {c:<16} {scores[c]:.3f}")
    print(f"views: {', '.join(views)}   (threshold {selector.threshold:.2f}, lexical weight {selector.weight:.2f})")


def label_views_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--endpoint", required=True, help="OpenAI-compatible base URL, e.g. http://127.0.0.1:8000/v1")
    p.add_argument("--model", required=True, help="the chat model's name at that endpoint")
    p.add_argument("--in", dest="in_path", required=True, help='JSONL of {"question": ...} lines')
    p.add_argument("--out", required=True, help='JSONL of {"question", "views"} lines (appended; a rerun resumes)')
    p.add_argument("--cache", default=None, help="raw-reply cache (default OUT.cache.jsonl)")
    p.add_argument("--api-key-env", default="OPENAI_API_KEY", help="environment variable holding the API key, if any")
    p.add_argument(
        "--ask-all", action="store_true", help="ask the model about explicit questions too (default: lexical labels)"
    )
    p.add_argument("--timeout", type=float, default=60.0)
    _json_flag(p, "print the counts as one JSON line")


def run_label_views(args) -> None:
    import os

    from litevlm.select.label_views import label_views

    key = os.environ.get(args.api_key_env) if args.api_key_env else None
    counts = label_views(
        args.endpoint,
        args.model,
        args.in_path,
        args.out,
        api_key=key,
        cache_path=args.cache,
        ask_all=args.ask_all,
        timeout=args.timeout,
        progress=not args.json,
    )
    if args.json:
        _print_json(counts)
    else:
        print(
            f"labelled {counts['total'] - counts['skipped']} questions into {args.out} ({counts['lexical']} lexical, "
            f"{counts['llm']} by {args.model}: {counts['cached']} cached, {counts['unparsed']} unparsed -> all six; "
            f"{counts['skipped']} already done)"
        )


# ------------------------------------------------------------------------------------------------
# data
# ------------------------------------------------------------------------------------------------
def synth_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--out", required=True)
    p.add_argument("--frames", type=int, default=100)
    p.add_argument("--seed", type=int, default=1)
    p.add_argument("--width", type=int, default=1600)
    p.add_argument("--height", type=int, default=900)
    _json_flag(p)


def run_synth(args) -> None:
    from litevlm.data.synthetic import write_dataset

    path = write_dataset(
        args.out, frames=args.frames, seed=args.seed, size=(args.width, args.height), progress=not args.json
    )
    if args.json:
        _print_json({"path": str(path), "frames": args.frames, "seed": args.seed})
    else:
        print(f"wrote {args.frames} frames to {path}")


# ------------------------------------------------------------------------------------------------
# train: the recipes, their flags generated from their dataclasses
# ------------------------------------------------------------------------------------------------
def _model_dir(where: str) -> Callable[[argparse.ArgumentParser], None]:
    return lambda p: p.add_argument("model_dir", help=f"the model's folder (or a built-in name); {where}")


def train_vlm_arguments(p: argparse.ArgumentParser) -> None:
    from litevlm.train.vlm import VLMRecipe

    p.add_argument("--out", required=True, help="folder for the checkpoint (saved every 5 minutes and at the end)")
    add_recipe_options(p, VLMRecipe)


def run_train_vlm(args) -> None:
    from litevlm.train.vlm import VLMRecipe, train_vlm

    print(f"saved to {train_vlm(args.out, recipe_from_args(VLMRecipe, args))}")


def train_views_arguments(p: argparse.ArgumentParser) -> None:
    from litevlm.data.source import add_data_options
    from litevlm.options import MODEL_HELP, add_format_options
    from litevlm.train.views import ViewRecipe

    p.add_argument(
        "--model",
        default=None,
        help=MODEL_HELP + "; the selector is saved beside it with its prompt format (its weights are not used: "
        "the selector reads questions only)",
    )
    p.add_argument("--out", default=None, help="folder for the selector (OUT/view_selector/); default: --model's")
    add_data_options(p, default_help="the synthetic generator's frames (--frames, --val-frames)")
    p.add_argument(
        "--labels",
        nargs="*",
        default=[],
        help='JSONL of {"question", "views"} lines (litevlm label-views); with --data, the labels of its questions '
        "that name no camera",
    )
    add_format_options(p)
    add_recipe_options(p, ViewRecipe)
    _json_flag(p)


def _views_model(args):
    """The loaded --model that `train views` saves beside (None: only --out), after checking the flags agree."""
    from litevlm.data.source import check_data_options
    from litevlm.options import format_options

    if args.model is None and args.out is None:
        raise LiteVLMError("train views needs --out DIR or --model M: where to save the selector")
    check_data_options(args)
    if args.model is None:
        given = [k for k, v in format_options(args).items() if v is not None]
        if given:
            raise LiteVLMError(f"prompt-format options ({', '.join(given)}) describe a model's prompt: pass --model")
        return None
    import torch

    from litevlm.models import load_model

    # bf16: the weights are loaded only to check the checkpoint and its tokenizer, at half fp32's memory
    return load_model(args.model, dtype=torch.bfloat16, **format_options(args))


def run_train_views(args) -> None:
    from litevlm.models import modules_dir
    from litevlm.train.views import ViewRecipe, data_examples, train_view_selector

    recipe = recipe_from_args(ViewRecipe, args)
    loaded = _views_model(args)
    data = None
    if args.data is not None:
        cache = Path(args.out) if args.out is not None else loaded.path
        data = data_examples(
            args.data, args.images, args.labels, recipe, cache / ".cache" / "views", progress=not args.json
        )
        if not args.json:
            src = data.sources
            print(
                f"{args.data}: {len(data.train)} training questions ({data.train_scenes} scenes), "
                f"{len(data.val)} validation questions ({data.val_scenes} scenes held out, seed {data.seed}); labels: "
                f"{src['c-tag']} from c-tags, {src['lexical']} lexical, {src['label-views']} from label-views, "
                f"{src['all six']} all six (no camera named, no label)"
                + (f"; {len(data.extra)} label lines not in the data trained on as well" if data.extra else "")
            )
    out = train_view_selector(
        modules_dir(loaded, args.out) if loaded is not None else Path(args.out),
        recipe,
        extra_labels=() if data is not None else args.labels,
        progress=not args.json,
        data=data,
    )
    meta = json.loads((out / "config.json").read_text())
    if args.json:
        _print_json({"path": str(out), **{k: meta[k] for k in ("weight", "threshold", "validation", "data")}})
    else:
        print(f"saved to {out}")


def train_tokens_arguments(p: argparse.ArgumentParser) -> None:
    from litevlm.data.source import add_data_options
    from litevlm.options import add_model_options
    from litevlm.train.tokens import TokenRecipe

    add_model_options(p)
    add_data_options(p, default_help="synthetic frames")
    p.add_argument("--out", default=None, help="where token_selector/ is saved (default: the model's own folder)")
    add_recipe_options(p, TokenRecipe)
    _json_flag(p)


def run_train_tokens(args) -> None:
    """Under `torchrun --nproc-per-node W` (with --data) the ranks share the teacher labels and train under DDP;
    rank 0 alone saves and reports."""
    from litevlm.data.source import check_data_options
    from litevlm.options import load_model_from_args
    from litevlm.train.tokens import TokenRecipe, train_token_selector

    recipe = recipe_from_args(TokenRecipe, args)
    check_data_options(args)
    with _ranks(args) as d:
        out = train_token_selector(
            load_model_from_args(args),
            recipe,
            progress=not args.json,
            out_dir=args.out,
            data=args.data,
            images_root=args.images,
            d=d,
        )
    if out is None:  # not rank 0: rank 0 reports for every rank
        return
    meta = json.loads((out / "config.json").read_text())["training"]
    if args.json:
        _print_json({"path": str(out), **{k: meta[k] for k in ("steps", "items", "source", "validation")}})
        return
    src, val = meta["source"], meta["validation"]
    if src["data"] == "synthetic":
        print(f"trained on {meta['items']} prompts of {src['frames']} synthetic frames (seed {src['seed']})")
    else:
        left = src["unlabelled_by_the_deadline"]
        print(
            f"trained on {meta['items']} questions of {src['data']} on {src['ranks']} rank(s) "
            f"({src['labels_from_cache']} labels from the cache"
            + (f"; {left} left unlabelled by the time budget: rerun to continue)" if left else ")")
        )
        print(f"validation: {src['val_questions']} questions of {src['val_scenes']} held-out scenes, {src['split']}")
    for name in ("fastv_k1", "selector_init", "selector"):
        if val.get(name):
            print(f"  {name:14s} " + "  ".join(f"{k} {v}" for k, v in val[name].items()))
    print(f"saved to {out}")


def train_draft_arguments(p: argparse.ArgumentParser) -> None:
    from litevlm.data.source import add_data_options
    from litevlm.options import add_model_options
    from litevlm.train.draft import DraftRecipe

    add_model_options(p)
    add_data_options(p, default_help="synthetic frames (--frames)")
    p.add_argument(
        "--out", default=None, help="folder the head is saved in, as OUT/draft/ (default: the model's own folder)"
    )
    p.add_argument(
        "--offline",
        default=None,
        metavar="DIR",
        help="cache the target's answers and features in safetensors shards in DIR first (a rerun resumes), then "
        "train from them",
    )
    add_recipe_options(p, DraftRecipe)


def run_train_draft(args) -> None:
    """Under `torchrun --nproc-per-node W` each rank answers its share of the questions and trains the head through
    DDP; rank 0 validates, saves and prints."""
    from litevlm.data.source import load_data
    from litevlm.options import load_model_from_args
    from litevlm.train.draft import DraftRecipe, train_draft

    recipe = recipe_from_args(DraftRecipe, args)
    samples = load_data(args.data, args.images) if args.data else None
    with _ranks(args) as d:
        out = train_draft(
            load_model_from_args(args),
            args.out,
            recipe,
            samples=samples,
            data=args.data or "",
            offline=args.offline,
            d=d,
        )
    if not d.is_main:
        return
    m = json.loads((out / "config.json").read_text())["metrics"]
    if m["top1"] is None:
        print(f"validation: none ({m['validation']}: the data has a single scene)")
    else:
        print(
            f"validation ({m['validation']}, {m['val_sequences']} questions): top-1 agreement {m['top1']:.3f}, "
            f"chain acceptance {m['chain_accept']:.2f}; trained on {m['train_sequences']} questions"
        )
    print(f"saved to {out}")


def train_openings_arguments(p: argparse.ArgumentParser) -> None:
    from litevlm.data.source import add_data_options
    from litevlm.options import add_model_options

    add_model_options(p)
    add_data_options(p, default_help="synthetic frames (--frames) and their reference answers")
    p.add_argument(
        "--out", default=None, help="the folder the draft head was saved in (OUT/draft/; default: the model's own)"
    )
    p.add_argument(
        "--offline",
        default=None,
        metavar="DIR",
        help="with --data: the target's answers cached by `litevlm train draft --offline DIR` (else generated)",
    )
    p.add_argument(
        "--frames", type=int, default=3000, help="without --data: synthetic training frames whose answers are counted"
    )
    p.add_argument("--seed", type=int, default=0, help="without --data: frames (seed, 0..frames-1)")
    p.add_argument("--depth", type=int, default=4, help="tokens per opening, EOS included")
    p.add_argument("--max-nodes", type=int, default=12, help="nodes of one question's trie (extra prompt rows)")
    p.add_argument(
        "--min-share", type=float, default=0.03, help="an opening's least share of its question kind's answers"
    )
    p.add_argument(
        "--key-words",
        default="4,2",
        help="question words a key holds, longest first: a question takes the longest key seen in training",
    )


def run_train_openings(args) -> None:
    from litevlm.data.source import load_data
    from litevlm.options import load_model_from_args
    from litevlm.train.openings import build_openings

    try:
        key_words = tuple(int(w) for w in args.key_words.split(","))
    except ValueError:
        raise LiteVLMError(f"--key-words takes comma-separated word counts, e.g. 4,2; got {args.key_words!r}") from None
    if args.offline and not args.data:
        raise LiteVLMError("--offline reads the target's answers to --data: pass the same --data as `train draft`")
    samples = load_data(args.data, args.images) if args.data else None
    path = build_openings(
        load_model_from_args(args),
        args.out,
        samples=samples,
        data=args.data or "",
        offline=args.offline,
        frames=args.frames,
        seed=args.seed,
        depth=args.depth,
        max_nodes=args.max_nodes,
        min_share=args.min_share,
        key_words=key_words,
    )
    print(f"saved to {path}")


def train_average_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("checkpoints", nargs="+", help="two or more checkpoint folders of one model config")
    p.add_argument("--out", required=True, help="where the averaged checkpoint is written")


def run_train_average(args) -> None:
    from litevlm.train.vlm import average_checkpoints

    print(f"saved to {average_checkpoints(args.out, args.checkpoints)}")


# ------------------------------------------------------------------------------------------------
# eval, quantize, bench, serve, convert
# ------------------------------------------------------------------------------------------------
def eval_arguments(p: argparse.ArgumentParser) -> None:
    from litevlm.data.source import add_data_options
    from litevlm.eval.score import add_scoring_options

    add_data_options(p, required=True)
    p.add_argument("--n", type=int, default=None, help="evaluate the first N questions only")
    p.add_argument(
        "--blank", action="store_true", help="replace every camera image by an empty road (does the model look?)"
    )
    p.add_argument(
        "--records",
        default=None,
        help="write per-question records (answer, GT, tags, views, visual tokens, stage times) to this JSON file",
    )
    p.add_argument(
        "--predictions-out",
        default=None,
        metavar="FILE",
        help="write the challenge's submission list [{id, question, answer}] for every question (not with --n)",
    )
    p.add_argument(
        "--no-score",
        action="store_true",
        help="answer and time every question, closed-question accuracy included, without the DriveLM score "
        "(which needs pycocoevalcap): for a machine without it",
    )
    p.add_argument(
        "--resume-dir",
        default=None,
        metavar="DIR",
        help="keep each answer in DIR as it is made; a rerun with the same options answers only what is left",
    )
    p.add_argument(
        "--batch",
        type=_positive_int,
        default=1,
        metavar="N",
        help="decode up to N answers together (the same answers, greedy; modules and native backends)",
    )
    _json_flag(p)
    add_scoring_options(p)
    add_pipeline_options(p)


def run_eval(args) -> None:
    """Under `torchrun --nproc-per-node W` each rank answers every W-th question and rank 0 alone scores,
    prints and writes; the other ranks print nothing."""
    from litevlm.data.source import load_data
    from litevlm.dist import ShardStore
    from litevlm.eval.metrics import language_scorers
    from litevlm.eval.run import evaluate
    from litevlm.eval.score import print_scores, scoring_from_args, write_submission
    from litevlm.options import pipeline_options

    if not args.no_score:
        language_scorers()  # pycocoevalcap is checked before any model is loaded
    if args.predictions_out and args.n:
        raise LiteVLMError("--predictions-out writes a whole submission: drop --n (a partial file is never written)")
    scoring = scoring_from_args(args)
    samples = load_data(args.data, args.images, require_images=not args.blank)  # every image checked before the model
    with _ranks(args) as d:
        store = None
        if args.resume_dir:
            # answers depend on the data, the images and the pipeline, not on the rank's device
            meta = {"data": str(args.data), "images": args.images, "blank": args.blank}
            meta["pipeline"] = pipeline_options(args)
            meta["pipeline"].pop("device")
            store = ShardStore(args.resume_dir, "eval", d, meta=json.loads(json.dumps(meta)))
        pipe = pipeline_from_args(args)
        from litevlm.frame import ViewCache

        pipe.view_cache = ViewCache()  # a frame seen before (every --blank frame is one) is not encoded again
        result = evaluate(
            pipe,
            args.data,
            images_root=args.images,
            limit=args.n,
            blank=args.blank,
            progress=not args.json,
            d=d,
            store=store,
            samples=samples,
            score=not args.no_score,
            batch=args.batch,
            **scoring,
        )
    if result is None:  # not rank 0: rank 0 reports for every rank
        return
    records = result.pop("records")
    if args.records:
        Path(args.records).write_text(json.dumps(records, indent=1))
    if args.predictions_out:
        write_submission(args.predictions_out, samples, [r["answer"] for r in records])
    if args.json:
        _print_json(result)
    elif result["scored"]:
        print_scores(result)
        print(
            f"views per question {result['views_per_question']:.2f}, visual tokens {result['visual_tokens']:.1f}, "
            f"median total {result['total_ms_median']:.1f} ms"
        )
    else:
        print(result["final_note"])


def score_arguments(p: argparse.ArgumentParser) -> None:
    from litevlm.eval.score import SCORE_HELP, add_scoring_options

    p.description, p.formatter_class = SCORE_HELP, argparse.RawDescriptionHelpFormatter
    p.add_argument("--predictions", required=True, help="the submission: a JSON list of {id, question, answer}")
    p.add_argument("--gt", required=True, help="a DriveLM JSON file with answers")
    _json_flag(p)
    add_scoring_options(p)


def run_score(args) -> None:
    from litevlm.eval.metrics import language_scorers
    from litevlm.eval.score import print_scores, score_files, scoring_from_args

    language_scorers()
    result = score_files(args.predictions, args.gt, **scoring_from_args(args))
    if args.json:
        _print_json(result)
    else:
        print_scores(result)


def quantize_arguments(p: argparse.ArgumentParser) -> None:
    from litevlm.data.source import add_data_options
    from litevlm.quant.fp8 import SYNTH_CALIB_SEED, FP8Recipe

    p.add_argument("--out", required=True, help="the FP8 checkpoint's folder, written whole or not at all")
    p.add_argument("--calib", type=int, default=64, help="calibration questions (default: %(default)s)")
    add_data_options(p, default_help=f"synthetic frames of seed {SYNTH_CALIB_SEED}")
    p.add_argument(
        "--calib-fraction",
        type=float,
        default=0.1,
        help="with --data: the fraction of its scenes held out, whose questions calibrate (default: %(default)s)",
    )
    p.add_argument("--calib-seed", type=int, default=0, help="with --data: the seed of that split (default: 0)")
    add_recipe_options(p, FP8Recipe)
    _json_flag(p)
    add_pipeline_options(p)


def run_quantize(args) -> None:
    """FP8 post-training quantisation calibrated on what the deployed pipeline's layers really see: the pipeline the
    flags describe answers the calibration questions (held-out scenes of --data, else synthetic frames).

    Under `torchrun --nproc-per-node W` each rank answers every W-th calibration question, the ranks' per-layer
    maxima are reduced to one, and rank 0 alone writes the checkpoint and prints."""
    from litevlm.data.source import check_data_options
    from litevlm.dist import shard
    from litevlm.models import resolve_model_dir
    from litevlm.quant.fp8 import FP8Recipe, calibrate, calibration_set, check_out_dir, quantize_model, save_fp8

    check_data_options(args)
    recipe = recipe_from_args(FP8Recipe, args)
    source = resolve_model_dir(args.model)
    check_out_dir(args.out, source)
    calib = None
    if recipe.static:  # the dynamic recipe scales each row at run time: nothing to calibrate
        calib = calibration_set(args.calib, args.data, args.images, args.calib_fraction, args.calib_seed)
    args.backend = "modules"  # calibration observes the layers' inputs with forward hooks: they fire in the modules
    with _ranks(args) as d:
        pipe = pipeline_from_args(args)
        amax = None
        if calib is not None:
            runs = [(lambda s=s: pipe.answer(s.question, s.images)) for s in shard(calib.samples, d)]
            amax = calibrate(pipe.model, runs, recipe, progress=not args.json and d.is_main, total=len(runs), d=d)
    if not d.is_main:
        return
    report = quantize_model(pipe.model, recipe, amax)
    out = save_fp8(
        pipe.model,
        args.out,
        recipe,
        report,
        source,
        tokenizer=pipe.tokenizer,
        prompt_format=pipe.format,
        calibration=calib.source if calib else None,
    )
    if args.json:
        _print_json({"out": str(out), "recipe": recipe.name, "calibration": calib and calib.source, **report.to_dict()})
    else:
        print(report.summary())
        if calib is not None:
            print(calib.describe() + (f" on {d.world_size} ranks" if d.world_size > 1 else ""))
        elif args.data:
            print(f"{recipe.name} scales each row at run time: nothing calibrated, {args.data} not read")
        print(f"wrote {out}")


def bench_arguments(p: argparse.ArgumentParser) -> None:
    from litevlm.data.source import add_data_options
    from litevlm.options import add_model_options

    add_model_options(p)
    add_data_options(p, default_help="held-out synthetic frames, seed 1")
    p.add_argument("--n", type=int, default=60, help="questions measured (after the warm-up ones)")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument(
        "--shape",
        default=None,
        help="random weights at a real model's shapes (2b, 1b, internvl3-2b, ...): latency only",
    )
    p.add_argument("--max-new-tokens", type=int, default=160)
    p.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="on a GPU (--shape, or a checkpoint with --device cuda): --backend cuda, whose decode steps and "
        "fixed-size verifications replay as CUDA graphs (capture time reported apart)",
    )
    p.add_argument(
        "--backend",
        default="auto",
        choices=BACKENDS,
        help="each row's execution backend: auto (cuda on a GPU, else the native CPU steps where they apply), the "
        "modules, native, cuda, or cuda-twin (the CUDA backend's graphs replayed eagerly on the CPU)",
    )
    p.add_argument(
        "--compile-steps",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the cuda backend's decode, verification and draft-chain steps compiled by inductor before capture "
        "(fused norms, RoPE, SwiGLU, FP8 quantisation): one compile per KV bucket and step at setup",
    )
    p.add_argument("--no-transformers", action="store_true", help="skip the transformers generate rows")
    p.add_argument(
        "--no-score",
        action="store_true",
        help="no DriveLM score for a real model's rows (latency and closed-question accuracy only; needs no "
        "pycocoevalcap)",
    )
    p.add_argument(
        "--configs",
        default=None,
        metavar="NAMES",
        help="comma-separated rows to run (e.g. 'baseline,litevlm,litevlm bf16'; default: every row; "
        "litevlm.presets names them)",
    )
    p.add_argument("--plot", default=None, help="save the stage plots to this PNG")
    p.add_argument(
        "--questions-per-frame",
        type=int,
        default=1,
        metavar="K",
        help="frame mode: K questions of each frame (across DriveLM's families), each row answering them as "
        "strangers and through one frame side by side; --n questions, --warmup frames",
    )
    p.add_argument(
        "--jsonl",
        default=None,
        metavar="PATH",
        help="append each measured answer, then each row, to PATH as one JSON line when it is known "
        "(a run cut short keeps its figures)",
    )
    p.add_argument(
        "--batch",
        type=_positive_int,
        default=1,
        metavar="B",
        help="batch mode: each row (default: baseline and litevlm) answers the questions one at a time and with up "
        "to B decoding together, side by side: decode tokens/s, questions/s and e2e of both (Table 1 is batch 1)",
    )
    _json_flag(p)


def _bench_common(args, load: dict) -> dict:
    """What every bench mode takes from the command line alike."""
    from litevlm.presets import configs_named

    return dict(
        data=args.data,
        images_root=args.images,
        load=load,
        n=args.n,
        configs=configs_named(args.configs) if args.configs else None,
        max_new_tokens=args.max_new_tokens,
        warmup=args.warmup,
        progress=not args.json,
        backend=args.backend,
        jsonl=args.jsonl,
        scored=not args.no_score,
    )


def _run_batch_bench(args, load: dict) -> None:
    from litevlm.eval.bench import format_batch, run_batch_bench

    for flag, given in (
        ("--shape", args.shape),
        ("--questions-per-frame", args.questions_per_frame > 1),
        ("--plot", args.plot),
        ("--cuda-graphs", args.cuda_graphs),
        ("--compile-steps", args.compile_steps),
    ):
        if given:
            raise LiteVLMError(f"--batch measures a real model's batched decoding on the CPU backends: drop {flag}")
    result = run_batch_bench(args.model, batch=args.batch, **_bench_common(args, load))
    print(format_batch(result))
    if args.json:
        _print_json(result)


def run_bench_command(args) -> None:
    from litevlm.eval.bench import format_shares, format_table, plot, run_bench
    from litevlm.options import format_options

    if args.shape is None and not args.no_score:  # DriveLM's language score needs pycocoevalcap: checked now
        from litevlm.eval.metrics import language_scorers

        language_scorers()
    load = format_options(args)
    if args.device != "cpu" or args.dtype != "float32":
        load.update(device=args.device, dtype=args.dtype)
    if args.batch > 1:
        return _run_batch_bench(args, load)
    result, per_question = run_bench(
        args.model,
        shape=args.shape,
        hf=not args.no_transformers,
        cuda_graphs=args.cuda_graphs,
        questions_per_frame=args.questions_per_frame,
        compile_steps=args.compile_steps,
        **_bench_common(args, load),
    )
    if args.questions_per_frame > 1:
        from litevlm.eval.bench import format_frames

        print(format_frames(result))
        if args.json:
            _print_json(result)
        return
    if args.plot:
        plot(result, args.plot, per_question)
    print(format_table(result))
    print("\nstage shares of the mean end-to-end time:")
    print(format_shares(result))
    if args.json:
        _print_json(result)


def serve_arguments(p: argparse.ArgumentParser) -> None:
    from litevlm.serve import add_serve_arguments

    add_serve_arguments(p)
    add_pipeline_options(p)
    # built without its warm-up answer: the server is alive (/health) at once, ready (/ready) once it is warm
    p.set_defaults(make_pipeline=functools.partial(pipeline_from_args, warmup=False))


def run_serve(args) -> None:
    """The server flags checked, then the pipeline built (`make_pipeline`), then served until interrupted."""
    from litevlm.serve import serve_main

    serve_main(args)


def convert_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--to", choices=["hf", "litevlm", "gguf"], required=True)
    p.add_argument(
        "--outtype",
        choices=["f32", "f16", "q8_0"],
        default="f16",
        help="gguf: the weights' type (norms, biases, position embeddings stay f32, as llama.cpp's converter has them)",
    )
    p.add_argument("src", help="a checkpoint directory or a bundled model's name (drive-tiny, drive-hd)")
    p.add_argument("dst")


def run_convert(args) -> None:
    from litevlm.model.hf import hf_to_litevlm, litevlm_to_hf

    if args.to == "gguf":  # llama.cpp: the text model and the mmproj (vision tower + projector) side by side in dst
        from litevlm.model.gguf import write_gguf

        files = write_gguf(args.src, args.dst, args.outtype)
        print(f"wrote {files.text} and {files.mmproj}")
        return
    import warnings

    from litevlm.models import resolve_model_dir

    src = resolve_model_dir(args.src)  # a bundled model's name, as every command takes one
    with warnings.catch_warnings(record=True) as notes:  # what the conversion could not carry over, said once
        warnings.simplefilter("always")
        (litevlm_to_hf if args.to == "hf" else hf_to_litevlm)(src, args.dst)
    for note in notes:
        print(f"note: {note.message}", file=sys.stderr)
    print(f"wrote {args.dst}")


COMMANDS: dict[str, Command | Group] = {
    "demo": Command(
        "LiteVLM and the baseline on a fresh scene: answers beside the truth, views, stage tables, speed-up",
        demo_arguments,
        run_demo,
    ),
    "ask": Command("answer questions about one frame of your own camera images", ask_arguments, run_ask),
    "views": Command("which cameras a question needs, with per-camera scores", views_arguments, run_views),
    "label-views": Command(
        "label which cameras each question needs with any OpenAI-compatible chat model",
        label_views_arguments,
        run_label_views,
    ),
    "data": Group(
        "datasets",
        {"synth": Command("write synthetic six-camera frames with DriveLM-style QA", synth_arguments, run_synth)},
    ),
    "train": Group(
        "training recipes",
        {
            "vlm": Command(
                "train an InternVL-architecture model from scratch on synthetic frames",
                train_vlm_arguments,
                run_train_vlm,
            ),
            "views": Command(
                "train the ViewSelector (which cameras a question needs) and calibrate it",
                train_views_arguments,
                run_train_views,
            ),
            "tokens": Command(
                "train the TokenSelector of a model (saved in MODEL/token_selector)",
                train_tokens_arguments,
                run_train_tokens,
            ),
            "draft": Command(
                "train the EAGLE-2 draft head of a model on its own answers (saved in MODEL/draft)",
                train_draft_arguments,
                run_train_draft,
            ),
            "openings": Command(
                "answer openings verified with the prompt, from the model's answers (MODEL/draft/openings.json)",
                train_openings_arguments,
                run_train_openings,
            ),
            "average": Command(
                "the element-wise mean of checkpoints trained from one stage (a model soup)",
                train_average_arguments,
                run_train_average,
            ),
        },
    ),
    "eval": Command(
        "DriveLM scores of a pipeline configuration (the official evaluation by default)", eval_arguments, run_eval
    ),
    "score": Command("DriveLM's official score of a submission file", score_arguments, run_score),
    "quantize": Command("FP8 post-training quantisation into a new checkpoint", quantize_arguments, run_quantize),
    "bench": Command(
        "the paper's Table 1 re-measured: every configuration on the same questions", bench_arguments, run_bench_command
    ),
    "serve": Command("OpenAI-compatible HTTP server (POST /v1/chat/completions)", serve_arguments, run_serve),
    "convert": Command("convert checkpoints to and from transformers InternVL", convert_arguments, run_convert),
}


def _register(subparsers, commands: dict[str, Command | Group]) -> None:
    for name, cmd in commands.items():
        p = subparsers.add_parser(name, help=cmd.help, description=cmd.help)
        if isinstance(cmd, Group):
            _register(p.add_subparsers(dest=f"{name}_command", required=True), cmd.commands)
        else:
            cmd.add_arguments(p)
            p.set_defaults(func=cmd.run)


def build_parser() -> argparse.ArgumentParser:
    """The `litevlm` parser: one subcommand per entry of `COMMANDS`."""
    p = argparse.ArgumentParser(
        prog="litevlm", description="Low-latency VLM inference for six-camera driving rigs (LiteVLM)."
    )
    _register(p.add_subparsers(dest="command", required=True), COMMANDS)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
        code = 0
    except LiteVLMError as e:
        print(f"error: {e}", file=sys.stderr)
        code = 2
    from litevlm.dist import end_rank, joined

    if joined():  # a torchrun rank whose work is done: leave before the interpreter tears gloo down
        end_rank(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
