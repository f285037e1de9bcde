"""The results page: run the benchmarks, keep each run's JSON, and write RESULTS.md from it.

Every benchmark script prints one JSON object as its last stdout line. `--run` runs them (all, or those named
with `--only`), saving each as `benchmarks/results/NAME.json` with the exact command, the date, the commit and
the machine beside the script's own JSON; then, with or without `--run`, the page is written from whatever
`benchmarks/results/*.json` holds, one table per topic with its command under it (as nanochat's report.py).

    python benchmarks/report.py --run                  # every benchmark, then RESULTS.md
    python benchmarks/report.py --run --only bench_1thread,view_selection --n 20   # a quick try
    python benchmarks/report.py                        # RESULTS.md from the JSON already there
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import shlex
import shutil
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

from litevlm.eval.bench import ACCURACY_COLUMNS, speed_figure

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DATA = ".bench-data"  # the synthetic splits the runs read, made on first use (git ignores it)
HELDOUT = f"{DATA}/heldout"
HELDOUT_VIEWS = f"{DATA}/heldout_views"
SPLITS = {
    HELDOUT: ["--frames", "100", "--seed", "1"],
    HELDOUT_VIEWS: ["--frames", "60", "--seed", "1", "--width", "320", "--height", "180"],
}
MODEL = "src/litevlm/weights/drive-tiny"
HD = "drive-hd"  # the paper-shaped embedded model (src/litevlm/weights/drive-hd once it ships)
NEUTRAL = f"{DATA}/drive-hd-neutral"  # drive-hd on its stage before the selector-taught one (neutral_decoder.py)
MADE_BY = {NEUTRAL: ["python", "benchmarks/neutral_decoder.py", "--out", NEUTRAL]}  # what `needs` makes, not a split


@dataclass
class Benchmark:
    """One run: its command (argv after `python`), the question count `--n` replaces, and whether it runs on one
    pinned thread (`OMP_NUM_THREADS=1`, on core 1 through `taskset` where the machine has one)."""

    name: str
    argv: list[str]
    n: int | None = None  # default question count (None: the script's own, e.g. a whole split)
    n_flag: str = "--n"
    pinned: bool = True
    needs: list[str] = field(default_factory=list)  # splits it reads

    def command(self, n: int | None) -> list[str]:
        """The command as the page shows it: `litevlm ...` for the CLI, `python SCRIPT ...` for a script."""
        n = n if n is not None else self.n
        head = [] if self.argv[0] == "litevlm" else ["python"]
        return [*head, *self.argv, *([self.n_flag, str(n)] if n is not None else [])]


def pruning(
    model: str, name: str, n: int = 200, extra: tuple[str, ...] = (), per_view: bool = True, timed: int = 10
) -> Benchmark:
    """The pruning benchmark on one model over n questions (the per-camera variants too, `timed` prompts timed); its
    JSON is named by the model (token_pruning_drive-hd.json)."""
    argv = ["benchmarks/token_pruning.py", "--model", model, "--data", HELDOUT, "--threads", "1"]
    argv += ["--timing-n", str(timed), *(["--per-view"] if per_view else [])]
    argv += ["--plot", f"benchmarks/results/token_pruning_{name}.png", *extra]
    return Benchmark(f"token_pruning_{name}", argv, n=n, needs=[HELDOUT, *([model] if model in MADE_BY else [])])


# drive-hd: r = 0.05 too, where the methods part, and its TokenSelector's choice applied inside the decoder as well
HD_METHODS = ("--methods", "token-selector,token-selector-k2,fastv-k1,fastv-k2,dart,divprune,cdpruner,random,uniform")
HD_PRUNING = ("--r", "0.05,0.1,0.2,0.3,0.5,0.7", *HD_METHODS)
# drive-hd with every view in the prompt, as when the ViewSelector is off: most visual tokens are then of views the
# question does not ask about. r up to 0.3, and 0.05.
HD_ALL_VIEWS = ("--views", "all", "--r", "0.05,0.1,0.2,0.3", *HD_METHODS)
# the neutral decoder: the same races at the ratios where the verdicts are read (r <= 0.3), untimed (the timing is
# the shipped decoder's: the two decoders have the same shapes)
NEUTRAL_PRUNING = ("--r", "0.05,0.1,0.2,0.3", *HD_METHODS)
# drive-hd on every question of the held-out split (1688), the shipped TokenSelector (and its choice applied before
# layer 2) against the strongest training-free methods at r = 0.05 to 0.3, untimed (the timing is the 600-question
# page's): the race is decided here, on paired intervals, so more questions and fewer methods.
HD_ALL_QUESTIONS = (
    "--r",
    "0.05,0.1,0.2,0.3",
    "--methods",
    "token-selector,token-selector-k2,fastv-k2,dart,divprune,cdpruner",
)
HELDOUT_QUESTIONS = 1688
BATCH_ARGV = ["litevlm", "bench", "--model", HD, "--data", HELDOUT, "--json", "--batch", "8", "--no-transformers"]
FRAMES_ARGV = ["litevlm", "bench", "--model", HD, "--data", HELDOUT, "--json", "--questions-per-frame", "6"]
FRAMES_ARGV += ["--configs", "baseline,litevlm", "--no-transformers"]


def benchmarks() -> list[Benchmark]:
    bench = ["litevlm", "bench", "--data", HELDOUT, "--json"]
    bench_hd = ["litevlm", "bench", "--model", HD, "--data", HELDOUT, "--json"]
    out = [
        Benchmark(
            "bench_hd_1thread",
            [*bench_hd, "--plot", "benchmarks/results/bench_hd_1thread.png"],
            n=100,
            needs=[HELDOUT],
        ),
        Benchmark("bench_hd_default_threads", bench_hd, n=100, pinned=False, needs=[HELDOUT]),
        # each frame's six questions through one Pipeline.frame beside the same questions one a frame (Table 1's way)
        Benchmark("bench_hd_frames", FRAMES_ARGV, n=96, needs=[HELDOUT]),
        Benchmark("bench_hd_frames_default_threads", FRAMES_ARGV, n=96, pinned=False, needs=[HELDOUT]),
        Benchmark(
            "before_after_hd",  # the change that counted preprocessing: the paper's measure must not move
            ["benchmarks/before_after.py", "--before", "453cfbe", "--model", HD, "--data", HELDOUT]
            + ["--configs", "baseline,litevlm"],
            n=100,
            pinned=False,  # it pins its own one-thread runs
            needs=[HELDOUT],
        ),
        Benchmark(
            "explain_hd",
            ["litevlm", "demo", "--model", HD, "--litevlm-only", "--questions", "6", "--json"]
            + ["--out", "benchmarks/results/demo_hd.png", "--explain", "benchmarks/results/explain_hd.png"],
            pinned=False,
        ),
        Benchmark(
            "preprocess",
            ["benchmarks/preprocess.py", "--threads", "1", "--score-n", "400", "--score-jpeg", "--data", HELDOUT],
            needs=[HELDOUT],
        ),
        Benchmark("bench_1thread", [*bench, "--plot", "benchmarks/results/bench_1thread.png"], n=100, needs=[HELDOUT]),
        Benchmark("bench_default_threads", bench, n=100, pinned=False, needs=[HELDOUT]),
        Benchmark(
            "spec_sweep",
            ["benchmarks/spec_sweep.py", "--model", MODEL, "--data", HELDOUT, "--threads", "1"],
            n=100,
            needs=[HELDOUT],
        ),
        # three times the questions: pruners differ by a few; untimed (Table 1 times the stages), so that two runs of
        # accuracy alone can share the machine, one a core
        pruning(HD, "drive-hd", n=600, extra=HD_PRUNING, timed=0),
        pruning(HD, "drive-hd-all-views", n=600, extra=HD_ALL_VIEWS, timed=0),
        pruning(HD, "drive-hd-all-questions", n=HELDOUT_QUESTIONS, extra=HD_ALL_QUESTIONS, per_view=False, timed=0),
        # the same races on a decoder no method was trained for
        pruning(NEUTRAL, "drive-hd-neutral", n=600, extra=NEUTRAL_PRUNING, timed=0),
        pruning(NEUTRAL, "drive-hd-neutral-all-views", n=600, extra=HD_ALL_VIEWS, timed=0),
        pruning(
            NEUTRAL,
            "drive-hd-neutral-all-questions",
            n=HELDOUT_QUESTIONS,
            extra=HD_ALL_QUESTIONS,
            per_view=False,
            timed=0,
        ),
        Benchmark(
            "view_selection",
            ["benchmarks/view_selection.py", "--model", MODEL, "--data", HELDOUT_VIEWS, "--threads", "1"],
            needs=[HELDOUT_VIEWS],
        ),
        Benchmark(
            "drive_tiny_views",
            ["benchmarks/drive_tiny_eval.py", "--model", MODEL, "--data", HELDOUT, "--select-views", "--threads", "1"]
            + ["--no-card"],
            needs=[HELDOUT],
        ),
        Benchmark(
            "drive_tiny_six_views",
            ["benchmarks/drive_tiny_eval.py", "--model", MODEL, "--data", HELDOUT, "--threads", "1", "--no-card"],
            needs=[HELDOUT],
        ),
        Benchmark(
            "serve_load", ["benchmarks/serve_load.py", "--model", MODEL], n=200, n_flag="--requests", pinned=False
        ),
        # drive-hd's requests are mostly image decoding, vision and prefill: 48 a level
        Benchmark(
            "serve_load_hd", ["benchmarks/serve_load.py", "--model", HD], n=48, n_flag="--requests", pinned=False
        ),
        # many answers at once: decode tokens/s by batch size, a frame's questions as one batch (pinned and not)
        Benchmark("batch_decode_hd", ["benchmarks/batch_decode.py", "--model", HD, "--threads", "1"]),
        Benchmark("batch_decode_hd_default_threads", ["benchmarks/batch_decode.py", "--model", HD], pinned=False),
        # `litevlm bench --batch 8`: Table 1's questions one at a time beside eight in flight, each row
        Benchmark("bench_batch_hd", [*BATCH_ARGV], n=96, needs=[HELDOUT]),
        Benchmark("bench_batch_hd_default_threads", [*BATCH_ARGV], n=96, pinned=False, needs=[HELDOUT]),
        # not pinned: each replica runs one thread, on a core of its own where the machine has two
        Benchmark(
            "serve_replicas",
            ["benchmarks/serve_replicas.py", "--model", MODEL],
            n=64,
            n_flag="--requests",
            pinned=False,
        ),
        # not pinned: each rank runs one thread, on a core of its own where the machine has two
        Benchmark(
            "dist_eval",
            ["benchmarks/dist_eval.py", "--model", MODEL, "--data", HELDOUT],
            n=300,
            pinned=False,
            needs=[HELDOUT],
        ),
    ]
    # A compiled step's cost, one layer reused against the whole step (cold inductor caches, each in its own process).
    out.append(Benchmark("compile_cost", ["benchmarks/compile_cost.py", "--threads", "1"]))
    # The 2B shapes on this CPU (random weights, fp32, every row): that the real sizes run here, and in what memory.
    # One question after the pipelines' own warm-up answers (a full-prompt answer at these shapes takes minutes).
    out.append(
        Benchmark(
            "bench_2b_cpu",
            ["litevlm", "bench", "--shape", "2b", "--max-new-tokens", "8", "--warmup", "0", "--json"],
            n=1,
            pinned=False,
        )
    )
    return out


# ---------------------------------------------------------------------------------------------------------------
# Running


def machine(pinned: bool) -> dict:
    import torch

    cpu = platform.processor() or platform.machine()
    cpuinfo = Path("/proc/cpuinfo")
    if cpuinfo.exists():
        lines = cpuinfo.read_text().splitlines()
        names = [ln.split(":", 1)[1].strip() for ln in lines if ln.startswith("model name")]
        cpu = names[0] if names else cpu
        # two CPUs of one model name can differ in their vector units, and CPU figures move with them
        flags = next((set(ln.split(":", 1)[1].split()) for ln in lines if ln.startswith("flags")), set())
        isa = "AVX-512" if "avx512f" in flags else "AVX2" if "avx2" in flags else None
        cpu = f"{cpu} ({isa})" if isa else cpu
    return {
        "cpu": cpu,
        "cores": os.cpu_count(),
        "torch": torch.__version__,
        "threads": 1 if pinned else torch.get_num_threads(),
        "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None,
    }


def commit() -> str:
    def git(*a) -> str:
        return subprocess.run(["git", *a], cwd=ROOT, capture_output=True, text=True, check=True).stdout.strip()

    # the runs' own outputs (benchmarks/results) are not code: writing them leaves the code as committed
    dirty = git("status", "--porcelain", "--untracked-files=no", "--", "src", "benchmarks", ":!benchmarks/results")
    return git("rev-parse", "--short", "HEAD") + ("+uncommitted" if dirty else "")


def make_split(path: str) -> str:
    """Make what a run reads where it is not there yet (a synthetic split, or a model MADE_BY a script); its command."""
    if path in MADE_BY:
        cmd = MADE_BY[path]
        if not (ROOT / path / "model.safetensors").is_file():
            print(f"[report] {shlex.join(cmd)}", file=sys.stderr, flush=True)
            subprocess.run(executable(cmd), cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        return shlex.join(cmd)
    cmd = ["litevlm", "data", "synth", "--out", path, *SPLITS[path]]
    if not (ROOT / path).is_dir():  # written beside, then renamed: an interrupted split is never taken as whole
        print(f"[report] {shlex.join(cmd)}", file=sys.stderr, flush=True)
        partial = ROOT / f"{path}.partial"
        shutil.rmtree(partial, ignore_errors=True)
        argv = executable(cmd)
        argv[argv.index(path)] = str(partial)
        subprocess.run(argv, cwd=ROOT, check=True, stdout=subprocess.DEVNULL)
        partial.rename(ROOT / path)
    return shlex.join(cmd)


def executable(cmd: list[str]) -> list[str]:
    """The argv that runs a shown command in this interpreter's environment (its `python`, its `litevlm`)."""
    if cmd[0] == "python":
        return [sys.executable, *cmd[1:]]
    beside = Path(sys.executable).parent / cmd[0]
    return [str(beside) if beside.exists() else cmd[0], *cmd[1:]]


CORE = int(os.environ.get("LITEVLM_REPORT_CORE", "1"))  # the core a pinned run takes (`--core`)


def pinning(b: Benchmark) -> list[str]:
    """What pins a run to one thread, as the page shows it: OMP_NUM_THREADS=1, on core CORE (1) where there is one."""
    if not b.pinned:
        return []
    many = shutil.which("taskset") and (os.cpu_count() or 1) > 1
    return ["OMP_NUM_THREADS=1", *([f"taskset -c {CORE}"] if many else [])]


def shown_command(b: Benchmark, n: int | None = None) -> str:
    """A benchmark's command line as the page shows it, pinning included."""
    return " ".join([*pinning(b), shlex.join(b.command(n))])


def run_one(b: Benchmark, n: int | None) -> dict:
    """Run one benchmark and keep its last stdout line (JSON) with the command, date, commit and machine."""
    setup = [make_split(p) for p in b.needs]
    cmd = b.command(n)
    env = {**os.environ, "PYTHONUNBUFFERED": "1"}
    prefix = pinning(b)
    if b.pinned:
        env["OMP_NUM_THREADS"] = "1"
    shown = shown_command(b, n)
    argv = executable(cmd)
    if len(prefix) > 1:
        argv = ["taskset", "-c", str(CORE), *argv]
    print(f"[report] {shown}", file=sys.stderr, flush=True)
    code = commit()  # taken before the run, which may rewrite its own results
    t0 = time.time()
    proc = subprocess.run(argv, cwd=ROOT, env=env, stdout=subprocess.PIPE, text=True)
    lines = [ln for ln in proc.stdout.splitlines() if ln.strip()]
    if not lines or not lines[-1].lstrip().startswith("{"):
        raise SystemExit(f"{b.name}: no JSON line at the end of its output (exit code {proc.returncode})")
    return {
        "benchmark": b.name,
        "command": shown,
        "setup": setup,
        "date": datetime.datetime.now(datetime.timezone.utc).strftime("%Y-%m-%d %H:%M UTC"),
        "commit": code,
        "machine": machine(b.pinned),
        "exit_code": proc.returncode,
        "seconds": round(time.time() - t0, 1),
        "result": json.loads(lines[-1]),
    }


# ---------------------------------------------------------------------------------------------------------------
# The page


def fmt(v) -> str:
    """How a figure of the JSON appears on the page: floats to at most four decimals, None as n/a."""
    if v is None:
        return "n/a"
    if isinstance(v, bool):
        return "yes" if v else "no"
    if isinstance(v, float):
        return str(round(v, 4))
    return str(v)


def times(v) -> str:
    """A ratio in bold with its x; n/a (no x) where the run did not measure it."""
    return "n/a" if v is None else f"**{fmt(v)}x**"


def table(header: list[str], rows: list[list]) -> list[str]:
    return [
        "| " + " | ".join(header) + " |",
        "|" + "---|" * len(header),
        *("| " + " | ".join(fmt(c) for c in r) + " |" for r in rows),
    ]


def provenance(run: dict) -> list[str]:
    """Under each table: its command (and the data it read), commit, date and machine."""
    m = run["machine"]
    made = {shlex.join(cmd) for cmd in MADE_BY.values()}
    data = "".join(f"; {'model' if s in made else 'data'}: `{s}`" for s in run.get("setup", []))
    line = f"Command: `{run['command']}`{data}. Commit {run['commit']}, {run['date']}, {m['cpu']}, {m['threads']}"
    line += f" thread(s), {run['seconds']} s."
    if run.get("exit_code"):
        line += f" The command exited with code {run['exit_code']}."
    return ["", line, ""]


def missing(what: str, command: str) -> list[str]:
    return [f"**Not measured:** no results file for {what}. `{command}` makes it.", ""]


# Table 1's columns: the paper's measure (the stages and what lies between, `total_ms`), then the images' preprocessing
# and e2e (from the images as handed over to the last token), then accuracy and the speculative decoding's
BENCH_COLUMNS = [
    *("config", "views", "visual_tokens", "input_tokens", "vit_ms", "prefill_ms", "extend_one_ms", "decode_ms"),
    *("select_ms", "other_ms", "total_ms", "p50_total_ms", "p90_total_ms", "speedup", "preprocess_ms", "e2e_ms"),
    *("p50_e2e_ms", "p90_e2e_ms", "e2e_speedup", "score", "tau", "opened_tokens"),
]
HEADERS = {"total_ms": "total_ms (stages, the paper's measure)", "e2e_ms": "e2e_ms (images to answer)"}
E2E = ("e2e_ms", "p50_e2e_ms", "p90_e2e_ms", "e2e_speedup", "preprocess_share")
STAGE_SHARES = {"vit_ms": "vit", "prefill_ms": "prefill", "decode_ms": "decode", "select_ms": "select"}


def earlier_row(r: dict, base: dict | None) -> dict:
    """A row of a run from before the rows were means, in today's terms, from what that run stored and nothing
    else. Its `total_ms` was the median total and `mean_total_ms` the mean, the total being the five stages' sum
    (what lay outside them was not measured). Kept as they were: views, input tokens, extend-one (decode ms summed
    over tokens made: a ratio of means already), score, tau. Derived: `total_ms` = the stored mean; `p50_total_ms` =
    the stored median; each stage's mean = its stored share of the summed time (4 decimals) x the mean total, to 2
    decimals (within about 0.01 ms); `speedup` = the baseline's mean total / the row's. Missing (None): `other_ms`,
    `p90_total_ms`, `visual_tokens`, `preprocess_ms`, e2e, and the split of `select_ms` into view and token
    selection."""
    total, shares = r.get("mean_total_ms"), r.get("shares") or {}
    out = {k: r.get(k) for k in ("config", "views", "input_tokens", "extend_one_ms", "score", "tau", "opened_tokens")}
    out |= {"precision": r.get("precision"), "speed_figure": speed_figure(r), "total_ms": total}
    out |= {"p50_total_ms": r.get("total_ms"), "p90_total_ms": None, "other_ms": None, "visual_tokens": None}
    out |= dict.fromkeys(("preprocess_ms", *E2E))
    for key, share in STAGE_SHARES.items():
        out[key] = round(shares[share] * total, 2) if total is not None and share in shares else None
    base_total = base.get("mean_total_ms") if base is not None and speed_figure(base) else None
    timed = out["speed_figure"] and base_total and total
    out["speedup"] = round(base_total / total, 2) if timed else None
    return out


def earlier(result: dict) -> bool:
    """A run from before the rows were means over the questions (its rows have no `p50_total_ms`)."""
    return any("p50_total_ms" not in r for r in result["rows"])


def bench_rows(result: dict) -> list[dict]:
    """A bench run's rows as the page shows them: means over the questions, `speedup` the ratio of mean totals (a
    run from before that measure through `earlier_row`)."""
    if not earlier(result):
        return result["rows"]
    base = next((r for r in result["rows"] if r["config"] == "baseline"), None)
    return [earlier_row(r, base) for r in result["rows"]]


BENCH_MEASURE = [
    "Two measures side by side. **Stages, the paper's measure** (`total_ms`, `speedup`): vit + prefill + decode +"
    " select + other (what lies between the stages), the images' preprocessing excluded. **Images to answer**"
    " (`e2e_ms`, `e2e_speedup`): from the frames as a caller hands them over (HxWx3 uint8 arrays) to the last token,"
    " `preprocess_ms` (reading and cutting the views into tiles) included. Means over the questions, p50 and p90"
    " beside them; every row answers the same questions in one run, in an order shuffled per question; speed-ups are"
    " the baseline's mean over the row's. `select_ms` is view and token selection; `extend_one_ms` decode ms per"
    " token; `score` the DriveLM final score without a judge from the row's own answers; `tau` tokens per target"
    " pass; `opened_tokens` answer tokens accepted with the prompt. n/a: not measured by that run (e2e came later).",
]
EARLIER = (
    "This run is from before the rows were means: its `total_ms` is the mean of the five stages' sum (`other_ms` n/a),"
    " `p50_total_ms` that sum's median, each stage its stored share times the mean total (to about 0.01 ms);"
    " `visual_tokens`, `p90_total_ms`, `preprocess_ms` and e2e were not stored."
)


def accuracy_line(r: dict) -> str:
    """An accuracy row (a precision the machine only emulates) in one line: its times are no speed figure."""
    figures = ", ".join(f"{c} {fmt(r.get(c))}" for c in ACCURACY_COLUMNS[2:])
    return (
        f"Accuracy only ({r.get('precision')}, emulated here: its times are no speed figure): {r['config']}: {figures}."
    )


def bench_tables(result: dict, only: tuple[str, ...] | None = None) -> list[str]:
    """Table 1 of one run: the timed rows (`only` these configurations, where given), then a line per accuracy row of
    an emulated precision (no times)."""
    rows = [r for r in bench_rows(result) if only is None or r["config"] in only]
    header = [HEADERS.get(c, c) for c in BENCH_COLUMNS]
    out = table(header, [[r.get(c) for c in BENCH_COLUMNS] for r in rows if speed_figure(r)])
    out += [line for r in rows if not speed_figure(r) for line in ("", accuracy_line(r))]
    if earlier(result):
        out += ["", EARLIER]
    return out


def plot_of(run: dict) -> str | None:
    """The Table 1 plot a run drew, if it drew one by today's measure (an earlier run's plot stacked medians)."""
    if "--plot " not in run.get("command", "") or earlier(run["result"]):
        return None
    return run["command"].split("--plot ", 1)[1].split()[0]


def litevlm_row(result: dict) -> dict:
    return next((r for r in bench_rows(result) if r["config"] == "litevlm"), {})


def measures_line(result: dict) -> str:
    """LiteVLM's two speed-ups, the paper's measure and images to answer, and preprocessing's share of its e2e."""
    lite = litevlm_row(result)
    line = (
        f"LiteVLM: {times(lite.get('speedup'))} by the paper's measure, {times(lite.get('e2e_speedup'))} from images"
        " to answer"
    )
    if lite.get("preprocess_share") is not None:
        line += f"; preprocessing {100 * lite['preprocess_share']:.0f}% of its e2e"
    return (
        line
        + f" ({result['questions']} questions, {result['threads']} thread(s), CPU steps: {result.get('cpu_steps')})."
    )


TABLE1 = {  # model -> its two Table 1 runs (benchmark name, thread setting), drive-hd first on the page
    "drive-hd": (("bench_hd_1thread", "one pinned thread"), ("bench_hd_default_threads", "the default threads")),
    "drive-tiny": (("bench_1thread", "one pinned thread"), ("bench_default_threads", "the default threads")),
}
ABOUT = {
    "drive-hd": "drive-hd is the embedded model shaped like the paper's workload: two tiles a camera and one visual"
    " token a ViT patch, so that most of an all-views prompt is visual (the paper's prompts are 96% visual).",
    "drive-tiny": "drive-tiny is the small embedded default (tests, demo): its prompts are about half text. The"
    " rows are measured as in drive-hd's tables.",
}


def not_measured_yet(what: str, b: Benchmark) -> list[str]:
    return [
        f"**Not measured yet:** no results file for {what}. `python benchmarks/report.py --run --only {b.name}` runs"
        f" `{shown_command(b)}`.",
        "",
    ]


def visual_share(result: dict) -> str | None:
    """A sentence on how visual the baseline's prompts are, where the run stored it."""
    base = next((r for r in result.get("rows", []) if r.get("config") == "baseline"), None)
    if not base or not base.get("visual_tokens") or not base.get("input_tokens"):
        return None
    share = 100 * base["visual_tokens"] / base["input_tokens"]
    return (
        f"Its baseline prompts hold {fmt(base['visual_tokens'])} visual tokens of {fmt(base['input_tokens'])}"
        f" ({share:.0f}% visual), means over the questions."
    )


def selection_line(result: dict) -> str | None:
    """What token selection does to the prefill (LiteVLM against "views + eagle", which differ by it alone),
    LiteVLM's score against the baseline's, and each paired row (`litevlm.eval.bench.PAIRS`: view selection, FP8,
    bf16) against the row without its technique or precision."""
    rows = {r["config"]: r for r in bench_rows(result)}
    lite, views, base = rows.get("litevlm"), rows.get("views + eagle"), rows.get("baseline")
    if not lite:
        return None
    parts = []
    if views and views.get("prefill_ms"):
        parts.append(
            f'Token selection takes the prefill of "views + eagle" from {fmt(views["prefill_ms"])} ms to'
            f" {fmt(lite['prefill_ms'])} ms ({100 * lite['prefill_ms'] / views['prefill_ms']:.0f}%; LiteVLM's"
            f" selection of views and tokens takes {fmt(lite.get('select_ms'))} ms)"
        )
    if base and base.get("score") is not None and lite.get("score") is not None:
        line = f"LiteVLM scores {fmt(lite['score'])} against the baseline's {fmt(base['score'])}"
        paired = lite.get("vs_baseline") or {}
        if paired.get("final"):
            line += f", {paired_text(paired['final'], 'LiteVLM', 'the baseline')}"
            if paired.get("closed"):
                line += f"; closed accuracy {paired_text(paired['closed'], 'LiteVLM', 'the baseline')}"
        else:
            line += f" ({lite['score'] - base['score']:+.4f}, no interval in this run)"
        parts.append(line)
    for row in rows.values():  # one technique or precision alone, each against the same pipeline without it
        pair = row.get("vs_pair") or {}
        if pair.get("final"):
            name, other = row["config"], pair["against"]
            parts.append(f'{pair["measures"]} ("{name}" less "{other}"), {paired_text(pair["final"], name, other)}')
    if not parts:
        return None
    return "; ".join(parts) + "."


def paired_text(d: dict, a: str, b: str) -> str:
    """A stored paired difference (`Paired.to_dict`): "difference +0.0247 [-0.0011, +0.0502] over 100 questions in
    17 frames, level" (or "A ahead"), each side's standard error beside it."""
    from litevlm.eval.intervals import Paired

    p = Paired(**{k: d[k] for k in ("a", "b", "se_a", "se_b", "diff", "low", "high", "n", "frames")})
    se = f" (standard errors {p.se_a:.4f} and {p.se_b:.4f})" if p.se_a is not None else ""
    return f"paired difference {interval(p)}{se} over {p.n} questions in {p.frames} frames: {side(p, a, b)}"


def bf16_line(result: dict) -> str | None:
    """The bf16 rows (where the CPU multiplies bf16 natively) read against both baselines: over the fp32 baseline
    the ratio holds precision and techniques together, over the bf16 baseline the techniques alone."""
    rows = {r["config"]: r for r in bench_rows(result)}
    lite, base, base16 = rows.get("litevlm bf16"), rows.get("baseline"), rows.get("baseline bf16")
    if not lite or not base or not base16 or not lite.get("total_ms") or not base16.get("total_ms"):
        return None
    line = (
        f"With the vision tower and the prefill in bf16 (this CPU multiplies bf16 natively), LiteVLM is"
        f" {base['total_ms'] / lite['total_ms']:.2f}x the fp32 baseline (precision and the techniques together) and"
        f" {base16['total_ms'] / lite['total_ms']:.2f}x the bf16 baseline (the techniques alone)"
    )
    if lite.get("score") is not None and base.get("score") is not None:
        line += f"; it scores {fmt(lite['score'])} ({lite['score'] - base['score']:+.4f} on the fp32 baseline)"
    return line + "."


def section_bench(runs: dict, model: str, first: bool) -> list[str]:
    """Table 1 on `model`, at one pinned thread and at the default threads; the measures explained in the `first`."""
    out = [f"## Table 1: every configuration on {model}, side by side", "", ABOUT[model]]
    out += ["", *BENCH_MEASURE] if first else []
    known = {b.name: b for b in benchmarks()}
    for name, label in TABLE1[model]:
        run = runs.get(name)
        out += ["", f"### {model} at {label}", ""]
        if run is None:
            what = f"`litevlm bench` on {model} at {label}"
            out += (
                not_measured_yet(what, known[name])
                if model != "drive-tiny"
                else missing(f"`litevlm bench` at {label}", f"python benchmarks/report.py --run --only {name}")
            )
            continue
        res = run["result"]
        if model == "drive-tiny" and name != TABLE1[model][0][0]:  # the default model's second table: its measures
            out += [f"{measures_line(res)} The table is in {json_of(name)}.", *provenance(run)]
            continue
        # the two measures first, then the reading of the table: prompts, token selection, bf16
        notes = [x for x in (visual_share(res), selection_line(res), bf16_line(res)) if x]
        if model == "drive-tiny":  # the small model's table: the paper's path, every row in its JSON
            others = "FastV, EAGLE alone, views + EAGLE, bf16, transformers"
            notes.append(f"Its other rows ({others}) are in {json_of(name)}.")
        only = TINY_ROWS if model == "drive-tiny" else None
        out += [" ".join([measures_line(res), *notes]), "", *bench_tables(res, only)]
        out += provenance(run)
        plot = plot_of(run)
        if plot:
            out += [f"![Table 1 stages on {model}]({plot})" if model != "drive-tiny" else f"![Table 1 stages]({plot})"]
            out += [""]
        elif "--plot " in run["command"]:
            out += [f"Its plot, drawn from medians, is not shown: `python benchmarks/report.py --run --only {name}`"]
            out += ["draws it again by this measure.", ""]
    return out


TINY_ROWS = ("baseline", "litevlm", "litevlm fp8")
FRAMES = (("bench_hd_frames", "one pinned thread"), ("bench_hd_frames_default_threads", "the default threads"))
FRAME_COLUMNS = [
    *("config", "mode", "questions_per_frame", "views_encoded_per_question", "views_reused_per_question"),
    *("preprocess_ms", "vit_ms", "total_ms"),
    *("e2e_ms", "p50_e2e_ms", "p90_e2e_ms", "e2e_vs_strangers", "answers_equal", "score", "closed_accuracy"),
]


def frame_line(res: dict) -> str | None:
    """LiteVLM's mean e2e per question through one frame against one question a frame, and whether the answers are
    the same."""
    lite = next((r for r in res["frame_rows"] if r["config"] == "litevlm" and r["mode"] == "frame"), None)
    if lite is None:
        return None
    line = (
        f"LiteVLM's mean e2e per question through a frame of {lite['questions_per_frame']} is"
        f" **{fmt(lite['e2e_vs_strangers'])}** of its one-question-a-frame figure; answers equal:"
        f" {fmt(lite['answers_equal'])} ({res['questions']} questions in {res['frames']} frames,"
        f" {res['threads']} thread(s))."
    )
    paired = (lite.get("vs_strangers") or {}).get("final")
    if paired:
        line += (
            f" Its score against the same questions asked as strangers: {paired_text(paired, 'frame', 'strangers')}."
        )
    bound = frame_bound(res)
    return line + (f" {bound}" if bound else "")


def frame_bound(res: dict) -> str | None:
    """What a frame can save at most, from the strangers row: only preprocessing and the encoder are shared, so with
    the views encoded per question as the frame row encodes them, the rest (selection, prefill, decode) stays."""
    rows = {(r["config"], r["mode"]): r for r in res["frame_rows"]}
    alone, frame = rows.get(("litevlm", "strangers")), rows.get(("litevlm", "frame"))
    if not alone or not frame or not alone.get("e2e_ms") or not alone.get("views_encoded_per_question"):
        return None
    shared = alone["preprocess_ms"] + alone["vit_ms"]
    left = shared * frame["views_encoded_per_question"] / alone["views_encoded_per_question"]
    floor = (alone["e2e_ms"] - shared + left) / alone["e2e_ms"]
    text = (
        f"A frame shares only the views' reading and encoding: {100 * shared / alone['e2e_ms']:.0f}% of a stranger's"
        f" e2e. Encoding {fmt(frame['views_encoded_per_question'])} views a question instead of"
        f" {fmt(alone['views_encoded_per_question'])}, with everything else per question as before, the frame could"
        f" reach **{floor:.3f}** at best; the rest is the question's own selection, prefill and decoding."
    )
    need = frame_need(alone, frame, rows.get(("baseline", "frame")), shared, left)
    return text + (f" {need}" if need else "")


FRAME_GOAL = 0.6  # the frame mode's aim: a frame's mean e2e per question over a stranger's


def frame_need(alone: dict, frame: dict, base: dict | None, shared: float, left: float) -> str | None:
    """What the per-question work (everything but the views' reading and encoding) would have to shrink to for a
    frame to reach FRAME_GOAL, both modes paying it alike, set beside the frame's own selection and prefill and what
    a prompt token of its prefill costs against the baseline's: a prefill whose cost per token does not grow as its
    prompts shrink is bound by its arithmetic, which batching a frame's prompts together would not shrink on a CPU."""
    per_question = alone["e2e_ms"] - shared
    need = max((FRAME_GOAL * shared - left) / (1 - FRAME_GOAL), 0.0)
    prefill, tokens = frame.get("prefill_ms"), frame.get("input_tokens")
    if per_question <= need or not prefill or not tokens:
        return None
    front = prefill + (frame.get("select_ms") or 0.0)
    text = (
        f"To reach {FRAME_GOAL}, that per-question work would have to fall from {per_question:.1f} ms to"
        f" {need:.1f} ms; its selection and prefill alone take {front:.1f} ms (the prefill"
        f" {1000 * prefill / tokens:.0f} us a prompt token"
    )
    if base and base.get("prefill_ms") and base.get("input_tokens"):
        times = base["input_tokens"] / tokens
        text += f", the baseline's {1000 * base['prefill_ms'] / base['input_tokens']:.0f} us with {times:.1f}x the"
        text += " tokens: bound by its arithmetic, which batching a frame's prompts would not shrink here"
    return text + ")."


def before_after_line(run: dict | None) -> list[str]:
    """One line: the paper's measure (the five stages' sum) on drive-hd before and after the preprocessing change."""
    if run is None:
        return []
    res = run["result"]
    parts = [
        f"{r['config']} {fmt(r['before_ms'])} -> {fmt(r['after_ms'])} ms ({fmt(r['after_over_before'])}x)"
        f" at {'one pinned thread' if r['pinned'] else 'the default threads'}"
        for r in res["rows"]
    ]
    return [
        f"The paper's measure (the five stages' mean sum) before and after frames, e2e and the new preprocessing"
        f" (commit {res['before']} against {res['after']}, run back to back): {'; '.join(parts)}. Command:"
        f" `{run['command']}`, {run['date']}, {run['machine']['cpu']}.",
        "",
    ]


def section_frames(runs: dict) -> list[str]:
    """drive-hd's frame mode (`litevlm bench --questions-per-frame 6`) at both thread settings."""
    out = [
        "## One frame, several questions (drive-hd)",
        "",
        "Each row twice on the same questions: `strangers`, one question a frame (Table 1's way), and `frame`, a"
        " frame's questions through one `Pipeline.frame` (each view read and encoded once). Means per question;"
        " `e2e_vs_strangers` is the row's mean e2e over its configuration's strangers row; `answers_equal`: every"
        " frame answer equal to the stranger one token for token.",
    ]
    known = {b.name: b for b in benchmarks()}
    for name, label in FRAMES:
        run = runs.get(name)
        out += ["", f"### drive-hd's frames at {label}", ""]
        if run is None:
            out += not_measured_yet(f"frame mode on drive-hd at {label}", known[name])
            continue
        res = run["result"]
        line = frame_line(res)
        out += [line, ""] if line else []
        out += table(FRAME_COLUMNS, [[r.get(c) for c in FRAME_COLUMNS] for r in res["frame_rows"]])
        out += provenance(run)
    return out


PREPROCESS_COLUMNS = ["name", "source", "tiles", "today_ms", "new_ms", "speedup", "max_pixel_diff", "mean_pixel_diff"]
PREPROCESS_COLUMNS += ["today_err", "new_err", "decode_ms", "best_speedup"]


def section_explain(run: dict | None) -> list[str]:
    """The picture of what LiteVLM kept for one answer of the demo scene on drive-hd."""
    out = ["## What LiteVLM kept", ""]
    if run is None:
        return out + not_measured_yet("the explain figure", next(b for b in benchmarks() if b.name == "explain_hd"))
    res = run["result"]
    shown = res.get("explained") or {}
    out += [
        f'The demo scene on drive-hd, LiteVLM\'s answer to "{shown.get("question", "?")}": the views the ViewSelector'
        " left out greyed, the visual tokens the TokenSelector kept marked on their patches and shaded by its score"
        " (`litevlm ask ... --explain FIG.png` draws the same for any answer).",
        "",
        f"![what LiteVLM kept]({res.get('explain', 'benchmarks/results/explain_hd.png')})",
    ]
    return out + provenance(run)


def section_preprocess(run: dict | None) -> list[str]:
    """benchmarks/preprocess.py: one view from its source to its tiles, the former path against the new one."""
    out = ["## Reading and cutting a view", ""]
    if run is None:
        return out + not_measured_yet("preprocessing", next(b for b in benchmarks() if b.name == "preprocess"))
    res = run["result"]
    out += [
        "One 1600x900 camera view from its source (a JPEG or PNG file, or a raw HxWx3 uint8 frame) to its tiles, ms "
        "(medians, the two paths alternating): `today_ms` PIL's full decode and bicubic resize (the path before this "
        'change, `resample="pil"`), `new_ms` the default (a JPEG decoded by libjpeg-turbo straight into an array at '
        "the DCT scale its tiles need, torch's antialiased bicubic on uint8, raw frames with no PIL round trip); the "
        "pixel differences are between their tiles, in levels of a byte; `today_err` and `new_err` each path's mean "
        "difference from the tiles of the camera's own pixels (the frame before any encoding, cut PIL's way): what a "
        "file's encoding and decoding lose together. Where its tiles are much smaller (1.5x both ways), a JPEG is "
        "decoded by libjpeg-turbo's fast inverse DCT and merged colour upsampling. `decode_ms`: the new path's decode"
        " alone, no resize (for a file); `best_speedup`: today's time over it, what the case would reach with a "
        "resize that took no time at all.",
        "",
        *table(PREPROCESS_COLUMNS, [[c.get(k) for k in PREPROCESS_COLUMNS] for c in res.get("cases", [])]),
    ]
    scored = []  # one paragraph: the split as it is, then every image a JPEG
    for key, which in (("score", "held-out questions"), ("score_jpeg", "held-out questions, every image a JPEG")):
        sc = res.get(key)
        if sc:
            both = "; ".join(
                f"{cfg} {fmt(sc.get(f'{cfg}_fast'))} with the new path, {fmt(sc.get(f'{cfg}_pil'))} with PIL's ("
                + (
                    paired_text(sc[f"{cfg}_paired"]["final"], "the new path", "PIL's")
                    if sc.get(f"{cfg}_paired", {}).get("final")
                    else f"difference {fmt(sc.get(f'{cfg}_diff'))}, no interval in this run"
                )
                + ")"
                for cfg in ("litevlm", "baseline")
                if f"{cfg}_fast" in sc
            )
            scored.append(f"DriveLM score on {sc.get('model')}, {sc.get('questions')} {which}: {both}.")
    if scored:
        out += ["", " ".join(scored)]
    return out + provenance(run)


def section_sweep(run: dict | None) -> list[str]:
    out = ["## EAGLE-2 draft trees against plain decoding", ""]
    if run is None:
        return out + missing("the EAGLE-2 sweep", "python benchmarks/report.py --run --only spec_sweep")
    res = run["result"]
    cols = ["config", "tau", "draft_ms", "verify_ms", "tokens_per_s", "speedup", "mismatches"]
    shipped = res["rows"][1]["config"] if len(res["rows"]) > 1 else None
    out += [
        f"Decode stage only, all six views, {res['questions']} questions; the shipped default tree is `{shipped}`"
        f" (first row after plain). Fastest here: `{res['best']}`, **{fmt(res['best_speedup'])}x** plain decoding at"
        f" tau {fmt(res['best_tau'])}; lossless (every output equal to plain greedy decoding): {fmt(res['lossless'])}."
        f" Every tree's {', '.join(cols[1:])}: {json_of('spec_sweep')}.",
    ]
    return out + provenance(run)


EVERY_QUESTION = (
    "The race decided: the shipped TokenSelector against the four strongest training-free methods at r = 0.05 to 0.3,"
    " over the views each question needs, on more held-out questions than the table above (the methods differ there by"
    " a few questions), every difference paired over the same questions with its interval. TokenSelector K=2 is the"
    " same choice applied before decoder layer 2, where FastV K=2 and DART cut: not the placement that ships."
)
PRUNING = {  # page -> (its pruning run, heading, the sentence that opens it)
    "drive-hd": ("token_pruning_drive-hd", "drive-hd", None),
    "drive-hd-all-questions": (
        "token_pruning_drive-hd-all-questions",
        "drive-hd, the race on more questions",
        EVERY_QUESTION,
    ),
    "drive-hd-all-views": ("token_pruning_drive-hd-all-views", "drive-hd over all six views", None),
    "drive-hd-neutral": ("token_pruning_drive-hd-neutral", "drive-hd's neutral decoder", None),
    "drive-hd-neutral-all-questions": (
        "token_pruning_drive-hd-neutral-all-questions",
        "drive-hd's neutral decoder, every held-out question",
        None,
    ),
    "drive-hd-neutral-all-views": (
        "token_pruning_drive-hd-neutral-all-views",
        "drive-hd's neutral decoder over all six views",
        None,
    ),
}
# what each page's decoder was trained on: the shipped one was taught the selector's prunings, the neutral one not
TAUGHT = (
    "The decoder is the shipped drive-hd's, **taught the selector's prunings** in its last training stage: a race on"
    " home ground for the TokenSelector."
)
NEUTRAL_DECODER = (
    "The decoder is **neutral**: drive-hd's stage before the selector-taught one, trained with half its prompts'"
    " visual tokens thinned at random (10%-95% kept), which serves every method alike; the TokenSelector is the"
    " shipped one, distilled on these weights by `litevlm train tokens` (`python benchmarks/neutral_decoder.py` writes"
    " the model folder from the repository's history)."
)
TRAINED = "token-selector"  # it and its variants (the same choice applied inside the decoder) are trained; the rest
# training-free


DIAGNOSTIC = {"fastv-k2-k0": "fastv-k2"}  # FastV K=2's choice applied before the decoder -> FastV K=2 itself


def trained(method: str) -> bool:
    return method.startswith(TRAINED)


def training_free(method: str) -> bool:
    """A pruner a user could run instead of the TokenSelector: neither it nor a diagnostic that costs more than the
    unpruned prefill."""
    return not trained(method) and method not in DIAGNOSTIC


def pruning_label(res: dict, method: str) -> str:
    """A method's name as the pruning run wrote it (its `labels`, every method run or absent)."""
    return (res.get("labels") or {}).get(method, method)


def names(items: list[str]) -> str:
    return items[0] if len(items) == 1 else ", ".join(items[:-1]) + " and " + items[-1]


# a measure -> (its per-question list in a pruning run, whether higher is better)
MEASURES = {"final": ("final", True), "closed": ("correct", True), "drop": ("drop", False)}
UNDECIDED = "not decided (no per-question scores in this run, so no interval)"


def paired(res: dict, a: str, b: str, r: float, measure: str = "final"):
    """Method a against method b at r on one measure (`MEASURES`), question by question from the run's per-question
    lists: the difference a - b with its 95% interval over frames (`litevlm.eval.intervals`); None where the run has
    no such lists (runs before they were stored) or either method is missing."""
    from litevlm.eval.intervals import both_scored, paired_difference

    lists = res.get("per_question") or {}
    pa, pb = lists.get(f"{a}@{r}"), lists.get(f"{b}@{r}")
    key, higher = MEASURES[measure]
    if not pa or not pb or key not in pa or key not in pb:
        return None
    x, y, frames = both_scored(pa[key], pb[key], res["questions"]["frame"])
    return paired_difference(x, y, frames, higher_is_better=higher) if x else None


def interval(p, digits: int = 4) -> str:
    """A paired difference and its 95% interval: "+0.0031 [-0.0042, +0.0105]"."""
    return f"{p.diff:+.{digits}f} [{p.low:+.{digits}f}, {p.high:+.{digits}f}]"


def side(p, a: str, b: str) -> str:
    """Which side is ahead ("A ahead"), or "level" where the interval holds zero."""
    return p.verdict(f"{a} ahead", f"{b} ahead")


def with_se(res: dict, m: str, r: float) -> str:
    """A method's final at r with its standard error over frames where the run has it: "0.5382 ± 0.0121"."""
    sc = res["scores"].get(f"{m}@{r}") or {}
    se = sc.get("final_se")
    return fmt(round(sc["final"], 4)) + (f" ± {se:.4f}" if se is not None else "")


def pruning_verdict(res: dict, r: float) -> str | None:
    """One plain sentence (a list item) on keep ratio r: the TokenSelector's final and the best training-free
    method's, each with its standard error, and their paired difference with its 95% interval over frames ("level"
    where it holds zero); where the others stand against the TokenSelector; the closed questions and the fidelity to
    the unpruned model for the same pair. A run without per-question scores leaves the difference not decided."""
    finals = {m: (res["scores"].get(f"{m}@{r}") or {}).get("final") for m in res["methods"]}
    finals = {m: round(v, 4) for m, v in finals.items() if v is not None}
    runnable = {m: v for m, v in finals.items() if m not in DIAGNOSTIC}
    if not runnable:
        return None
    kept = next((res["scores"][f"{m}@{r}"].get("visual_tokens") for m in finals), None)
    head = f"- At r={r}" + (f" ({fmt(kept)} visual tokens kept)" if kept is not None else "")
    free = [m for m in finals if training_free(m)]
    if TRAINED not in finals:
        top = max(runnable, key=lambda m: runnable[m])
        closed = res["scores"][f"{top}@{r}"].get("closed_accuracy")
        out = f"{head}, the highest final is {pruning_label(res, top)}'s, {with_se(res, top, r)}"
        out += f" (closed accuracy {fmt(closed)})." if closed is not None else "."
        why = (res.get("absent") or {}).get(TRAINED)
        return out + (f" No TokenSelector was measured ({why})." if why else "")
    out = f"{head}, the TokenSelector scores {with_se(res, TRAINED, r)}"
    if not free:
        return out + "." + variant_line(res, r, finals, None) + diagnostic_line(res, r, finals)
    best = max(free, key=lambda m: finals[m])
    name = pruning_label(res, best)
    p = paired(res, best, TRAINED, r)
    if p is None:
        out += (
            f"; the best training-free method, {name}, {fmt(finals[best])} ({finals[best] - finals[TRAINED]:+.4f}):"
            f" {UNDECIDED}."
        )
    else:
        out += (
            f"; the best training-free method, {name}, {with_se(res, best, r)}; {name} less the TokenSelector"
            f" {interval(p)}, {side(p, name, 'the TokenSelector')}."
        )
        groups: dict[str, list[str]] = {"level": [], "ahead": [], "behind": []}
        for m in free:
            q = paired(res, m, TRAINED, r)
            if m != best and q is not None:
                groups[{None: "level", "a": "ahead", "b": "behind"}[q.ahead]].append(pruning_label(res, m))
        said = [f"{k}: {names(v)}" for k, v in (("ahead of it", groups["ahead"]), ("behind it", groups["behind"])) if v]
        said += [f"level with it: {names(groups['level'])}"] if groups["level"] else []
        if said:
            out += " The other training-free methods against the TokenSelector: " + "; ".join(said) + "."
    return (
        out
        + paired_line(res, r, best)
        + fidelity_line(res, r, best)
        + variant_line(res, r, finals, best)
        + diagnostic_line(res, r, finals)
    )


def diagnostic_line(res: dict, r: float, finals: dict) -> str:
    """Each diagnostic (FastV K=2's choice applied before the decoder, where the TokenSelector prunes) beside the
    method whose choice it borrows, with their paired difference where the run has per-question scores: whether the
    choice or the place to prune makes the difference."""
    out = ""
    for m, origin in DIAGNOSTIC.items():
        if m not in finals:
            continue
        out += f" {pruning_label(res, m)} scores {with_se(res, m, r)}"
        if origin in finals:
            out += f" ({pruning_label(res, origin)}, pruning before layer 2: {fmt(finals[origin])}"
            p = paired(res, m, origin, r)
            if p is not None:
                out += f"; the difference {interval(p)}, {side(p, pruning_label(res, m), pruning_label(res, origin))}"
            out += ")"
        out += "."
    return out


def variant_line(res: dict, r: float, finals: dict, top: str | None) -> str:
    """Each variant of the TokenSelector (its choice applied inside the decoder) against the best training-free
    method `top`, with their paired difference; empty where the run has no variant."""
    out = ""
    for m in (m for m in finals if trained(m) and m != TRAINED):
        name = pruning_label(res, m)
        out += f" {name} scores {with_se(res, m, r)}"
        if top is not None:
            p = paired(res, m, top, r)
            other = pruning_label(res, top)
            if p is None:
                out += f" ({finals[m] - finals[top]:+.4f} on {other}: not decided)"
            else:
                out += f"; less {other} {interval(p)}, {side(p, name, other)}"
        out += "."
    return out


def paired_line(res: dict, r: float, m: str) -> str:
    """The method m (the strongest training-free one at r) against the TokenSelector on the closed questions: the
    paired difference in accuracy with its interval where the run has per-question scores, and the questions where
    only one of the two is right with the sign test's p (`vs_selector`); empty where the run has neither."""
    p = paired(res, m, TRAINED, r, "closed")
    pair = (res["scores"].get(f"{m}@{r}") or {}).get("vs_selector")
    name = pruning_label(res, m)
    out = (
        f" Closed accuracy, {name} less the TokenSelector: {interval(p)}, {side(p, name, 'the TokenSelector')}"
        if p
        else ""
    )
    if pair:
        out += (
            "; on the closed questions where the two differ" if p else " On the closed questions where the two differ"
        )
        out += (
            f", only the TokenSelector is right on {pair['selector_only']} and only {name} on {pair['method_only']}"
            f" (sign test p = {fmt(pair['p'])})"
        )
    return out + "." if out else ""


def fidelity_line(res: dict, r: float, m: str) -> str:
    """The fidelity to the unpruned model of the TokenSelector and of method m at r: each one's mean drop in the
    unpruned answer's log-likelihood per token and its share of answers the same token for token, and the paired
    difference of the drops (a smaller drop is ahead); empty where the run has no fidelity."""
    fa, fb = ((res["scores"].get(f"{x}@{r}") or {}).get("fidelity") or {} for x in (TRAINED, m))
    if "drop" not in fa or "drop" not in fb:
        return ""
    name = pruning_label(res, m)
    out = (
        f" Fidelity (the unpruned answer's log-likelihood drop per token; answers the same): the TokenSelector"
        f" {round(fa['drop'], 3) + 0.0:.3f} ({100 * fa['same_answer']:.0f}%), {name}"
        f" {round(fb['drop'], 3) + 0.0:.3f} ({100 * fb['same_answer']:.0f}%)"
    )
    p = paired(res, m, TRAINED, r, "drop")
    return out + (
        f"; {name} less the TokenSelector {interval(p, 3)}, {side(p, name, 'the TokenSelector')}." if p else "."
    )


def selector_timing_note(selector: dict, selection_timed_as: str | None = None) -> str:
    """Where each method's choice is timed: FastV inside the prefill (runs before it was timed as select_tokens), the
    rest in select_tokens; the TokenSelector inside the decoder only when its head reads the model's own layer 0."""
    inside = selector.get("shared_layer", True) and selector.get("reads", "layer0") == "layer0"
    if selection_timed_as == "select_tokens":
        return (
            "Every method's choice is timed as select_tokens, as the pipeline reports it: FastV's and DART's inside the"
            " prefill pass"
            + (" and the TokenSelector's after its layer 0" if inside else "")
            + ", the others' before the decoder."
        )
    if inside:
        return (
            "FastV chooses inside the prefill pass and is timed there; DART and the TokenSelector choose inside it too,"
            " but their choice is timed as select_tokens, as the pipeline reports it; the methods that prune before"
            " the decoder choose in select_tokens."
        )
    return (
        "FastV chooses inside the prefill pass and is timed there; DART chooses inside it too, but its choice is timed"
        " as select_tokens, as the pipeline reports it; the TokenSelector (its head reads the prompt, so it prunes"
        " before the decoder) and the other methods that prune before the decoder choose in select_tokens."
    )


# Above the pruning tables: what each method reads, so that a reader can judge the race (no figures here).
WHAT_EACH_SEES = (
    "**What each method sees.** The TokenSelector (learned) scores the visual tokens from decoder layer 0's norm and"
    " query and key projections over the prompt's embeddings, plus the question's object-tag coordinates"
    " (`<c1,CAM_BACK,x,y>`) placed on each view's token grid, and keeps at least one token a view. FastV, as"
    " published, cuts before layer K and ranks by the last prompt token's head-mean attention at layer K - 1; DART"
    " cuts before layer 2 and ranks by duplication against 8 pivots (layer 1's key norms, layer 2's input); both"
    " rank every visual token at once. DivPrune (max-min cosine diversity, all the tokens at once, as its authors"
    " run it on a multi-crop image) and CDPruner (a DPP over cosine similarity weighted by relevance to the"
    " question's token embeddings, on each tile apart, as its authors prune each crop) read the projector's output"
    " before the decoder; random and uniform read nothing. No training-free pruner sees the tag coordinates. Every"
    " method's choice is timed as select_tokens. Two decoders: the shipped drive-hd was taught the selector's"
    " prunings in its last training stage (src/litevlm/weights/drive-hd/MODEL.md), a race on the selector's home"
    " ground; the neutral one, the stage before, was taught random thinning only. A run measured before FastV read"
    " layer K - 1 says so beside its table."
)


RACES = (  # (the questions, the taught decoder's page, the neutral decoder's page)
    ("600 questions, the views each needs", "drive-hd", "drive-hd-neutral"),
    ("more questions, the views each needs", "drive-hd-all-questions", "drive-hd-neutral-all-questions"),
    ("600 questions, all six views", "drive-hd-all-views", "drive-hd-neutral-all-views"),
)


def race_cells(res: dict | None, r: float) -> tuple[str, str, str, str | None]:
    """On one run at r: the TokenSelector's best final (before the decoder, or its choice applied inside it) with its
    name, the best training-free method's, their paired difference (the selector less the other) with its 95%
    interval over frames, and the outcome: "level", "selector", "free" (the training-free method ahead),
    "undecided" (a run without per-question scores) or None (not measured)."""
    if res is None or r not in res["ratios"]:
        return "-", "-", "-", None
    finals = {m: round(v["final"], 4) for k, v in res["scores"].items() for m in [k.rsplit("@", 1)[0]]
              if k.endswith(f"@{r}") and v.get("final") is not None}  # fmt: skip
    free = {m: v for m, v in finals.items() if training_free(m)}
    learned = {m: v for m, v in finals.items() if trained(m)}
    if not learned or not free:
        return "-", "-", "-", None
    best, mine = max(free, key=lambda m: free[m]), max(learned, key=lambda m: learned[m])
    cells = f"{pruning_label(res, mine)} {with_se(res, mine, r)}", f"{pruning_label(res, best)} {with_se(res, best, r)}"
    p = paired(res, mine, best, r)
    if p is None:
        return *cells, f"{learned[mine] - free[best]:+.4f}, not decided", "undecided"
    outcome = {None: "level", "a": "selector", "b": "free"}[p.ahead]
    return *cells, f"{interval(p)}, {side(p, 'the TokenSelector', 'training-free')}", outcome


INSIDE = "token-selector-k2"  # the TokenSelector's choice applied before decoder layer 2


def decided_race(pairs: list) -> list[str]:
    """The shipped TokenSelector against every training-free method at r <= 0.2, on every run with per-question
    scores: the race decided on fidelity (the drop in the unpruned answer's log-likelihood, paired), the training-free
    method whose fidelity interval is best named at each r; and how many method pairs each measure separates (its
    interval excluding zero), fidelity against the final score."""
    lines, sep = [], {"final": 0, "drop": 0, "pairs": 0}
    for what, *runs in pairs:
        for decoder, run in zip(("taught", "neutral"), runs):
            res = run["result"] if run else None
            if res is None or not res.get("per_question"):
                continue
            for r in (r for r in res["ratios"] if r <= 0.2):
                free = [m for m in res["methods"] if training_free(m) and f"{m}@{r}" in res["scores"]]
                drops = {m: paired(res, TRAINED, m, r, "drop") for m in free}
                for m in free:
                    final = paired(res, TRAINED, m, r, "final")
                    if final is None or drops[m] is None:
                        continue
                    sep["pairs"] += 1
                    sep["final"] += final.ahead is not None
                    sep["drop"] += drops[m].ahead is not None
                known = {m: d for m, d in drops.items() if d is not None}
                if not known:
                    continue
                rival = min(known, key=lambda m: known[m].b)  # the training-free method that keeps the most
                d = known[rival]
                verdict = d.verdict("**the TokenSelector ahead**", f"**{pruning_label(res, rival)} ahead**")
                line = (
                    f"{what}, {decoder} decoder, r = {r}: the TokenSelector's drop {d.a:.4f} against"
                    f" {pruning_label(res, rival)}'s {d.b:.4f} (the least of the training-free methods), difference"
                    f" {interval(d)}: {verdict}"
                )
                inside = paired(res, INSIDE, rival, r, "drop") if f"{INSIDE}@{r}" in res["scores"] else None
                if inside is not None:  # the same choice where FastV and DART cut: what placement costs
                    line += (
                        f" (its choice applied before layer 2, which is not how it ships, {inside.a:.4f}:"
                        f" {inside.verdict('ahead', 'behind')}, {interval(inside)})"
                    )
                lines.append(line)
    if not lines:
        return []
    return [
        "**The race on fidelity.** The TokenSelector as it ships (its choice before the decoder) against the"
        " training-free method that loses the least of the unpruned answer's log-likelihood, at each r <= 0.2, paired"
        " over the same questions with its 95% interval over frames (lower drops are better; a difference below zero"
        " favours the TokenSelector). Decided where the interval excludes zero, level otherwise: "
        + "; ".join(lines)
        + f". Of {sep['pairs']} method pairs at r <= 0.2 (each training-free method against the TokenSelector),"
        f" the final score's interval excludes zero in **{sep['final']}**, fidelity's in **{sep['drop']}**.",
        "",
    ]


def section_race(runs: dict) -> list[str]:
    """The pruning race on both decoders side by side, r <= 0.3: the TokenSelector's final against the best
    training-free method's on each table, their paired difference with its interval, and a count of the outcomes."""
    pairs = [(what, runs.get(PRUNING[a][0]), runs.get(PRUNING[b][0])) for what, a, b in RACES]
    if not any(n for _, _, n in pairs):
        return []
    rows = []
    counts: dict[str, dict[str, int]] = {"taught": {}, "neutral": {}}
    for what, taught, neutral in pairs:
        ratios = sorted({r for run in (taught, neutral) if run for r in run["result"]["ratios"] if r <= 0.3})
        for r in ratios:
            cells = []
            for key, run in (("taught", taught), ("neutral", neutral)):
                sel, best, diff, outcome = race_cells(run["result"] if run else None, r)
                cells += [sel, best, diff]
                if outcome is not None:
                    counts[key][outcome] = counts[key].get(outcome, 0) + 1
            rows.append([what, r, *cells])
    header = ["questions", "r", "taught: best TokenSelector", "taught: best training-free",
              "taught: difference [95%]", "neutral: best TokenSelector", "neutral: best training-free",
              "neutral: difference [95%]"]  # fmt: skip
    words = {
        "level": "level in {}",
        "selector": "the TokenSelector ahead in {}",
        "free": "a training-free method ahead in {}",
        "undecided": "not decided in {} (runs without per-question scores)",
    }
    summary = "; ".join(
        f"on the {'decoder taught its prunings' if k == 'taught' else 'neutral decoder'}, of {sum(c.values())} rows: "
        + ", ".join(w.format(c[o]) for o, w in words.items() if c.get(o))
        for k, c in counts.items()
        if c
    )
    decided = decided_race(pairs)
    return [
        "## The pruning race on both decoders",
        "",
        *decided,
        "The tables above side by side at r <= 0.3: the best DriveLM final of the TokenSelector (its choice before"
        " the decoder, or the same choice applied before layer 2) and the best training-free method's, each with its"
        " name and standard error over frames, on the decoder taught the selector's prunings and on the neutral one;"
        " then their paired difference (the TokenSelector less the training-free method, over the same questions)"
        ' with its 95% interval from resampling the frames, "level" where the interval holds zero. Each side is the'
        f" best of several, picked after the fact. Read from the runs' JSON: {summary}.",
        "",
        *table(header, rows),
        "",
    ]


# page -> the neutral decoder's page shown inside it, as more columns, where both runs are there (the same methods)
BESIDE = {
    "drive-hd-all-questions": "drive-hd-neutral-all-questions",
    "drive-hd-all-views": "drive-hd-neutral-all-views",
}


def section_pruning(runs: dict, page: str) -> list[str]:
    """Every token-selection method against r on one of the PRUNING pages (benchmarks/token_pruning.py): final score
    and closed accuracy, prefill and the method's own select_tokens ms, one sentence per r <= 0.3, the plot. A page
    in BESIDE carries its neutral-decoder run as more columns, verdicts and provenance (that page then shows nothing).
    """
    name, heading, intro = PRUNING[page]
    run = runs.get(name)
    host = next((p for p, n in BESIDE.items() if n == page), None)
    if host is not None and runs.get(PRUNING[host][0]) is not None and run is not None:
        return []  # shown beside its taught-decoder page
    other = runs.get(PRUNING[BESIDE[page]][0]) if page in BESIDE and run is not None else None
    if other is not None:
        heading += ", on both decoders"
    out = [f"## Token pruning on {heading}: the TokenSelector against FastV and the training-free pruners", ""]
    if page == next(iter(PRUNING)):  # the first pruning table: what every method reads, once
        out += [WHAT_EACH_SEES, ""]
    if run is None:
        return out + not_measured_yet(f"token pruning on {heading}", next(b for b in benchmarks() if b.name == name))
    res = run["result"]
    ratios, methods, scores, un = res["ratios"], res["methods"], res["scores"], res["unpruned"]
    absent = res.get("absent") or {}
    where = "over the views each needs" if res.get("views") == "needed" else "over all six views"
    share = res.get("visual_share")
    share = f" ({100 * share:.0f}% of its tokens)" if share is not None else ""
    about = [intro] if intro else []
    about.append(NEUTRAL_DECODER if "neutral" in page else TAUGHT)
    if other is not None:
        about.append(
            f"The `neutral` columns are the same questions and methods on the neutral decoder (unpruned: final"
            f" **{fmt(other['result']['unpruned']['final'])}**"
            f" ({fmt(other['result']['unpruned']['closed_accuracy'])})). {NEUTRAL_DECODER}"
        )
    if res.get("fastv_ranks_by") != "layer K-1":
        about.append(
            "This run predates FastV as published: its FastV rows rank by layer K's own attention and are timed in the"
            " prefill, and its CDPruner rows spend one budget over all the tokens."
        )
    if res.get("views") == "all":
        about.append(
            "Every camera's view goes into each prompt, as when the ViewSelector is off: most of the visual tokens are"
            " then of views the question does not ask about, and a budget spent on them is lost to the views it does."
        )
    about.append(
        f"{res['n']} questions ({res.get('n_closed')} closed) {where}, greedy decoding; a prompt holds"
        f" {fmt(res.get('visual_tokens'))} visual tokens on average{share}. r is the fraction of visual tokens KEPT;"
        f" every method keeps the same number at each r. Each cell is the {res.get('scoring', 'DriveLM final score')},"
        f" closed-question accuracy in brackets. Unpruned: final **{fmt(un['final'])}**"
        f" ({fmt(un['closed_accuracy'])})."
    )
    if any(m in DIAGNOSTIC for m in methods):
        about.append(
            '"FastV K=2\'s choice before the decoder" is a diagnostic, not a pruner to run: the tokens FastV K=2 keeps'
            " (layers 0 and 1 run on the whole prompt to choose them), cut from the prompt before the decoder as the"
            " TokenSelector prunes, so that a worse choice can be told from a worse place to prune."
        )
    for m in (m for m in methods if trained(m) and m != TRAINED):
        k = m.rsplit("-k", 1)[-1]
        about.append(
            f"{pruning_label(res, m)}: the TokenSelector's own choice, made from the prompt before the decoder,"
            f" applied before decoder layer {k} (`--prune token-selector --keep R --prune-layer {k}`): the layers"
            " before it read the whole prompt, as FastV's and DART's do, and cost what they cost there."
        )
    n_closed, p = res.get("n_closed"), un.get("closed_accuracy")
    if un.get("final_se") is not None:
        about.append(
            f"Standard errors over frames (a frame's questions taken together): unpruned final ± {un['final_se']:.4f},"
            f" closed accuracy ± {fmt(un.get('closed_se'))}. Each difference below is paired over the same questions,"
            ' with its 95% interval from resampling the frames; "level" where the interval holds zero.'
        )
    elif n_closed and p is not None:
        about.append(
            f"With {n_closed} closed questions, a closed accuracy near {fmt(p)} has a standard error of about"
            f" {(p * (1 - p) / n_closed) ** 0.5:.3f}. This run stored no per-question scores: its differences have no"
            " interval and are not decided."
        )
    if any("drop" in (sc.get("fidelity") or {}) for sc in scores.values()):
        about.append(
            "Beside each r, the fidelity to the unpruned model: the mean drop in the unpruned answer's log-likelihood"
            " per token under the pruned prompt (teacher-forced; 0: as likely as unpruned), and in brackets the share"
            " of answers token for token the unpruned one's."
        )
    out += [" ".join(about), ""]

    def cell(sc):
        return "-" if sc is None else f"{fmt(sc['final'])} ({fmt(sc.get('closed_accuracy'))})"

    def fidelity(sc):
        f = (sc or {}).get("fidelity") or {}
        return "-" if "drop" not in f else f"{round(f['drop'], 3) + 0.0:.3f} ({100 * f['same_answer']:.0f}%)"

    def columns(run_res: dict, prefix: str = ""):  # per column: its header, the kept-tokens row's cell, a method's
        sc = run_res["scores"]
        fid = any("drop" in (v.get("fidelity") or {}) for v in sc.values())
        for r in run_res["ratios"]:
            kept = next((sc[f"{m}@{r}"].get("visual_tokens") for m in methods if f"{m}@{r}" in sc), None)
            yield f"{prefix}r={r}", kept, lambda m, r=r: cell(sc.get(f"{m}@{r}"))
            if fid:
                yield f"{prefix}r={r} fidelity", "", lambda m, r=r: fidelity(sc.get(f"{m}@{r}"))

    def timed(m, r):  # one table for both times: the method's prefill + its own choice
        t = res["timing_ms"].get(f"{m}@{r}")
        return "-" if t is None else f"{fmt(t.get('prefill_ms'))} + {fmt(t.get('select_tokens_ms'))}"

    neutral = other["result"] if other is not None else None
    own = list(columns(res))
    beside = (
        list(columns(neutral, "neutral ")) if neutral is not None else []
    )  # the neutral decoder's, method by method
    header = ["method", *(h for h, _, _ in own + beside)]
    rows = [["visual tokens kept", *(k for _, k, _ in own + beside)]]
    rows += [[pruning_label(res, m), *(f(m) for _, _, f in own + beside)] for m in methods]
    rows += [[pruning_label(res, m), *(["absent"] * len(own)), *(["-"] * len(beside))] for m in absent]
    out += table(header, rows)
    for m, why in absent.items():
        out += ["", f"{pruning_label(res, m)}: absent, {why} (`litevlm train tokens` trains one)."]
    verdicts = [v for v in (pruning_verdict(res, r) for r in ratios if r <= 0.3) if v]
    if neutral is not None:
        verdicts = [v.replace("- At r=", "- Taught decoder, at r=", 1) for v in verdicts]
        verdicts += [
            v.replace("- At r=", "- Neutral decoder, at r=", 1)
            for v in (pruning_verdict(neutral, r) for r in neutral["ratios"] if r <= 0.3)
            if v
        ]
    out += ["", *verdicts] if verdicts else []
    t, mach = res.get("timing") or {}, res.get("machine") or {}
    current = res.get("fastv_ranks_by") == "layer K-1"
    if res.get("timing_ms") and not current:  # timed as the methods then ran: its JSON keeps the table
        out += ["", f"This run's timing of each method (prefill + select_tokens ms) is in {json_of(name)}."]
    if res.get("timing_ms") and current:
        out += [
            "",
            f"Timing, side by side in this run on the first {t.get('prompts')} prompts ({t.get('repeats')} repeats"
            f" each, interleaved over the configurations; medians), {mach.get('device')}, {mach.get('threads')}"
            f" thread(s), {t.get('backend')} backend: each cell is the prefill ms + the method's own select_tokens ms."
            f" Unpruned prefill: **{fmt(res['timing_ms']['unpruned']['prefill_ms'])} ms**."
            f" {selector_timing_note(res.get('selector') or {}, res.get('selection_timed_as'))}",
            "",
            *table(
                ["method", *(f"r={r}" for r in ratios)],
                [[pruning_label(res, m), *(timed(m, r) for r in ratios)] for m in methods],
            ),
        ]
    out += provenance(run)
    if res.get("plot") and "all-questions" not in page:  # the every-question pages: their plots beside the JSON
        out += [f"![token pruning on {heading}]({res['plot']})", ""]
    elif res.get("plot"):
        out[-2] += f" Its plot: {res['plot']}."
    if other is not None:
        out[-2] = out[-2].replace("Command:", "Taught decoder's command:", 1)  # both runs' provenance, one paragraph
        out[-2] += " " + provenance(other)[1].replace("Command:", "Neutral decoder's command:", 1)
        out[-2] += f" Its plot: {other['result']['plot']}." if other["result"].get("plot") else ""
    return out


PEER_ROWS = (
    "litevlm baseline",
    "litevlm",
    "llama.cpp f32",
    "llama.cpp f16",
    "llama.cpp q8_0",
    "llama.cpp f32, litevlm tiles",
)


def peer_ratio(by: dict, a: str, b: str) -> float | None:
    """Row b's mean e2e over row a's: how many times as fast a answers as b."""
    if a in by and b in by and by[a].get("e2e_ms"):
        return round(by[b]["e2e_ms"] / by[a]["e2e_ms"], 2)
    return None


def spec_text(by: dict) -> str:
    """llama-cpp-python's chat path with its prompt-lookup speculative decoding (the only speculation it offers an
    image prompt) beside the same path without it, and LiteVLM's ratio over the faster; "" where not run."""
    plain = by.get("llama.cpp f32, chat")
    spec = next((r for name, r in by.items() if name.startswith("llama.cpp f32, chat + lookup")), None)
    if not plain or not spec:
        return ""
    best = min(plain["e2e_ms"], spec["e2e_ms"])
    return (
        f"; llama.cpp's speculative decoding for an image prompt (llama-cpp-python's chat path with prompt-lookup"
        f" drafting, `{spec['config'].split(', ', 1)[1]}`) {fmt(spec['e2e_ms'])} ms against {fmt(plain['e2e_ms'])}"
        f" without, LiteVLM {times(round(best / by['litevlm']['e2e_ms'], 2))} the faster"
    )


def section_peers(run: dict | None) -> list[str]:
    """litevlm beside llama.cpp (benchmarks/peers.py): one table of drive-hd's rows at each thread count, the ratios
    the README quotes, the decode step beside llama.cpp's token, and the other models' ratios in a line."""
    out = ["## Beside llama.cpp", ""]
    if run is None:
        return out + missing("llama.cpp beside litevlm", "python benchmarks/peers.py --models drive-hd,drive-tiny")
    res = run["result"]
    version = res["versions"].get("llama-cpp-python")
    models = res["models"]
    first = next(iter(models))
    tiling = models[first].get("tiling", {})
    mtmd, ours = tiling.get("llama.cpp", {}), tiling.get("litevlm", {})
    out.append(
        f"litevlm's baseline and LiteVLM beside llama.cpp (llama-cpp-python {version}, its mtmd library; the model"
        " written by `litevlm convert --to gguf`) on the same held-out questions and image files, greedy, each timed"
        " from the files to the last token, the rows taking turns question by question in one process."
        f" `llama.cpp f32/f16/q8_0` read and tile the files as llama.cpp's own tools do: mtmd adds a thumbnail tile to"
        f" every view, so their prompts hold {fmt(mtmd.get('visual_tokens'))} visual tokens where litevlm's baseline"
        f" holds {fmt(ours.get('visual_tokens'))}; `llama.cpp f32, litevlm tiles` encodes litevlm's own tiles into"
        " litevlm's prompt (the same visual tokens, the like-for-like row). `LiteVLM x` is the row's mean e2e over"
        " LiteVLM's; agreement is the share of answers equal to the baseline's. llama.cpp keeps its default f16 KV"
        " cache."
    )
    cols = ("config", "threads", "visual_tokens", "preprocess_ms", "encode_ms", "prompt_ms", "generate_ms")
    cols += ("per_token_ms", "e2e_ms", "p50_e2e_ms", "LiteVLM x", "score", "agreement")
    rows, ratios = [], []
    for th, t in models[first]["threads"].items():
        by = {r["config"]: r for r in t["rows"]}
        for name in PEER_ROWS:
            if name in by:
                rows.append([*(by[name].get(c) for c in cols[:1]), th, *(by[name].get(c) for c in cols[2:10])])
                rows[-1] += [times(peer_ratio(by, "litevlm", name)), by[name].get("score"), by[name].get("agreement")]
        f32 = by.get("llama.cpp f32", {}).get("llama_cpp", {})
        ratios.append(
            f"at {th} thread(s){' pinned' if t.get('pinned') else ''}: LiteVLM"
            f" {times(peer_ratio(by, 'litevlm', 'llama.cpp f32'))} llama.cpp f32 and"
            f" {times(peer_ratio(by, 'litevlm', 'llama.cpp q8_0'))} llama.cpp Q8_0 from images to answer, the"
            f" baseline {times(peer_ratio(by, 'litevlm baseline', 'llama.cpp f32'))} llama.cpp f32 (on the same"
            f" tiles {times(peer_ratio(by, 'litevlm baseline', 'llama.cpp f32, litevlm tiles'))}); the baseline's"
            f" plain decoding {fmt(by.get('litevlm baseline', {}).get('per_token_ms'))} ms a token against llama.cpp"
            f" f32's {fmt(f32.get('eval_ms_per_token'))} (its own counter, f16 KV cache)" + spec_text(by)
        )
    out += ["", *table(list(cols), rows), "", f"{first}: " + "; ".join(ratios) + "."]
    others = []
    for model, m in list(models.items())[1:]:
        for th, t in m["threads"].items():
            by = {r["config"]: r for r in t["rows"]}
            others.append(
                f"{model} at {th} thread(s): LiteVLM {times(peer_ratio(by, 'litevlm', 'llama.cpp f32'))} llama.cpp"
                f" f32, the baseline {times(peer_ratio(by, 'litevlm baseline', 'llama.cpp f32'))}"
            )
    if others:
        out += ["", "; ".join(others) + "."]
    m = run["machine"]
    out += [
        "",
        f"Command: `{run['command']}`. Commit {run['commit']}, {run['date']}, {m['cpu']}, {run['seconds']} s;"
        f" llama.cpp built with: {res['versions'].get('llama.cpp system', 'n/a')}.",
        "",
    ]
    return out


def section_views(run: dict | None) -> list[str]:
    out = ["## ViewSelector recall", ""]
    if run is None:
        return out + missing("view selection", "python benchmarks/report.py --run --only view_selection")
    res = run["result"]
    cols = ["recall", "views_per_question", "needed_per_question", "ratio_to_needed", "exact"]
    v = res.get("vision") or {}
    vision = (
        f" Vision stage on {v['questions']} of these questions: all six views {fmt(v['vit_ms_all_median'])} ms,"
        f" the selected views {fmt(v['vit_ms_selected_median'])} ms ({fmt(v['tiles_selected_mean'])} tiles),"
        f" medians; {fmt(v['speedup'])}x by sums."
        if "vit_ms_all_median" in v
        else ""
    )
    out += [
        f"{res['questions']} held-out questions; recall = needed views kept / needed views.{vision}",
        "",
        *table(
            ["selector", *cols],
            [
                ["ViewSelector", *(res.get(c) for c in cols)],
                ["lexical map alone", *(res["lexical_only"].get(c) for c in cols)],
            ],
        ),
    ]
    return out + provenance(run)


def section_scores(runs: dict) -> list[str]:
    out = [
        "## drive-tiny's scores, with the images and with every camera an empty road",
        "",
        "DriveLM scoring without a judge (the other weights renormalised). A model that reads its images loses"
        " accuracy when every camera shows an empty road.",
        "",
    ]
    rows, shown = [], []
    for name, label in (("drive_tiny_views", "ViewSelector on"), ("drive_tiny_six_views", "all six views")):
        run = runs.get(name)
        if run is None:
            continue
        res = run["result"]
        f, b = res["full"], res["blank"]
        rows.append(
            [
                label,
                f["n"],
                f["final"],
                b["final"],
                f["closed_accuracy"],
                b["closed_accuracy"],
                res["closed_accuracy_gap"],
            ]
        )
        shown.append(run)
    if not rows:
        return out + missing("drive-tiny's scores", "python benchmarks/report.py --run --only drive_tiny_views")
    out += table(
        [
            "pipeline",
            "questions",
            "final, images",
            "final, empty roads",
            "closed acc, images",
            "closed acc, empty",
            "gap",
        ],
        rows,
    )
    for run in shown:
        out += provenance(run)
    return out


def flatten(d: dict, prefix: str = "") -> list[tuple[str, object]]:
    items = []
    for k, v in d.items():
        if isinstance(v, dict):
            items += flatten(v, f"{prefix}{k}.")
        elif not isinstance(v, list):
            items.append((f"{prefix}{k}", v))
    return items


def section_batching(runs: dict) -> list[str]:
    """Many answers at once (under the server's section): decode tokens/s against the batch size, a frame's questions
    as one batch, at the default threads and pinned; one paragraph, its commands in one line."""
    found = [run for run in (runs.get(n) for n in ("batch_decode_hd_default_threads", "batch_decode_hd")) if run]
    if not found:
        return missing("batched decoding", "python benchmarks/report.py --run --only batch_decode_hd")
    decode, frames = [], []
    for config in found[0]["result"]["configs"]:
        for run in found:
            res = run["result"]
            rates = res["configs"][config]["decode"]
            top = rates[max(rates, key=int)]
            decode.append(
                f"{config} at {res['threads']} thread(s) {', '.join(fmt(r['tokens_per_s']) for r in rates.values())}"
                f" tokens/s at B = {', '.join(rates)} ({times(top['vs_batch_1'])} at the most, {top['mean_in_flight']}"
                f" in flight on average, answers the same as B = 1's: {top['identical_to_batch_1']})"
            )
            f = res["configs"][config]["frame"]
            frames.append(
                f"{config} at {res['threads']} thread(s) {fmt(f['answer_all_ms_per_question'])} against"
                f" {fmt(f['one_at_a_time_ms_per_question'])} ({times(f['ratio'])}, {f['equal_answers']} equal)"
            )
    commands = " ".join(provenance(run)[1] for run in found)
    bench = [run for run in (runs.get(n) for n in ("bench_batch_hd_default_threads", "bench_batch_hd")) if run]
    bench_line = []
    for run in bench:
        res = run["result"]
        b = res["batch"]
        cells = []
        for r in res["batch_rows"]:
            one, many = r["batch_1"], r[f"batch_{b}"]
            cells.append(
                f"{r['config']} {fmt(one['decode_tokens_per_s'])} -> {fmt(many['decode_tokens_per_s'])} decode"
                f" tokens/s ({times(r['decode_tokens_per_s_ratio'])}, {many['mean_in_flight']} in flight),"
                f" questions/s {times(r['questions_per_s_ratio'])}, same answers {r['identical_to_batch_1']}"
            )
        bench_line.append(f"at {res['threads']} thread(s): " + "; ".join(cells))
    if bench_line:
        commands += " " + " ".join(provenance(run)[1] for run in bench)
    steps = []
    for run in found:
        res = run["result"]
        cost = res["configs"].get("baseline", {}).get("step_ms") or {}
        if cost:
            b_lo, b_hi = min(cost, key=int), max(cost, key=int)
            lo, hi = cost[b_lo], cost[b_hi]
            steps.append(
                f"at {res['threads']} thread(s) one plain step costs {fmt(lo['cached_ms'])} ms at B = {b_lo}"
                f" and {fmt(hi['cached_ms'])} ms at B = {b_hi} over {fmt(hi['cached_tokens'])} cached"
                f" tokens a row, {fmt(lo['short_ms'])} and {fmt(hi['short_ms'])} ms over 16"
            )
    bound = (
        " What bounds the ratio, from the same runs: "
        + "; ".join(steps)
        + " (the products read the weights once for every row; each row's attention over its own cache is not"
        " shared, so it grows with B)."
        if steps
        else ""
    )
    return [
        f"Many answers at once, {found[0]['result']['model']}: decode tokens/s of the whole batch with up to B in"
        " flight, a question joining as another leaves (as the server runs), only the decode steps timed: "
        + "; ".join(decode)
        + ". A frame's questions as one batch (`frame.answer_all`) against one at a time (`frame.answer`), ms per"
        f" question: {'; '.join(frames)}."
        + bound
        + (
            " `litevlm bench --batch 8`, Table 1's held-out questions (every view encoded per question, prefills"
            " included in questions/s): " + "; ".join(bench_line) + "."
            if bench_line
            else ""
        ),
        "",
        commands,
        "",
    ]


def section_serve(run: dict | None, hd: dict | None = None, name: str = "serve_load") -> list[str]:
    out = ["## `litevlm serve` under load", ""]
    if run is None:
        return out + missing("the server under load", "python benchmarks/report.py --run --only serve_load")
    res = run["result"]
    levels = res.get("clients")
    if not isinstance(levels, dict):  # a result of another shape: every key it has
        out += ["Loopback only, one server process; every key of the benchmark's JSON (latencies in ms).", ""]
        out += table(["figure", "value"], [[k, v] for k, v in flatten(res) if k not in ("model", "host")])
        return out + provenance(run)
    settings = [
        f"{k.replace('_', ' ')} {res[k]}"
        for k in ("requests_per_level", "distinct_requests", "max_queue", "max_new_tokens")
        if k in res
    ]
    by_batch = res.get("by_max_batch")
    if isinstance(by_batch, dict):  # a one-at-a-time server beside a batching one, the same requests

        def level(n: str, lv: dict, base: dict) -> str:
            lat, ttft = lv.get("latency_ms") or {}, lv.get("ttft_ms") or {}
            text = f"{n} client(s) {fmt(lv.get('throughput_rps'))} requests/s, p50 {fmt(lat.get('p50'))} ms"
            if lv is not base:
                text += f" ({times(ratio(lv.get('throughput_rps'), base.get('throughput_rps')))} the requests/s,"
                text += f" {times(ratio(lat.get('p50'), (base.get('latency_ms') or {}).get('p50')))} the p50)"
            return text + f", first token p50 {fmt(ttft.get('p50'))} ms"

        served = []
        for b, lvs in by_batch.items():
            ordered = sorted(lvs.items(), key=lambda kv: int(kv[0]))
            shown = [ordered[0], ordered[-1]]  # the fewest and the most clients (every level in the JSON)
            served.append(f"--max-batch {b}: " + "; ".join(level(n, lv, ordered[0][1]) for n, lv in shown))
        bad = sum(
            lv.get("five_xx", 0) + lv.get("mismatches_vs_one_at_a_time", 0)
            for v in by_batch.values()
            for lv in v.values()
        )
        out.append(
            f"Loopback only, one server process, streamed answers, {Path(res.get('model', 'drive-tiny')).name}, the"
            f" {res.get('config', 'baseline')} configuration,"
            f" view cache {'off' if res.get('view_cache_mb') == 0 else 'on'},"
            f" {res.get('image_format', 'png').upper()} images ({', '.join(settings)}):"
            " a server answering one request at a time beside one batching"
            f" them, the same requests. {'. '.join(served)}. 5xx and answers differing from one at a time: {bad};"
            f" p99s and every level in {json_of(name)}."
        )
        out += provenance(run)
        if hd is not None and isinstance(hd["result"].get("by_max_batch"), dict):
            out += section_serve(hd, name="serve_load_hd")[2:]  # its paragraph and provenance, under one heading
        return out
    out += [
        "Loopback only, one server process, streamed answers; at each level that many clients send requests"
        f" back to back ({', '.join(settings)}). Latency is the whole request; time to first token is the first"
        " content chunk's arrival. Milliseconds.",
        "",
    ]
    cols = [
        "clients",
        "answered",
        "5xx",
        "mismatches",
        "requests/s",
        "p50",
        "p99",
        "first token p50",
        "first token p99",
    ]
    rows = []
    for n, lv in sorted(levels.items(), key=lambda kv: int(kv[0])):
        lat, ttft = lv.get("latency_ms") or {}, lv.get("ttft_ms") or {}
        rows.append(
            [
                n,
                lv.get("answered"),
                lv.get("five_xx"),
                lv.get("mismatches_vs_one_at_a_time"),
                lv.get("throughput_rps"),
                lat.get("p50"),
                lat.get("p99"),
                ttft.get("p50"),
                ttft.get("p99"),
            ]
        )
    out += table(cols, rows)
    return out + provenance(run)


def section_scale(run: dict | None) -> list[str]:
    out = ["## Scale-out: `litevlm serve --replicas N` under Ray Serve", ""]
    if run is None:
        return out + missing("Ray Serve replicas", "python benchmarks/report.py --run --only serve_replicas")
    res = run["result"]
    load = res.get("load_average") or {}
    out += [
        f"One machine ({res.get('host')}), a local Ray instance, {res.get('threads_per_replica')} torch thread per"
        f" replica; {res.get('rounds')} rounds of {res.get('requests_per_round')} streamed requests from"
        f" {res.get('clients')} clients, one replica and two alternating, the same requests for both. The load"
        f" average was {fmt(load.get('before'))} before the run and {fmt(load.get('after'))} after (other work"
        f" shares the cores). Two replicas: **{fmt(res.get('throughput_ratio'))}x** the answers/s of one. "
        + "; ".join(
            f"{n} replica(s): {r.get('answered')} answered, {r.get('five_xx')} 5xx,"
            f" {r.get('mismatches_vs_one_at_a_time')} mismatches, {fmt(r.get('throughput_rps'))} answers/s, p50"
            f" {fmt((r.get('latency_ms') or {}).get('p50'))} ms, first token p50"
            f" {fmt((r.get('ttft_ms') or {}).get('p50'))} ms"
            for n, r in sorted((res.get("replicas") or {}).items(), key=lambda kv: int(kv[0]))
        )
        + f"; p99s in {json_of('serve_replicas')}.",
    ]
    return out + provenance(run)


def section_dist(run: dict | None) -> list[str]:
    out = ["## Scale-out: `litevlm eval` under torchrun", ""]
    if run is None:
        return out + missing("torchrun evaluation", "python benchmarks/report.py --run --only dist_eval")
    res = run["result"]
    load = res.get("load_average") or {}
    out += [
        f"One machine ({res.get('host')}), {res.get('threads_per_rank')} torch thread per rank, the {res.get('config')}"
        f" configuration on {res.get('questions')} questions; one process and two ranks alternating for"
        f" {res.get('rounds')} rounds, each timed from outside (start and model load included). The load average was"
        f" {fmt(load.get('before'))} before the run and {fmt(load.get('after'))} after."
        f" Two ranks: **{fmt(res.get('speedup_best'))}x** the questions/s of one; the same final score:"
        f" {'yes' if res.get('same_final') else 'NO'}. "
        + "; ".join(
            f"{w} rank(s): {fmt(r.get('questions_per_s_best'))} questions/s at best, wall"
            f" {', '.join(fmt(x) for x in r.get('wall_s') or [])} s a round, final"
            f" {', '.join(fmt(x) for x in r.get('final') or [])}"
            for w, r in sorted((res.get("ranks") or {}).items(), key=lambda kv: int(kv[0]))
        )
        + ".",
    ]
    return out + provenance(run)


def ratio(a, b):
    """a / b to three decimals; None where either is missing or b is 0."""
    return round(a / b, 3) if a is not None and b else None


def json_of(name: str) -> str:
    return f"benchmarks/results/{name}.json"


def section_2b_cpu(run: dict | None) -> list[str]:
    out = ["## The 2B shapes on this CPU", ""]
    b = next(b for b in benchmarks() if b.name == "bench_2b_cpu")
    if run is None:
        return out + missing("the 2B shapes on the CPU", shown_command(b))
    res = run["result"]
    setup_s = sum(res.get("setup_ms", {}).values()) / 1e3
    out += [
        "Random weights at InternVL2.5-2B's shapes (2 tiles a camera, 256 tokens a tile), fp32, every row on one"
        " question of eight new tokens: that the real sizes run on this CPU, and in what memory. CPU figures, not the"
        f" GPU's. Peak resident memory {fmt(res.get('peak_memory_mb'))} MiB; building the rows, each with its warm-up"
        f" answer, took {setup_s:.0f} s. Each row's stages (mean ms): "
        + "; ".join(
            f"{r.get('config')} vit {fmt(r.get('vit_ms'))}, prefill {fmt(r.get('prefill_ms'))}, decode"
            f" {fmt(r.get('decode_ms'))}, total {fmt(r.get('total_ms'))}"
            for r in res.get("rows", [])
        )
        + f"; every column in {json_of('bench_2b_cpu')}.",
    ]
    return out + provenance(run)


COMPILE_COLUMNS = ["depth", "mode", "compile_s", "graphs", "ops", "step_ms", "max_diff"]


def section_compile(run: dict | None) -> list[str]:
    """`benchmarks/compile_cost.py`: a decode step compiled as one layer every layer reuses, or whole."""
    out = ["## Compiling a step: one layer for every layer, against the whole step", ""]
    b = next(b for b in benchmarks() if b.name == "compile_cost")
    if run is None:
        return out + not_measured_yet("a compiled step's cost", b)
    rows = run["result"]["rows"]
    out += [
        "The CUDA backend compiles its steps (with `--compile-steps`, and its prefill buckets) one decoder layer at a"
        " time: a single compile that every layer reuses, its weights and cache the graph's inputs. Here a decode"
        f" step of drive-hd's decoder over a {run['result']['width']}-slot bucket, at drive-hd's depth and at the 2B"
        " model's, compiled by inductor on this CPU from an empty cache, in its own process: `layer` the backend's"
        " way, `whole` the step compiled at once. `compile_s` the first call (trace, compile, run), `graphs` and"
        " `ops` what dynamo made, `step_ms` a later call, `max_diff` against the eager step's logits. CPU times;"
        " on a GPU Triton's kernel builds add to both forms.",
        "",
    ]
    by = {(r["depth"], r["mode"]): r for r in rows}
    deepest = max(r["depth"] for r in rows)
    lay, whole = by.get((deepest, "layer")), by.get((deepest, "whole"))
    if lay and whole:
        out += [
            f"At {deepest} layers one layer's compile takes **{fmt(lay['compile_s'])} s** against"
            f" {fmt(whole['compile_s'])} s for the whole step ({whole['compile_s'] / lay['compile_s']:.1f}x as long),"
            f" in {fmt(lay['graphs'])} graph of {fmt(lay['ops'])} operations against {fmt(whole['ops'])}.",
            "",
        ]
    out += table(COMPILE_COLUMNS, [[r.get(c) for c in COMPILE_COLUMNS] for r in rows])
    return out + provenance(run)


def gpu_plan() -> str:
    """The GPU script's plan as its source states it: "N steps planned to S s" (each limit and its kill-after)."""
    text = (ROOT / "benchmarks" / "gpu_session.sh").read_text()
    plan = [int(v) for v in re.findall(r"\[\w+\]=(\d+)", re.search(r"^declare -A PLAN=\((.*)\)$", text, re.M).group(1))]
    kill_after = int(re.search(r"^KILL_AFTER=(\d+)$", text, re.M).group(1))
    return f"{len(plan)} steps planned to {sum(plan) + kill_after * len(plan)} s"


STEP_COST_COLUMNS = [
    "variant",
    "steps",
    "decode_ms",
    "verify_ms",
    "draft_ms",
    "prefill_ms",
    "modules_ms",
    "decode_vs_floor",
    "verify_vs_decode",
    "break_even_tau",
    "setup_s",
]
GOAL_NAMES = {
    "decode_vs_floor": "a decode step over its floor",
    "verify_vs_decode": "a full tree's verification over a decode",
    "fp8_vs_bf16_decode": "FP8's decode over bf16's",
}


def step_cost_lines(res: dict) -> list[str]:
    """benchmarks/step_costs.py's run: the floor it measured, its goals met or not, and each variant's steps."""
    bw = res["bandwidth_gbs"]
    out = [
        f"{res['device']} at the {res['config']} shapes: {res['weight_bytes'] / 1e9:.2f} GB of decoder weights and"
        f" {res['kv_bytes'] / 1e6:.0f} MB of K/V over a {res['width']}-slot bucket, read at"
        f" {max(bw.values()):.0f} GB/s (measured: read {fmt(bw['read_gbs'])}, copy {fmt(bw['copy_gbs'])}): a decode"
        f" step's floor is **{fmt(res['floor_ms'])} ms**. The tree verified has {res['tree_nodes']} nodes, the draft"
        f" chain {res['draft_depth']} levels; `break_even_tau` is the tokens a cycle must commit to match plain"
        " decoding.",
        "",
    ]
    goals = [
        f"{GOAL_NAMES[k]} {fmt(g['value'])} (goal <= {fmt(g['goal'])}, {g['from']}): {'met' if g['met'] else 'not met'}"
        for k, g in res["goals"].items()
    ]
    if goals:
        out += ["Goals: " + "; ".join(goals) + ".", ""]
    out += table(STEP_COST_COLUMNS, [[r.get(c) for c in STEP_COST_COLUMNS] for r in res["rows"]])
    kernels = [
        f"{r['variant']} {r['steps']}: " + ", ".join(f"{step} {k}" for step, k in (r.get("kernels") or {}).items())
        for r in res["rows"]
    ]
    out += ["", "Attention kernels: " + "; ".join(kernels) + "."]
    if res.get("left_out"):
        out += ["", "Left out: " + "; ".join(res["left_out"]) + "."]
    return out


def section_gpu(runs: dict) -> list[str]:
    out = ["## GPU", ""]
    gpu = {k: v for k, v in runs.items() if k.startswith("gpu")}
    if not gpu:
        return out + [
            "**None measured yet.** This project's CUDA paths have not run on a device."
            f" `bash benchmarks/gpu_session.sh` on a machine with one runs, in {gpu_plan()} with their"
            " kill-afters: the `gpu`-marked tests (the pipeline's fast path first; stopped by SIGINT so their XML"
            " survives); `benchmarks/step_costs.py`, the CUDA backend's steps at the 2B shapes one at a time (the"
            " measured memory bandwidth and the floor of a decode step, then decode, a full tree's verification,"
            " the draft chain and the prefill in bf16 and FP8, eager inside their graphs, then compiled inside"
            " while its budget lasts), whose `goals` check a decode within 1.5x of the floor, a verification within"
            " 1.3x of a decode and FP8's decode no slower than bf16's; `litevlm bench --shape 2b` (random weights,"
            " bf16: baseline, EAGLE, LiteVLM and LiteVLM FP8 on the CUDA backend's replayed steps, each pinned to a"
            " fused attention kernel that the JSON names; the prefill eager); `litevlm bench --model drive-hd`"
            " (trained weights: real acceptance) from frames to answers, baseline and LiteVLM, every row on the CUDA"
            " backend; and the user's walkthrough (every recipe, eval, bench and quantize on a tiny checkpoint) on"
            " the device, and returns"
            " each step's JSON summary beside one archive of every file, whose results go to"
            " `benchmarks/results/gpu_*.json`; its `--dry-run` runs every step on the CPU through the CUDA backend's"
            " twin.",
            "",
        ]
    for name, run in sorted(gpu.items()):
        res = run["result"]
        out += [f"### {name}", ""]
        if res.get("benchmark") == "step_costs":
            out += step_cost_lines(res)
        elif "rows" in res and res["rows"] and "config" in res["rows"][0]:
            out += bench_tables(res)
        else:
            out += table(["figure", "value"], flatten(res))
        out += provenance(run)
    return out


# Comparisons of past changes and runs no longer made: the page points to their JSON and commit, without their figures
PAST = {
    "compile_vs_native": "torch.compile against the native steps",
    "before_after": "before and after the execution backends",
    "token_pruning_drive-tiny": "token pruning on drive-tiny",
    "token_pruning": "the first token pruning benchmark (drive-tiny)",
}


def past_line(runs: dict) -> list[str]:
    items = [
        f"{what} (benchmarks/results/{name}.json, commit {runs[name]['commit']})"
        for name, what in PAST.items()
        if name in runs
    ]
    return [f"Past comparisons, in git's history: {'; '.join(items)}.", ""] if items else []


def header(runs: dict) -> list[str]:
    runs = {k: v for k, v in runs.items() if k not in PAST}  # the figures shown: the past ones are only pointed to
    commits = sorted({r["commit"] for r in runs.values()})
    machines = sorted({(r["machine"]["cpu"], r["machine"]["cores"], r["machine"]["torch"]) for r in runs.values()})
    dates = sorted(r["date"] for r in runs.values())
    out = [
        "# Results",
        "",
        "Written by `python benchmarks/report.py` from `benchmarks/results/*.json` (one file per run); do not edit by"
        " hand. `python benchmarks/report.py --run` re-runs every benchmark first. Speed-ups are ratios of two"
        " configurations measured side by side in one run on the same inputs.",
        "",
    ]
    if not runs:
        return out + ["No results yet: `python benchmarks/report.py --run` makes them.", ""]
    out += [
        f"- commit: {', '.join(commits)}",
        ("- machine: " if len(machines) == 1 else "- machines: ")  # each run names its own below
        + "; ".join(f"{cpu}, {cores} cores, torch {torch}" for cpu, cores, torch in machines),
        f"- date: {dates[0]}" + (f" to {dates[-1]}" if dates[-1] != dates[0] else ""),
        "",
    ]
    return out + glance(runs)


def glance(runs: dict) -> list[str]:
    """The figures the README quotes: LiteVLM's speed-ups at each thread setting, from images to answer and by the
    paper's measure (drive-hd's first, where measured), and drive-tiny's accuracy through the ViewSelector."""
    lines = []
    hd = any(name in runs for name, _ in TABLE1["drive-hd"])
    for model, entries in TABLE1.items():
        for name, label in entries:
            if name in runs:
                res = runs[name]["result"]
                on = f" on {model}" if hd else ""  # named once drive-hd's figures stand beside drive-tiny's
                cpu = runs[name].get("machine", {}).get("cpu")  # CPU ratios move with the CPU
                lite = litevlm_row(res)
                where = f"at {label} ({res['threads']} thread(s){f', {cpu}' if cpu else ''})"
                paper, e2e = times(lite.get("speedup")), lite.get("e2e_speedup")
                lines.append(
                    f"- LiteVLM {times(e2e)} the baseline{on} from images to answer (e2e), {paper} by the paper's"
                    f" measure (stages only), {where}"
                    if e2e is not None
                    else f"- LiteVLM {paper} the baseline{on} by the paper's measure (stages only), {where}; from"
                    " images to answer (e2e): not in this run"
                )
    if "peers" in runs:
        res = runs["peers"]["result"]
        model = next(iter(res["models"]))
        for th, t in res["models"][model]["threads"].items():
            by = {r["config"]: r for r in t["rows"]}
            lines.append(
                f"- LiteVLM {times(peer_ratio(by, 'litevlm', 'llama.cpp f32'))} llama.cpp f32 and"
                f" {times(peer_ratio(by, 'litevlm', 'llama.cpp q8_0'))} llama.cpp Q8_0 on {model} from images to"
                f" answer, its baseline {times(peer_ratio(by, 'litevlm baseline', 'llama.cpp f32'))} llama.cpp f32,"
                f" at {th} thread(s) (llama.cpp through llama-cpp-python {res['versions'].get('llama-cpp-python')})"
            )
    if "drive_tiny_views" in runs:
        f = runs["drive_tiny_views"]["result"]["full"]
        lines.append(
            f"- drive-tiny's closed-question accuracy through the ViewSelector: **{fmt(f['closed_accuracy'])}**"
        )
    return (["At a glance:", "", *lines, ""]) if lines else []


GLANCE = ("<!-- glance: written by benchmarks/report.py from the runs behind RESULTS.md -->", "<!-- end glance -->")


def update_readme(readme: Path, runs: dict) -> bool:
    """Rewrite the README's results-at-a-glance block (between the GLANCE markers) from the same runs as the page:
    the three figures and the Table 1 plot. A README without the markers is left alone."""
    text = readme.read_text() if readme.exists() else ""
    if GLANCE[0] not in text or GLANCE[1] not in text:
        return False
    lines = glance(runs)[2:-1] or ["No results yet: `python benchmarks/report.py --run` makes them."]
    run = runs.get("bench_1thread")
    plot = plot_of(run) if run is not None else None
    if plot:
        lines += ["", f"![Table 1 on drive-tiny, mean stage times]({plot})"]
    elif run is not None and "--plot " in run.get("command", ""):
        lines += ["", "(The stored Table 1 plot stacks medians; the next run draws it again by mean stage times.)"]
    text = replace_block(text, GLANCE, lines)
    if SCALE[0] in text and SCALE[1] in text:
        text = replace_block(text, SCALE, scale_lines(runs))
    readme.write_text(text)
    return True


SCALE = ("<!-- scale: written by benchmarks/report.py from the runs behind RESULTS.md -->", "<!-- end scale -->")


def replace_block(text: str, markers: tuple[str, str], lines: list[str]) -> str:
    head, rest = text.split(markers[0], 1)
    tail = rest.split(markers[1], 1)[1]
    return "\n".join([head + markers[0], *lines, markers[1]]) + tail


def scale_lines(runs: dict) -> list[str]:
    """The README's figures for one and two ranks (torchrun) and replicas (Ray Serve)."""
    lines = []
    if "dist_eval" in runs:
        r = runs["dist_eval"]["result"]
        one, two = (r["ranks"][w]["questions_per_s_best"] for w in ("1", "2"))
        same = "the same final score" if r.get("same_final") else "DIFFERENT final scores"
        lines.append(
            f"- `litevlm eval` ({r['config']}, {r['questions']} drive-tiny questions, one thread a rank): {fmt(one)}"
            f" questions/s in one process, {fmt(two)} on two ranks (**{fmt(r['speedup_best'])}x**), {same}"
        )
    if "serve_replicas" in runs:
        r = runs["serve_replicas"]["result"]
        reps = r.get("replicas") or {}
        one, two = (reps.get(n, {}) for n in ("1", "2"))
        lines.append(
            f"- `litevlm serve --replicas N` (drive-tiny, one thread a replica): {fmt(one.get('throughput_rps'))}"
            f" answers/s from one replica, {fmt(two.get('throughput_rps'))} from two"
            f" (**{fmt(r.get('throughput_ratio'))}x**; p50 latency {fmt((one.get('latency_ms') or {}).get('p50'))} and"
            f" {fmt((two.get('latency_ms') or {}).get('p50'))} ms)"
        )
    return lines or ["Not measured yet: `python benchmarks/report.py --run --only dist_eval,serve_replicas`."]


def load(results: Path) -> dict:
    runs = {}
    for p in sorted(results.glob("*.json")):
        run = json.loads(p.read_text())
        runs[run.get("benchmark", p.stem)] = run
    return runs


def render(runs: dict) -> str:
    lines = [
        *header(runs),
        *section_bench(runs, "drive-hd", first=True),
        *before_after_line(runs.get("before_after_hd")),
        *section_peers(runs.get("peers")),
        *section_frames(runs),
        *section_preprocess(runs.get("preprocess")),
        *section_explain(runs.get("explain_hd")),
        *section_bench(runs, "drive-tiny", first=False),
        *section_sweep(runs.get("spec_sweep")),
        *section_pruning(runs, "drive-hd"),
        *section_pruning(runs, "drive-hd-neutral"),
        *section_pruning(runs, "drive-hd-all-questions"),
        *section_pruning(runs, "drive-hd-neutral-all-questions"),
        *section_pruning(runs, "drive-hd-all-views"),
        *section_pruning(runs, "drive-hd-neutral-all-views"),
        *section_race(runs),
        *section_views(runs.get("view_selection")),
        *section_scores(runs),
        *section_serve(runs.get("serve_load"), runs.get("serve_load_hd")),
        *section_batching(runs),
        *section_scale(runs.get("serve_replicas")),
        *section_dist(runs.get("dist_eval")),
        *section_2b_cpu(runs.get("bench_2b_cpu")),
        *section_compile(runs.get("compile_cost")),
        *section_gpu(runs),
        *past_line(runs),
    ]
    # one blank line between blocks: a section ending in a blank line meets the next one's
    lines = [x for i, x in enumerate(lines) if x or (i and lines[i - 1])]
    return "\n".join(lines).rstrip() + "\n"


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--run", action="store_true", help="run the benchmarks first")
    p.add_argument("--only", default=None, help="comma-separated benchmark names (default: all)")
    p.add_argument("--n", type=int, default=None, help="questions (requests for serve_load) in each run")
    p.add_argument("--list", action="store_true", help="list the benchmarks and their commands")
    p.add_argument("--results", default=str(RESULTS), help="folder of the runs' JSON")
    p.add_argument(
        "--core",
        type=int,
        default=None,
        help="the core a pinned run takes (default 1): two untimed runs (accuracy alone) can share a machine",
    )
    p.add_argument("--out", default=str(ROOT / "RESULTS.md"))
    p.add_argument("--readme", default=str(ROOT / "README.md"), help="whose results-at-a-glance block to rewrite")
    args = p.parse_args(argv)
    if args.core is not None:
        global CORE
        CORE = args.core
    known = benchmarks()
    if args.list:
        for b in known:
            print(f"{b.name:24} {shlex.join(b.command(args.n))}")
        return
    chosen = known
    if args.only:
        names = [s.strip() for s in args.only.split(",") if s.strip()]
        unknown = sorted(set(names) - {b.name for b in known})
        if unknown:
            raise SystemExit(f"unknown benchmarks {unknown}: choose among {', '.join(b.name for b in known)}")
        chosen = [b for b in known if b.name in names]
    results = Path(args.results)
    if args.run:
        results.mkdir(parents=True, exist_ok=True)
        for b in chosen:
            run = run_one(b, args.n)
            (results / f"{b.name}.json").write_text(json.dumps(run, indent=1) + "\n")
    runs = load(results)
    Path(args.out).write_text(render(runs))
    print(f"wrote {args.out}")
    if update_readme(Path(args.readme), runs):
        print(f"updated the results at a glance in {args.readme}")


if __name__ == "__main__":
    main()
