"""The `litevlm` command line. Every command with `--json` ends its standard output with one JSON line."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from litevlm.errors import LiteVLMError


def _add_pipeline_options(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("pipeline")
    g.add_argument(
        "--model",
        default="drive-tiny",
        help="bundled model name or checkpoint directory (ours or transformers InternVL)",
    )
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    g.add_argument("--max-new-tokens", type=int, default=160)
    g.add_argument("--temperature", type=float, default=0.0)
    g.add_argument("--top-p", type=float, default=1.0)
    g.add_argument("--seed", type=int, default=0)
    g.add_argument(
        "--select-views", action="store_true", help="ViewSelector: encode only the cameras the question needs"
    )
    g.add_argument(
        "--select-tokens",
        type=float,
        default=None,
        metavar="R",
        help="TokenSelector keeping a fraction R of visual tokens",
    )
    g.add_argument(
        "--select-min-tokens",
        type=int,
        default=None,
        metavar="N",
        help="run the TokenSelector only on prompts with at least N visual tokens (default 0: always; --litevlm: "
        "the LiteVLM default)",
    )
    g.add_argument("--fastv-k", type=int, default=None, metavar="K", help="FastV baseline: prune at decoder layer K")
    g.add_argument(
        "--fastv-r", type=float, default=None, metavar="R", help="FastV baseline: fraction of visual tokens kept"
    )
    g.add_argument(
        "--speculative", action="store_true", help="EAGLE-2 speculative decoding with the model's draft head"
    )
    g.add_argument("--tree-top-k", type=int, default=None)
    g.add_argument("--tree-depth", type=int, default=None)
    g.add_argument("--tree-total", type=int, default=None, help="draft tree size verified per step (root included)")
    g.add_argument(
        "--tree-min-value", type=float, default=None, help="a chain ends where its draft probability falls below this"
    )
    g.add_argument(
        "--no-openings",
        action="store_true",
        help="speculative decoding without the answer openings verified inside the prefill (draft/openings.json)",
    )
    g.add_argument(
        "--fp8", default=None, metavar="RECIPE", help="fp8-dynamic-per-row: quantise decoder linears at load"
    )
    g.add_argument(
        "--matmul",
        default="fp32",
        choices=("fp32", "bf16"),
        help="bf16: the vision tower and the prefill in bf16 on CPUs with AMX or AVX512-BF16 (decode stays fp32)",
    )
    g.add_argument(
        "--litevlm",
        action="store_true",
        help="the full LiteVLM configuration: --select-views --select-tokens 0.5 --speculative",
    )


def _pipeline(args):
    from litevlm.pipeline import Pipeline

    if args.litevlm:
        from litevlm.eval.bench import LITEVLM

        args.select_views, args.speculative = LITEVLM["select_views"], LITEVLM["speculative"]
        args.select_tokens = args.select_tokens or LITEVLM["select_tokens"]
        if args.select_min_tokens is None:
            args.select_min_tokens = LITEVLM["min_select_tokens"]
    return Pipeline.from_pretrained(
        args.model,
        device=args.device,
        dtype=args.dtype,
        max_new_tokens=args.max_new_tokens,
        temperature=args.temperature,
        top_p=args.top_p,
        seed=args.seed,
        select_views=args.select_views,
        select_tokens=args.select_tokens,
        fastv_k=args.fastv_k,
        fastv_r=args.fastv_r,
        speculative=args.speculative,
        tree_top_k=args.tree_top_k,
        tree_depth=args.tree_depth,
        tree_total=args.tree_total,
        tree_min_value=args.tree_min_value,
        fp8=args.fp8,
        matmul=args.matmul,
        min_select_tokens=args.select_min_tokens or 0,
        openings=not args.no_openings,
    )


def _module_of(parser, where: str, frames: int, frames_help: str, minutes: tuple[float, str] | None = None) -> None:
    """The arguments of a recipe that builds one module of a model from synthetic frames: the model, the frames, their
    seed, and for a trained one (minutes = (default, help)) its budget and threads."""
    parser.add_argument("model_dir", help=f"the model's folder (or a built-in name); {where}")
    parser.add_argument("--frames", type=int, default=frames, help=frames_help)
    parser.add_argument("--seed", type=int, default=0, help="frames (seed, 0..frames-1); the held-out split is seed 1")
    if minutes is not None:
        parser.add_argument("--minutes", type=float, default=minutes[0], help=minutes[1])
        parser.add_argument("--threads", type=int, default=2, help="torch threads")


def _print_json(obj) -> None:
    print(json.dumps(obj, separators=(",", ":")))


def cmd_demo(args) -> None:
    from litevlm.demo import run_demo

    run_demo(
        args.model,
        out=args.out,
        seed=args.seed,
        n_questions=args.questions,
        as_json=args.json,
        select_views=args.select_views,
    )


def cmd_ask(args) -> None:
    from litevlm.models import images_from_dir

    pipe = _pipeline(args)
    ans = pipe.answer(args.question, images_from_dir(args.images))
    if args.json:
        _print_json(ans.to_dict())
    else:
        print(ans.text)
        print(f"views: {', '.join(ans.views)}   total {ans.timings_ms['total']:.1f} ms")


def cmd_data_synth(args) -> None:
    from litevlm.data.synthetic import write_dataset

    path = write_dataset(
        args.out, frames=args.frames, seed=args.seed, size=(args.width, args.height), progress=not args.json
    )
    if args.json:
        _print_json({"path": str(path), "frames": args.frames, "seed": args.seed})
    else:
        print(f"wrote {args.frames} frames to {path}")


def _family_weight(text: str) -> tuple[str, float]:
    name, sep, value = text.partition("=")
    try:
        weight = float(value)
    except ValueError:
        weight = -1.0
    if not sep or not name or weight < 0:
        raise argparse.ArgumentTypeError(f"expected FAMILY=WEIGHT with a weight >= 0, got {text!r}")
    return name, weight


def cmd_train_vlm(args) -> None:
    from litevlm.train.vlm import VLMRecipe, train_vlm

    recipe = VLMRecipe(
        frames=args.frames,
        seed=args.seed,
        minutes=args.minutes,
        steps=args.steps,
        batch_frames=args.batch_frames,
        threads=args.threads,
        lr=args.lr,
        warmup=args.warmup,
        first_frame=args.first_frame,
        closed_weight=args.closed_weight,
        init=args.init,
        reinit_vision=args.reinit_vision,
        reinit_language=args.reinit_language,
        aux_weight=args.aux_weight,
        aux_scale=args.aux_scale,
        patch_aux_weight=args.patch_aux_weight,
        token_probe_weight=args.token_probe_weight,
        vision_warmup=args.vision_warmup,
        probe_frames=args.probe_frames,
        visual_norm=args.visual_norm,
        view_subset_prob=args.view_subset_prob,
        token_drop_prob=args.token_drop_prob,
        family_weights=dict(args.family_weight),
        attn_weight=args.attn_weight,
        attn_layer=args.attn_layer,
        option_weight=args.option_weight,
        option_layer=args.option_layer,
        letter_weight=args.letter_weight,
        letter_layer=args.letter_layer,
        readout_weight=args.readout_weight,
        readout_layer=args.readout_layer,
        grow_after=tuple(args.grow_after),
        store_dtype=args.store_dtype,
        light_contrast=args.light_contrast,
    )
    out = train_vlm(args.out, recipe)
    print(f"saved to {out}")


def cmd_train_average(args) -> None:
    from litevlm.train.vlm import average_checkpoints

    print(f"saved to {average_checkpoints(args.out, args.checkpoints)}")


def cmd_train_tokens(args) -> None:
    from litevlm.train.tokens import TokenRecipe, train_token_selector

    recipe = TokenRecipe(
        frames=args.frames,
        minutes=args.minutes,
        threads=args.threads,
        seed=args.seed,
        epochs=args.epochs,
        shared_layer=not args.own_layer,
    )
    print(f"saved to {train_token_selector(args.model_dir, recipe)}")


def cmd_train_draft(args) -> None:
    from litevlm.train.draft import DraftRecipe, train_draft

    recipe = DraftRecipe(
        frames=args.frames, minutes=args.minutes, threads=args.threads, seed=args.seed, passes=args.passes
    )
    if args.intermediate is not None:
        recipe.intermediate_size = args.intermediate
    print(f"saved to {train_draft(args.model_dir, recipe=recipe)}")


def cmd_train_openings(args) -> None:
    from litevlm.spec.openings import build_openings

    try:
        key_words = tuple(int(w) for w in args.key_words.split(","))
    except ValueError:
        raise LiteVLMError(f"--key-words takes comma-separated word counts, e.g. 4,2; got {args.key_words!r}") from None
    path = build_openings(
        args.model_dir,
        frames=args.frames,
        seed=args.seed,
        depth=args.depth,
        max_nodes=args.max_nodes,
        min_share=args.min_share,
        key_words=key_words,
    )
    print(f"saved to {path}")


def cmd_eval(args) -> None:
    from litevlm.eval.run import evaluate
    from litevlm.eval.score import print_scores, scoring_from_args, write_submission

    if args.predictions_out and args.n:
        raise LiteVLMError("--predictions-out writes a whole submission: drop --n (a partial file is never written)")
    scoring = scoring_from_args(args)
    result = evaluate(
        _pipeline(args),
        args.data,
        images_root=args.images,
        limit=args.n,
        blank=args.blank,
        progress=not args.json,
        **scoring,
    )
    records = result.pop("records")
    if args.records:
        Path(args.records).write_text(json.dumps(records, indent=1))
    if args.predictions_out:
        from litevlm.data.drivelm import load_samples

        samples = load_samples(args.data, images_root=args.images)
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


def cmd_quantize(args) -> None:
    """FP8 post-training quantisation calibrated on what the deployed pipeline's layers really see."""
    import shutil

    from litevlm.data.drivelm import samples_from_frame
    from litevlm.data.synthetic import make_frame, render_views
    from litevlm.models import resolve_model_dir
    from litevlm.quant.fp8 import FP8Recipe, calibrate, quantize_model, save_fp8

    if args.calib < 1:
        raise LiteVLMError("--calib must be at least 1 calibration question")
    pipe = _pipeline(args)
    recipe = FP8Recipe(args.recipe, include_vision=args.vision)
    # Calibration questions come from seed 2 frames: neither the training (0) nor the held-out (1) split.
    samples, i = [], 0
    while len(samples) < args.calib:
        frame = make_frame(2, i)
        samples += samples_from_frame(frame, render_views(frame, size=(800, 450)))
        i += 1
    samples = samples[: args.calib]
    amax = None
    if recipe.static:
        amax = calibrate(
            pipe.model,
            [(lambda s=s: pipe.answer(s.question, s.images)) for s in samples],
            recipe,
            progress=not args.json,
            total=len(samples),
        )
    report = quantize_model(pipe.model, recipe, amax)
    src = resolve_model_dir(args.model)
    out = save_fp8(pipe.model, args.out, recipe, report, tokenizer_dir=src)
    for part in ("view_selector", "token_selector", "draft"):  # the small modules stay in full precision
        if (src / part).is_dir() and not (out / part).exists():
            shutil.copytree(src / part, out / part)
    if args.json:
        _print_json({"out": str(out), "recipe": recipe.name, "calib": len(samples), **report.to_dict()})
    else:
        print(report.summary())
        print(f"wrote {out}")


def cmd_bench(args) -> None:
    from litevlm.eval.bench import configs_named, format_shares, format_table, plot, run_bench

    configs = configs_named(args.configs) if args.configs else None
    result, per_question = run_bench(
        args.model,
        data=args.data,
        n=args.n,
        shape=args.shape,
        configs=configs,
        hf=not args.no_transformers,
        max_new_tokens=args.max_new_tokens,
        warmup=args.warmup,
        progress=not args.json,
        cuda_graphs=args.cuda_graphs,
    )
    if args.plot:
        plot(result, args.plot, per_question)
    print(format_table(result))
    print("\nstage shares of the mean end-to-end time:")
    print(format_shares(result))
    if args.json:
        _print_json(result)


def cmd_convert(args) -> None:
    from litevlm.model.hf import hf_to_litevlm, litevlm_to_hf

    if args.to == "hf":
        litevlm_to_hf(args.src, args.dst)
    else:
        hf_to_litevlm(args.src, args.dst)
    print(f"wrote {args.dst}")


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="litevlm", description="Low-latency VLM inference for six-camera driving rigs (LiteVLM)."
    )
    sub = p.add_subparsers(dest="command", required=True)

    d = sub.add_parser("demo", help="render a fresh scene, ask questions, show answers and the stage table")
    d.add_argument("--model", default="drive-tiny")
    d.add_argument("--seed", type=int, default=2026)
    d.add_argument("--questions", type=int, default=6)
    d.add_argument("--out", default="demo.png", help="where to save the 2x3 picture of the six views")
    d.add_argument("--select-views", action="store_true", help="answer through the ViewSelector, as LiteVLM does")
    d.add_argument("--json", action="store_true")
    d.set_defaults(func=cmd_demo)

    a = sub.add_parser("ask", help="answer a question about your own six camera images")
    a.add_argument("--images", required=True, help="folder with one image per camera, named CAM_FRONT.png etc.")
    a.add_argument("--question", required=True)
    a.add_argument("--json", action="store_true")
    _add_pipeline_options(a)
    a.set_defaults(func=cmd_ask)

    data = sub.add_parser("data", help="datasets").add_subparsers(dest="data_command", required=True)
    s = data.add_parser("synth", help="write synthetic six-camera frames with DriveLM-style QA")
    s.add_argument("--out", required=True)
    s.add_argument("--frames", type=int, default=100)
    s.add_argument("--seed", type=int, default=1)
    s.add_argument("--width", type=int, default=1600)
    s.add_argument("--height", type=int, default=900)
    s.add_argument("--json", action="store_true")
    s.set_defaults(func=cmd_data_synth)

    train = sub.add_parser("train", help="training recipes").add_subparsers(dest="train_command", required=True)
    tv = train.add_parser("vlm", help="train an InternVL-architecture model from scratch on synthetic frames")
    tv.add_argument("--out", required=True, help="folder for the checkpoint (saved every 5 minutes and at the end)")
    tv.add_argument("--frames", type=int, default=6000, help="distinct synthetic training frames, rendered once")
    tv.add_argument("--seed", type=int, default=0, help="frames (seed, first-frame + i); the held-out split is seed 1")
    tv.add_argument("--minutes", type=float, default=40.0, help="wall-clock budget; the schedule is planned to fit it")
    tv.add_argument("--steps", type=int, default=100000, help="at most this many steps")
    tv.add_argument("--batch-frames", type=int, default=8, help="frames per step (several questions each)")
    tv.add_argument("--threads", type=int, default=2, help="torch threads")
    tv.add_argument(
        "--lr",
        type=float,
        default=3e-4,
        help="peak learning rate (above about 1e-3 the decoder stops reading the images)",
    )
    tv.add_argument("--warmup", type=int, default=200, help="linear warm-up steps")
    tv.add_argument("--first-frame", type=int, default=0, help="training frames are (seed, first-frame + i)")
    tv.add_argument("--closed-weight", type=float, default=1.0, help="sampling weight of closed questions")
    tv.add_argument(
        "--family-weight",
        type=_family_weight,
        action="append",
        default=[],
        metavar="FAMILY=W",
        help="extra sampling weight of one QA family (repeatable), e.g. vehicle_colour_mc=4",
    )
    tv.add_argument(
        "--attn-weight",
        type=float,
        default=0.0,
        help="weight of the tag-attention objective: head 0 of --attn-layer looks where a question's c-tags point",
    )
    tv.add_argument("--attn-layer", type=int, default=2, help="decoder layer of the tag-attention objective")
    tv.add_argument(
        "--option-weight",
        type=float,
        default=0.0,
        help="weight of the option-attention objective: head 0 of --option-layer looks at a multiple-choice question's right option",
    )
    tv.add_argument("--option-layer", type=int, default=3, help="decoder layer of the option-attention objective")
    tv.add_argument(
        "--letter-weight",
        type=float,
        default=0.0,
        help="weight of the letter-attention objective: head 0 of --letter-layer looks from an option's text at its letter",
    )
    tv.add_argument("--letter-layer", type=int, default=1, help="decoder layer of the letter-attention objective")
    tv.add_argument(
        "--readout-weight",
        type=float,
        default=0.0,
        help="weight of the answer-readout objective: at a multiple-choice answer row, the input of --readout-layer names the right option's first word",
    )
    tv.add_argument("--readout-layer", type=int, default=3, help="decoder layer of the answer-readout objective")
    tv.add_argument("--init", default=None, help="continue training from this checkpoint")
    tv.add_argument(
        "--reinit-vision", action="store_true", help="with --init: keep the decoder, start the vision side afresh"
    )
    tv.add_argument(
        "--reinit-language", action="store_true", help="with --init: keep the vision side, start the decoder afresh"
    )
    tv.add_argument(
        "--grow-after",
        type=int,
        nargs="+",
        default=[],
        metavar="LAYER",
        help="with --init: insert a new decoder layer after each of these layers (a copy with zeroed output "
        "projections, so training starts from the same function); the layer options count the grown model",
    )
    tv.add_argument(
        "--store-dtype",
        choices=("float32", "float16", "bfloat16"),
        default="float32",
        help="dtype of the saved weights (training runs in fp32)",
    )
    tv.add_argument(
        "--aux-weight", type=float, default=0.5, help="weight of the dense visual-token objective (0: answers only)"
    )
    tv.add_argument("--aux-scale", type=float, default=4.0, help="cosine-to-logit scale of the visual-token objective")
    tv.add_argument(
        "--patch-aux-weight",
        type=float,
        default=0.0,
        help="weight of the patch objective: a linear probe on the vision tower's patch features names each "
        "patch's contents (motion, light state, ...), before pixel shuffle can average small cues away",
    )
    tv.add_argument(
        "--token-probe-weight",
        type=float,
        default=0.0,
        help="weight of the token probe: a linear probe on the projected visual tokens names each token's "
        "contents, so the projector keeps what the tower sees",
    )
    tv.add_argument("--vision-warmup", type=int, default=0, help="first steps on the visual-token objective alone")
    tv.add_argument(
        "--light-contrast",
        action="store_true",
        help="ask each 'is the traffic light X?' question with the other two colours too (answers from the light's state)",
    )
    tv.add_argument(
        "--view-subset-prob", type=float, default=0.5, help="share of frames shown only some questions' views"
    )
    tv.add_argument(
        "--token-drop-prob", type=float, default=0.35, help="share of frames whose visual tokens are thinned"
    )
    tv.add_argument("--visual-norm", type=float, default=4.0, help="cap on visual-token norm (0: none)")
    tv.add_argument("--probe-frames", type=int, default=24, help="validation frames for the with/without-images probe")
    tv.set_defaults(func=cmd_train_vlm)

    tt = train.add_parser("tokens", help="train the TokenSelector of a model (saved in MODEL_DIR/token_selector)")
    _module_of(
        tt,
        "the selector is saved inside it",
        1200,
        "synthetic frames whose prompts are labelled and trained on",
        minutes=(10.0, "wall-clock budget (labelling takes at most 40%%)"),
    )
    tt.add_argument(
        "--epochs", type=int, default=4, help="passes over the labelled prompts (the budget may stop it sooner)"
    )
    tt.add_argument(
        "--own-layer",
        action="store_true",
        help="train a copy of decoder layer 0 with the head and prune before the decoder (default: the head reads "
        "the model's own frozen layer 0, which then runs once and the rest of the decoder sees only the kept tokens)",
    )
    tt.set_defaults(func=cmd_train_tokens)
    ta = train.add_parser("average", help="the element-wise mean of checkpoints trained from one stage (a model soup)")
    ta.add_argument("checkpoints", nargs="+", help="two or more checkpoint folders of one model config")
    ta.add_argument("--out", required=True, help="where the averaged checkpoint is written")
    ta.set_defaults(func=cmd_train_average)
    td = train.add_parser("draft", help="train the EAGLE-2 draft head of a model (saved in MODEL_DIR/draft)")
    _module_of(
        td,
        "the draft head is saved inside it",
        150,
        "synthetic frames whose questions the model answers to make the training data",
        minutes=(12.0, "wall-clock budget"),
    )
    td.add_argument(
        "--passes",
        type=int,
        default=1,
        help="training-time test: 1 = teacher forcing only; s > 1 also trains on the head's own s-1 predictions",
    )
    td.add_argument(
        "--intermediate",
        type=int,
        default=None,
        metavar="N",
        help="the draft layer's MLP width (default 128; 0 = the target's)",
    )
    td.set_defaults(func=cmd_train_draft)
    to = train.add_parser(
        "openings", help="the answer openings a draft head verifies with the prompt (MODEL_DIR/draft/openings.json)"
    )
    _module_of(to, "with a draft head", 3000, "synthetic training frames whose questions and answers are counted")
    to.add_argument("--depth", type=int, default=4, help="tokens per opening, EOS included")
    to.add_argument("--max-nodes", type=int, default=12, help="nodes of one question's trie (extra prompt rows)")
    to.add_argument(
        "--min-share", type=float, default=0.03, help="an opening's least share of its question kind's answers"
    )
    to.add_argument(
        "--key-words",
        default="4,2",
        help="question words a key holds, longest first: a question takes the longest key seen in training",
    )
    to.set_defaults(func=cmd_train_openings)

    from litevlm.eval.score import add_score_parser, add_scoring_options

    e = sub.add_parser("eval", help="DriveLM scores of a pipeline configuration (the official evaluation by default)")
    e.add_argument("--data", required=True, help="a folder written by `litevlm data synth`, or a DriveLM JSON file")
    e.add_argument("--images", default=None, help="image root for a DriveLM JSON file")
    e.add_argument("--n", type=int, default=None, help="evaluate the first N questions only")
    e.add_argument(
        "--blank", action="store_true", help="replace every camera image by an empty road (does the model look?)"
    )
    e.add_argument(
        "--records",
        default=None,
        help="write per-question records (answer, GT, tags, views, visual tokens, stage times) to this JSON file",
    )
    e.add_argument(
        "--predictions-out",
        default=None,
        metavar="FILE",
        help="write the challenge's submission list [{id, question, answer}] for every question (not with --n)",
    )
    e.add_argument("--json", action="store_true")
    add_scoring_options(e)
    _add_pipeline_options(e)
    e.set_defaults(func=cmd_eval)

    q = sub.add_parser("quantize", help="FP8 post-training quantisation into a new checkpoint")
    q.add_argument("--out", required=True)
    q.add_argument("--calib", type=int, default=64, help="calibration questions (drawn from seed-2 synthetic frames)")
    q.add_argument("--recipe", default="fp8-static-per-tensor", help="fp8-static-per-tensor | fp8-dynamic-per-row")
    q.add_argument("--vision", action="store_true", help="quantise the vision tower and projector too")
    q.add_argument("--json", action="store_true")
    _add_pipeline_options(q)
    q.set_defaults(func=cmd_quantize)

    b = sub.add_parser("bench", help="the paper's Table 1 re-measured: every configuration on the same questions")
    b.add_argument("--model", default="drive-tiny")
    b.add_argument(
        "--data", default=None, help="a synth folder or DriveLM JSON (default: held-out synthetic frames, seed 1)"
    )
    b.add_argument("--n", type=int, default=60, help="questions measured (after the warm-up ones)")
    b.add_argument("--warmup", type=int, default=3)
    b.add_argument(
        "--shape",
        default=None,
        help="random weights at a real model's shapes (2b, 1b, internvl3-2b, ...): latency only",
    )
    b.add_argument("--max-new-tokens", type=int, default=160)
    b.add_argument(
        "--cuda-graphs",
        action="store_true",
        help="with --shape on a GPU: replay plain decode steps and fixed-size verifications as CUDA graphs "
        "(capture time reported apart)",
    )
    b.add_argument("--no-transformers", action="store_true", help="skip the transformers generate rows")
    b.add_argument(
        "--configs",
        default=None,
        metavar="NAMES",
        help="comma-separated rows to run (e.g. 'baseline,litevlm,litevlm bf16'; default: every row)",
    )
    b.add_argument("--plot", default=None, help="save the stage plots to this PNG")
    b.add_argument("--json", action="store_true")
    b.set_defaults(func=cmd_bench)

    c = sub.add_parser("convert", help="convert checkpoints to and from transformers InternVL")
    c.add_argument("--to", choices=["hf", "litevlm"], required=True)
    c.add_argument("src")
    c.add_argument("dst")
    c.set_defaults(func=cmd_convert)

    from litevlm.select.label_views import add_label_views_parser
    from litevlm.select.views import add_views_parser
    from litevlm.serve import add_serve_parser
    from litevlm.train.views import add_train_views_parser

    add_views_parser(sub)
    add_score_parser(sub)
    add_label_views_parser(sub)
    add_train_views_parser(train)
    add_serve_parser(sub, _add_pipeline_options, _pipeline)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        args.func(args)
    except LiteVLMError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
