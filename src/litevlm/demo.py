"""`litevlm demo`: LiteVLM and the baseline on one fresh synthetic scene, side by side.

Both pipelines answer the same questions about a scene the model never saw: each answer beside the truth, the
views each pipeline encoded, the latency of both by the measure of `litevlm bench` (each stage's mean over the answers,
`other` for what an answer's end-to-end time holds outside the five stages, so that they add up to the mean total,
p50 and p90 of the total beside it; the images' preprocessing apart), and the speed-up: the ratio of the mean
totals, measured interleaved question by question so that machine load hits both alike. A precision the device only
emulates (an FP8 checkpoint on a CPU) gives no speed-up.

Two measures side by side, each with its speed-up: the paper's (the five stages of an answer, `Answer.timings_ms`
"total") and what a user waits (images to answer, "e2e": reading and cutting the images, the stages and what lies
between them). Each pipeline asks a round's questions of one frame (`Pipeline.frame`), as a car asks several
questions of one moment: a view is read and encoded by the first question that needs it, and the questions after
it reuse it. One LiteVLM answer is drawn with the visual tokens it kept (`litevlm.explain`), beside the picture.

The model is drive-hd by default, the one whose prompts are shaped like the paper's (most of them visual tokens).
Accuracy counts what a round can count fairly: the closed questions answered right (yes/no and multiple choice,
whose truth is one exact answer; an open answer worded otherwise than the truth is not wrong), and the round's
DriveLM score as `litevlm eval` computes it (`litevlm.eval.score.drivelm_score`, offline: no judge, whose part
counts as 0, as the score's note says).
"""

from __future__ import annotations

import json
import statistics
import time
from pathlib import Path

from litevlm.cameras import CAMERAS
from litevlm.errors import LiteVLMError
from litevlm.eval.metrics import answered_right
from litevlm.eval.timing import emulated_precision, mean_latency
from litevlm.pipeline import STAGES, Pipeline

GRID = (("CAM_FRONT_LEFT", "CAM_FRONT", "CAM_FRONT_RIGHT"), ("CAM_BACK_LEFT", "CAM_BACK", "CAM_BACK_RIGHT"))
LABELS = {"litevlm": "LiteVLM", "baseline": "baseline"}
DEFAULT_MODEL = "drive-hd"


def grid_path(out: str | Path) -> Path:
    """Where the picture goes: `out` itself (an image file name in an existing folder), or demo.png inside
    `out` when it is a folder; anything else is refused before any work is done."""
    from PIL import Image

    path = Path(out)
    if path.is_dir():
        path = path / "demo.png"
    if path.suffix.lower() not in Image.registered_extensions():
        raise LiteVLMError(f"--out {out}: not an image file name (.png, .jpg, ...) or a folder")
    if not path.parent.is_dir():
        raise LiteVLMError(f"--out {out}: the folder {path.parent} does not exist")
    return path


def save_grid(images: dict, path: str | Path, tile=(400, 225)) -> Path:
    """The six views in a labelled 2x3 grid, laid out as the cameras sit on the car (front row on top)."""
    from PIL import Image, ImageDraw

    w, h = tile
    canvas = Image.new("RGB", (3 * w, 2 * h), "black")
    draw = ImageDraw.Draw(canvas)
    for r, row in enumerate(GRID):
        for c, cam in enumerate(row):
            canvas.paste(images[cam].convert("RGB").resize(tile), (c * w, r * h))
            draw.rectangle([c * w, r * h, c * w + 8 * len(cam) + 8, r * h + 16], fill="black")
            draw.text((c * w + 4, r * h + 3), cam, fill="white")
    path = grid_path(path)
    canvas.save(path)
    return path


def pick_questions(qas, n: int):
    """Up to n questions, round-robin over the four categories so every kind shows, a closed question (yes/no,
    multiple choice: one exact answer is right) and an open one in turn where the category has the kind due."""
    by_cat: dict[str, list] = {}
    for qa in qas:
        by_cat.setdefault(qa.category, []).append(qa)
    picked, closed = [], True
    while len(picked) < n and any(by_cat.values()):
        for cat in ("perception", "prediction", "planning", "behavior"):
            left = by_cat.get(cat)
            if left and len(picked) < n:
                qa = next((q for q in left if q.closed == closed), left[0])
                left.remove(qa)
                picked.append(qa)
                if qa.closed == closed:  # the kind due was taken: the other one is due next
                    closed = not closed
    return picked


def pipelines(model: str, configs: tuple[str, ...]) -> dict[str, Pipeline]:
    """The pipelines shown: the baseline (six views, no pruning, plain decoding) and the full LiteVLM
    configuration (`--litevlm`: ViewSelector, TokenSelector, EAGLE-2), on the same weights."""
    from litevlm.presets import LITEVLM

    options = {"litevlm": LITEVLM, "baseline": {}}
    return {name: Pipeline.from_pretrained(model, **options[name]) for name in configs}


def measure(pipes: dict[str, Pipeline], questions, images, rounds: int) -> tuple[dict, dict]:
    """Each question answered by every pipeline, `rounds` times, interleaved (the pipeline that goes first
    alternates), each pipeline asking a round's questions of one frame of the images; the answers of the first
    round, and per pipeline every answer's timings (the stages, "total", "e2e") with its end-to-end time less the
    images' preprocessing as "wall" (ms, the device synchronised around the answer)."""
    from litevlm.model.generate import sync

    answers: dict[str, list] = {name: [] for name in pipes}
    timings: dict[str, list] = {name: [] for name in pipes}
    names = list(pipes)
    for rnd in range(rounds):
        frames = {name: pipe.frame(images) for name, pipe in pipes.items()}  # a fresh moment each round
        for i, qa in enumerate(questions):
            order = names if (rnd + i) % 2 == 0 else names[::-1]
            for name in order:
                device = pipes[name].model.device
                sync(device)
                t0 = time.perf_counter()
                ans = frames[name].answer(qa.question)
                sync(device)
                wall = (time.perf_counter() - t0) * 1e3 - ans.timings_ms.get("preprocess", 0.0)
                timings[name].append({**ans.timings_ms, "wall": wall})
                if rnd == 0:
                    answers[name].append(ans)
    return answers, timings


def latency(timings: list[dict]) -> dict[str, float]:
    """`litevlm bench`'s measure over one pipeline's answers (`mean_latency`): `<stage>_ms` means, `other_ms`,
    `total_ms` (the mean end-to-end time, preprocessing apart), `p50_total_ms`, `p90_total_ms`, and `preprocess_ms`."""
    lat = mean_latency({s: [t.get(s, 0.0) for t in timings] for s in STAGES}, [t["wall"] for t in timings])
    return lat | {"preprocess_ms": round(statistics.fmean(t.get("preprocess", 0.0) for t in timings), 3)}


def mean_stages(lat: dict[str, float]) -> dict[str, float]:
    """The mean of each stage, of other, of the total and of the preprocessing apart from it, by stage name (the
    JSON's `mean_ms`)."""
    return {s: lat[f"{s}_ms"] for s in (*STAGES, "other", "total", "preprocess")}


def explained(pipes: dict[str, Pipeline], answers: dict[str, list]) -> tuple[str, int]:
    """The answer the explain figure draws: LiteVLM's (else the one configuration's) first that pruned tokens, else
    its first; as (configuration, question number)."""
    name = "litevlm" if "litevlm" in pipes else next(iter(pipes))
    pruned = [i for i, a in enumerate(answers[name]) if a.kept_tokens is not None]
    return name, (pruned or [0])[0]


def round_scores(rows: list[dict], questions, frame) -> tuple[dict | None, str]:
    """Each pipeline's DriveLM score of the round (`drivelm_score`, the official computation `litevlm eval` runs,
    without a judge): {name: {final, accuracy, language, match, note}}, and a note saying what it is; None and the
    reason where the score cannot be computed here (pycocoevalcap, which the language part needs, missing). The
    records go in the frame's own order (perception first), as the official evaluation reads a frame."""
    from litevlm.eval.metrics import language_scorers
    from litevlm.eval.score import drivelm_score

    try:
        language_scorers()
    except LiteVLMError as e:
        return None, f"no DriveLM score: {e}"
    order = sorted(range(len(questions)), key=lambda i: frame.qas.index(questions[i]))
    scores = {}
    for name in rows[0]["answers"] if rows else ():
        records = [
            {
                "id": f"{frame.frame_id}_{i}",
                "question": questions[i].question,
                "answer": rows[i]["answers"][name]["answer"],
                "gt": questions[i].answer,
                "tag": [questions[i].tag],
                "closed": questions[i].closed,
                "frame": frame.frame_id,
            }
            for i in order
        ]
        result = drivelm_score(records)
        parts = ("final", "accuracy", "language", "match")
        scores[name] = {k: None if result[k] is None else round(result[k], 4) for k in parts}
        empty = [p for p in result["missing"] if p != "judge"]
        notes = ["no judge here: its 0.4 and the judge half of match count as 0"]
        notes += [f"no {p} question in the round: {p} counts as 0" for p in empty]
        notes.append(f"the graph gate dropped {result['gated_out']} of {result['n']} questions")
        scores[name]["note"] = "; ".join(notes)
    return scores, "as `litevlm eval` computes it"


def run_demo(
    model: str = DEFAULT_MODEL,
    out: str = "demo.png",
    seed: int = 2026,
    n_questions: int = 6,
    as_json: bool = False,
    configs: tuple[str, ...] = ("litevlm", "baseline"),
    rounds: int = 3,
    explain: str | Path | None = None,
    llama_cpp: bool = True,
) -> dict:
    """explain: where the figure of one answer's kept tokens goes (a .png; default demo_explain.png beside the
    picture). llama_cpp: where llama-cpp-python is installed (the `llamacpp` extra), llama.cpp answers the same
    questions too (`peer_row`)."""
    from litevlm.data.synthetic import make_frame, render_views
    from litevlm.explain import check_out
    from litevlm.explain import explain as draw

    unknown = [c for c in configs if c not in LABELS]
    if unknown or not configs:
        raise LiteVLMError(f"demo configurations {unknown or configs}: choose among {', '.join(LABELS)}")
    # a bad --out or explain path fails before the model loads
    picture = grid_path(out)
    explain_path = check_out(explain if explain is not None else picture.parent / "demo_explain.png")
    pipes = pipelines(model, configs)
    frame = make_frame(seed, 0)
    images = render_views(frame, size=(800, 450))
    grid = save_grid(images, out)
    for pipe in pipes.values():  # the first call allocates caches; keep it out of the tables
        pipe.answer("Is there a car in front of the ego vehicle?", images)
    questions = pick_questions(frame.qas, n_questions)
    answers, timings = measure(pipes, questions, images, rounds)
    shown, k = explained(pipes, answers)
    draw(pipes[shown], images, answers[shown][k], questions[k].question, explain_path)
    lat = {name: latency(t) for name, t in timings.items()}
    # the two measures: the paper's (the five stages) and images to answer (e2e), means over every timed answer
    stages_ms = {name: round(statistics.fmean(t["total"] for t in ts), 3) for name, ts in timings.items()}
    e2e_ms = {name: round(statistics.fmean(t["e2e"] for t in ts), 3) for name, ts in timings.items()}
    stages = {name: mean_stages(lt) for name, lt in lat.items()}
    emulated = [name for name, pipe in pipes.items() if emulated_precision(pipe.model)]
    rows = [
        {
            "category": qa.category,
            "question": qa.question,
            "truth": qa.answer,
            "closed": qa.closed,  # yes/no or multiple choice: one exact answer is right
            "answers": {name: {"answer": answers[name][i].text, "views": answers[name][i].views} for name in pipes},
        }
        for i, qa in enumerate(questions)
    ]
    right = {name: [_same(r["answers"][name]["answer"], r["truth"]) for r in rows] for name in pipes}
    closed = {name: sum(ok and r["closed"] for ok, r in zip(right[name], rows)) for name in pipes}
    drivelm, drivelm_note = round_scores(rows, questions, frame)
    timed = len(pipes) == 2 and not emulated and stages["litevlm"]["total"] > 0
    speedup = stages["baseline"]["total"] / stages["litevlm"]["total"] if timed else None

    def by(means: dict) -> float | None:
        return means["baseline"] / means["litevlm"] if timed and means["litevlm"] > 0 else None

    result = {
        "model": next(iter(pipes.values())).name,
        "scene": {"seed": seed, "frame": 0},
        "picture": str(grid),
        "questions": rows,
        "closed": closed,  # closed questions answered right (case, spacing and a final period aside)
        "n_closed": sum(r["closed"] for r in rows),
        "drivelm": drivelm,  # each pipeline's DriveLM score of the round, None where it cannot be computed
        "drivelm_note": drivelm_note,
        "n": len(rows),
        "answers_timed": len(rows) * rounds,
        "mean_ms": stages,
        "p50_total_ms": {name: lt["p50_total_ms"] for name, lt in lat.items()},
        "p90_total_ms": {name: lt["p90_total_ms"] for name, lt in lat.items()},
        "speedup": speedup,  # the baseline's mean total / LiteVLM's
        "emulated": emulated,  # pipelines whose precision the device only emulates: their times are no speed figure
        "stages_ms": stages_ms,  # mean of each answer's five stages: the paper's measure
        "e2e_ms": e2e_ms,  # mean from the images as given to the last token: what a user waits
        "speedup_stages": by(stages_ms),
        "speedup_e2e": by(e2e_ms),
        "explain": str(explain_path),  # the figure of one answer's kept tokens
        "explained": {"config": shown, "question": questions[k].question},
    }
    if llama_cpp and "baseline" in pipes:
        from litevlm.eval.llamacpp import available

        if available():
            lite = e2e_ms.get("litevlm")
            try:
                result["llama_cpp"] = peer_row(model, pipes["baseline"], questions, images, rounds, rows, lite)
            except LiteVLMError as e:  # a model GGUF cannot express: the demo goes on without the row, saying why
                result["llama_cpp"] = {"skipped": str(e)}
    if as_json:
        print(json.dumps(result, separators=(",", ":")))
    else:
        print_demo(result)
    return result


def peer_row(
    model: str, base: Pipeline, questions, images, rounds: int, rows: list[dict], litevlm_e2e: float | None
) -> dict:
    """llama.cpp (llama-cpp-python, the model converted to an f32 GGUF in a temporary folder) answering the round's
    questions on the baseline's own tiles and prompt (`litevlm.eval.llamacpp.answer_on_tiles`), greedy, `rounds`
    times after one warm-up answer: its mean e2e from the images, its answers, how many equal the baseline's, and
    how many times as fast LiteVLM answered."""
    import tempfile

    import llama_cpp as llama_cpp_module

    from litevlm.eval.llamacpp import LlamaCpp, answer_on_tiles
    from litevlm.model.gguf import write_gguf

    with tempfile.TemporaryDirectory() as tmp:
        files = write_gguf(model, Path(tmp), "f32")
        with LlamaCpp(files) as lc:
            answer_on_tiles(lc, base, questions[0].question, images, base.max_new_tokens)  # warm-up, not timed
            texts, e2e = [], []
            for _ in range(rounds):
                for qa in questions:
                    text, a = answer_on_tiles(lc, base, qa.question, images, base.max_new_tokens)
                    texts.append(text)
                    e2e.append(a.ms["e2e"])
    answers = texts[: len(questions)]
    same = sum(a == r["answers"]["baseline"]["answer"] for a, r in zip(answers, rows))
    mean = round(statistics.fmean(e2e), 3)
    return {
        "engine": f"llama.cpp f32 (llama-cpp-python {llama_cpp_module.__version__})",
        "e2e_ms": mean,
        "answers": answers,
        "same_as_baseline": same,
        "litevlm_speedup": round(mean / litevlm_e2e, 2) if litevlm_e2e else None,
    }


def _same(answer: str, truth: str) -> bool:
    """An answer equal to the truth, case, spacing and a final period aside (a closed question's measure)."""
    return answered_right({"answer": answer, "gt": truth})


def _score(value: float | None) -> str:
    return "-" if value is None else f"{value:.3f}"


def _views(views: list[str]) -> str:
    return f"all {len(CAMERAS)} views" if len(views) == len(CAMERAS) else ", ".join(views)


def print_demo(result: dict) -> None:
    names = list(result["mean_ms"])
    width = max(len(LABELS[n]) for n in names) + 2
    print(f"A scene the model never saw (seed {result['scene']['seed']}); its six views: {result['picture']}\n")
    for r in result["questions"]:
        print(f"[{r['category']}] {r['question']}")
        print(f"  {'truth':<{width}}   {r['truth']}")
        for name in names:
            a = r["answers"][name]
            mark = "ok" if _same(a["answer"], r["truth"]) else ""
            print(f"  {LABELS[name]:<{width}}{mark:<3}{a['answer']}   [{_views(a['views'])}]")
        print()
    if result["n_closed"]:
        print(
            "closed questions answered right (yes/no, multiple choice): "
            + ", ".join(f"{LABELS[n]} {result['closed'][n]}/{result['n_closed']}" for n in names)
        )
    else:
        print("no closed question (yes/no, multiple choice) in this round: --questions N asks more")
    if result["drivelm"] is None:
        print(result["drivelm_note"])
    else:
        scores = result["drivelm"]
        cells = ", ".join(f"{LABELS[n]} {_score(scores[n]['final'])}" for n in names)
        print(f"DriveLM score of the round, {result['drivelm_note']}: {cells}")
        parts = ("accuracy", "language", "match")
        cells = "; ".join(f"{LABELS[n]} " + ", ".join(_score(scores[n][k]) for k in parts) for n in names)
        print(f"  {', '.join(parts)}: {cells}")
        notes = {scores[n]["note"] for n in names}
        for note in sorted(notes):
            print(f"  ({note})")
    print(
        f"\nlatency, mean ms over {result['answers_timed']} answers each (this machine); the stages and other"
        " (the rest of the answer) add up to the total:"
    )
    print(f"  {'stage':<14}" + "".join(f"{LABELS[n]:>12}{'share':>8}" for n in names))
    for s in (*STAGES, "other", "total"):
        cells = ""
        for n in names:
            ms, total = result["mean_ms"][n][s], result["mean_ms"][n]["total"] or 1.0
            cells += f"{ms:12.2f}" + (f"{'':8}" if s == "total" else f"{100 * ms / total:7.1f}%")
        print(f"  {s:<14}{cells}")
    for key, label in (("p50_total_ms", "total p50"), ("p90_total_ms", "total p90")):
        print(f"  {label:<14}" + "".join(f"{result[key][n]:12.2f}{'':8}" for n in names))
    print(f"  {'preprocess':<14}" + "".join(f"{result['mean_ms'][n]['preprocess']:12.2f}{'':8}" for n in names))
    print("  (preprocess: the images cut into tiles, apart from the total as in `litevlm bench`)")
    if result["emulated"]:
        print(
            f"\n{', '.join(LABELS[n] for n in result['emulated'])}: a precision this device only emulates"
            " (FP8 without FP8 kernels); the times are no speed figure, and no speed-up is given."
        )
    print("\nboth measures, mean ms per answer (each pipeline asks a round's questions of one frame):")
    speed = result["speedup_stages"] is not None
    print(f"  {'':<36}" + "".join(f"{LABELS[n]:>12}" for n in names) + (f"{'speed-up':>12}" if speed else ""))
    for key, label in (("stages", "paper's measure (the five stages)"), ("e2e", "images to answer (e2e)")):
        cells = "".join(f"{result[f'{key}_ms'][n]:12.2f}" for n in names)
        print(f"  {label:<36}{cells}" + (f"{result[f'speedup_{key}']:11.2f}x" if speed else ""))
    if result["speedup"] is not None:
        print(
            f"\nLiteVLM answered {result['speedup']:.2f}x as fast as the baseline "
            "(the ratio of their mean totals, measured side by side)."
        )
    peer = result.get("llama_cpp")
    if peer and "skipped" in peer:
        print(f"\nllama.cpp's row is left out: {peer['skipped']}")
    elif peer:
        speed = f"; LiteVLM answered {peer['litevlm_speedup']:.2f}x as fast" if peer["litevlm_speedup"] else ""
        print(
            f"\n{peer['engine']}, on the baseline's own tiles and prompt: {peer['e2e_ms']:.2f} ms a question from the"
            f" images{speed}; its answers equal the baseline's on {peer['same_as_baseline']} of {result['n']}."
        )
    shown = result["explained"]
    print(
        f"\nwhich views and visual tokens {LABELS[shown['config']]} kept for {shown['question']!r}: {result['explain']}"
    )
