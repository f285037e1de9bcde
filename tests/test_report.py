"""benchmarks/report.py: the results page shows the figures of the runs' JSON, and says plainly what was not run."""

import copy
import json

import pytest

from litevlm.eval.bench import ACCURACY_COLUMNS

MACHINE = {"cpu": "Test CPU 9000", "cores": 2, "torch": "2.0.0+cpu", "threads": 1, "gpu": None}


def run_file(name: str, result: dict, command: str, threads: int = 1) -> dict:
    return {
        "benchmark": name,
        "command": command,
        "setup": ["litevlm data synth --out .bench-data/heldout --frames 100 --seed 1"],
        "date": "2030-01-02 03:04 UTC",
        "commit": "abc1234",
        "machine": {**MACHINE, "threads": threads},
        "exit_code": 0,
        "seconds": 12.5,
        "result": result,
    }


def bench_row(config: str, total: float, speedup: float | None, score: float, tau=None, **extra) -> dict:
    """A row of `litevlm bench --json`: means over the questions, the stages and other adding up to the total."""
    stages = {"select_views_ms": 0.25, "vit_ms": round(total / 3, 3), "select_tokens_ms": 0.281}
    stages |= {"prefill_ms": round(total / 2.5, 3), "decode_ms": 0.0071}
    return {
        "config": config,
        "views": 2.46 if "lite" in config else 6.0,
        "visual_tokens": 39.4 if "lite" in config else 96.0,
        "input_tokens": 83.7,
        **stages,
        "select_ms": 0.531,
        "other_ms": round(total - sum(stages.values()), 3),
        "total_ms": total,
        "p50_total_ms": round(total * 0.8, 3),
        "p90_total_ms": round(total * 1.9, 3),
        "preprocess_ms": 3.1,
        "decode_tokens": 0.017,
        "extend_one_ms": 0.417,
        "speedup": speedup,
        "speed_figure": True,
        "emulated": False,
        "score": score,
        "tau": tau,
        "opened_tokens": 2.44,
        "precision": "float32",
        "mean_total_ms": total,
        "e2e_ms": round(total + 3.1, 3),
        "p50_e2e_ms": round(total * 0.8 + 3.1, 3),
        "p90_e2e_ms": round(total * 1.9 + 3.1, 3),
        "e2e_speedup": None,
        "preprocess_share": round(3.1 / (total + 3.1), 4),
        **extra,
    }


def bench(threads: int, lite_speedup: float, lite_e2e: float | None = None) -> dict:
    lite_e2e = round(lite_speedup * 0.8, 2) if lite_e2e is None else lite_e2e
    return {
        "model": "drive-tiny",
        "device": "cpu",
        "threads": threads,
        "cpu_steps": "native",
        "questions": 100,
        "rows": [
            bench_row("baseline", 32.77, 1.0, 0.5297, e2e_speedup=1.0),
            bench_row("litevlm", 12.833, lite_speedup, 0.5355, 5.704, e2e_speedup=lite_e2e),
            bench_row(
                "litevlm fp8",
                61.417,
                None,
                0.5351,
                5.5,
                precision="fp8-dynamic-per-row+float32",
                speed_figure=False,
                emulated=True,
            ),
        ],
    }


def peers_fixture() -> dict:
    rows = [
        {"config": "litevlm baseline", "visual_tokens": 768, "e2e_ms": 300.0, "p50_e2e_ms": 290.0, "score": 0.5},
        {"config": "litevlm", "visual_tokens": 64, "e2e_ms": 60.0, "p50_e2e_ms": 40.0, "score": 0.52},
        {"config": "llama.cpp f32", "visual_tokens": 1152, "e2e_ms": 400.0, "p50_e2e_ms": 380.0, "score": 0.5},
    ]
    return {
        "versions": {"llama-cpp-python": "0.3.36"},
        "models": {"drive-hd": {"threads": {"1": {"pinned": True, "rows": rows}}, "tiling": {}}},
    }


FIXTURES = {
    "bench_1thread": run_file(
        "bench_1thread",
        bench(1, 2.72),
        "OMP_NUM_THREADS=1 taskset -c 1 litevlm bench --data .bench-data/heldout --json --plot "
        "benchmarks/results/bench_1thread.png --n 100",
    ),
    "bench_default_threads": run_file(
        "bench_default_threads", bench(2, 2.21), "litevlm bench --data .bench-data/heldout --json --n 100", threads=2
    ),
    "spec_sweep": run_file(
        "spec_sweep",
        {
            "questions": 100,
            "best": "chain d16 v0.1",
            "best_speedup": 2.02,
            "best_tau": 5.61,
            "lossless": True,
            "rows": [
                {"config": "plain", "tau": 1.0, "draft_ms": None, "verify_ms": None, "tokens_per_s": 1052.1}
                | {"speedup": 1.0, "mismatches": 0},
                {"config": "chain d16 v0.1", "tau": 5.61, "draft_ms": 0.58, "verify_ms": 1.89}
                | {"tokens_per_s": 2123.6, "speedup": 2.018, "mismatches": 0},
            ],
        },
        "python benchmarks/spec_sweep.py --n 100",
    ),
    "token_pruning": run_file(
        "token_pruning",
        {
            "n": 200,
            "ratios": [0.3, 0.7],
            "unpruned": {"final": 0.5351, "closed_accuracy": 0.8601},
            "scores": {
                "selector@0.3": {"final": 0.5312, "closed_accuracy": 0.851},
                "selector@0.7": {"final": 0.5349, "closed_accuracy": 0.8598},
                "fastv_k1@0.3": {"final": 0.5011, "closed_accuracy": 0.802},
                "fastv_k1@0.7": {"final": 0.5203, "closed_accuracy": 0.8333},
            },
            "timing_ms": {"prefill_unpruned": 5.16, "selector@0.3": 1.21, "prefill_pruned@0.3": 4.07},
            "plot": "benchmarks/results/token_pruning.png",
        },
        "python benchmarks/token_pruning.py --n 200",
    ),
    "view_selection": run_file(
        "view_selection",
        {
            "questions": 1024,
            "recall": 0.999023,
            "views_per_question": 2.484375,
            "needed_per_question": 2.484375,
            "ratio_to_needed": 1.0,
            "exact": 0.98,
            "lexical_only": {
                "recall": 1.0,
                "views_per_question": 2.5625,
                "needed_per_question": 2.484375,
                "ratio_to_needed": 1.0314,
                "exact": 0.91,
            },
            "vision": {
                "questions": 40,
                "vit_ms_all_median": 13.57,
                "vit_ms_selected_median": 3.84,
                "tiles_selected_mean": 2.43,
                "speedup": 3.1,
            },
        },
        "python benchmarks/view_selection.py",
    ),
    "drive_tiny_views": run_file(
        "drive_tiny_views",
        {
            "full": {"n": 1688, "final": 0.5351, "closed_accuracy": 0.8631},
            "blank": {"n": 1688, "final": 0.324, "closed_accuracy": 0.4373},
            "closed_accuracy_gap": 0.4258,
        },
        "python benchmarks/drive_tiny_eval.py --select-views",
    ),
    "serve_load": run_file(
        "serve_load",
        {
            "model": "drive-tiny",
            "requests": 200,
            "throughput_rps": 41.377,
            "latency_ms": {"p50": 310.5, "p99": 611.2},
            "ttft_ms": {"p50": 12.25},
        },
        "python benchmarks/serve_load.py --requests 200",
    ),
}


@pytest.fixture(scope="module")
def report(benchmark_script):
    return benchmark_script("report")


def write(tmp_path, report, runs: dict) -> str:
    results = tmp_path / "results"
    results.mkdir(parents=True)
    for name, run in runs.items():
        (results / f"{name}.json").write_text(json.dumps(run))
    out = tmp_path / "RESULTS.md"
    report.main(["--results", str(results), "--out", str(out), "--readme", str(tmp_path / "README.md")])
    return out.read_text()


def row(report, cells) -> str:
    return "| " + " | ".join(report.fmt(c) for c in cells) + " |"


def test_the_page_shows_every_figure_of_the_runs(tmp_path, report):
    page = write(tmp_path, report, FIXTURES)
    # Table 1: every row of drive-tiny's pinned run, cell for cell, the command and provenance under each; its
    # default-threads run in one line, its measures, beside its JSON.
    tiny = FIXTURES["bench_default_threads"]
    assert (
        f"{report.measures_line(tiny['result'])} The table is in benchmarks/results/bench_default_threads.json." in page
    )
    assert f"Command: `{tiny['command']}`" in page
    for name in ("bench_1thread",):
        run = FIXTURES[name]
        for r in run["result"]["rows"][:2]:
            assert row(report, [r[c] for c in report.BENCH_COLUMNS]) in page
        # An emulated precision is an accuracy row: no time of it is on the page, and no speed-up.
        fp8 = run["result"]["rows"][2]
        figures = ", ".join(f"{c} {report.fmt(fp8[c])}" for c in ACCURACY_COLUMNS[2:])
        assert f"emulated here: its times are no speed figure): litevlm fp8: {figures}." in page
        assert "| litevlm fp8 | 2.46 |" not in page and "61.417" not in page
        assert f"Command: `{run['command']}`" in page
    # both measures, images to answer first; the CPU beside the ratios: CPU ratios move with the CPU
    glance = (
        "LiteVLM **2.18x** the baseline from images to answer (e2e), **2.72x** by the paper's measure (stages only),"
    )
    assert f"{glance} at one pinned thread (1 thread(s), Test CPU 9000)" in page
    assert "**2.21x** by the paper's measure (stages only), at the default threads" in page
    assert (
        "LiteVLM: **2.72x** by the paper's measure, **2.18x** from images to answer; preprocessing 19% of its e2e"
        in page
    )
    assert "(100 questions, 1 thread(s), CPU steps: native)" in page
    assert "Means over the questions" in page and "before the rows were means" not in page
    assert "![Table 1 stages](benchmarks/results/bench_1thread.png)" in page
    assert "- commit: abc1234\n" in page and "Test CPU 9000, 2 cores, torch 2.0.0+cpu" in page
    assert "2030-01-02 03:04 UTC" in page
    # The sweep, its fastest tree, and losslessness.
    assert "`chain d16 v0.1`, **2.02x**" in page  # the trees' table is in the JSON
    assert (
        "Every tree's tau, draft_ms, verify_ms, tokens_per_s, speedup, mismatches: benchmarks/results/spec_sweep"
        in page
    )
    # The first pruning benchmark's run is past: one line points to its JSON and commit, none of its figures.
    assert (
        "the first token pruning benchmark (drive-tiny) (benchmarks/results/token_pruning.json, commit abc1234)" in page
    )
    assert "0.5312" not in page and "## Token pruning on drive-tiny" not in page
    # ViewSelector recall, rounded to four decimals only.
    assert "| ViewSelector | 0.999 | 2.4844 | 2.4844 | 1.0 | 0.98 |" in page
    assert "| lexical map alone | 1.0 | 2.5625 | 2.4844 | 1.0314 | 0.91 |" in page
    # drive-tiny's scores and the at-a-glance accuracy.
    assert "| ViewSelector on | 1688 | 0.5351 | 0.324 | 0.8631 | 0.4373 | 0.4258 |" in page
    assert "through the ViewSelector: **0.8631**" in page
    # The server: whatever keys its JSON has, nested ones included.
    for key, value in (("throughput_rps", "41.377"), ("latency_ms.p99", "611.2"), ("ttft_ms.p50", "12.25")):
        assert f"| {key} | {value} |" in page


def earlier_row(config: str, median: float, mean: float, shares: dict, precision="float32") -> dict:
    """A row of a run from when the rows were medians: `total_ms` the median, `mean_total_ms` the mean."""
    return {
        "config": config,
        "views": 6.0,
        "vit_ms": 17.928,
        "input_tokens": 187.2,
        "prefill_ms": 16.652,
        "extend_one_ms": 1.231,
        "decode_ms": 4.066,
        "select_ms": 0.005,
        "total_ms": median,
        "speedup": 1.0,
        "score": 0.5402,
        "tau": None,
        "opened_tokens": 0.0,
        "precision": precision,
        "mean_total_ms": mean,
        "shares": shares,
    }


def test_an_earlier_median_run_is_shown_by_its_means_and_what_it_did_not_store_as_missing(tmp_path, report):
    shares = {"vit": 0.3298, "select": 0.0002, "prefill": 0.3229, "decode": 0.3471}
    lite_shares = {"vit": 0.3192, "select": 0.0448, "prefill": 0.3944, "decode": 0.2416}
    rows = [
        earlier_row("baseline", 41.857, 54.447, shares),
        earlier_row("litevlm", 18.192, 28.845, lite_shares) | {"speedup": 2.3},  # the median ratio it stored
        earlier_row("litevlm fp8", 66.973, 120.927, lite_shares, "fp8-dynamic-per-row+float32") | {"speedup": 0.62},
    ]
    result = {"model": "drive-tiny", "device": "cpu", "threads": 1, "cpu_steps": "native", "questions": 100}
    command = "litevlm bench --json --plot benchmarks/results/bench_1thread.png --n 100"
    runs = {"bench_1thread": run_file("bench_1thread", result | {"rows": rows}, command)}
    readme = tmp_path / "README.md"
    readme.write_text(f"{report.GLANCE[0]}\nold\n{report.GLANCE[1]}\n")
    page = write(tmp_path, report, runs)
    # The speed-up is the ratio of the stored means, 54.447 / 28.845, not the stored ratio of medians (2.3).
    assert "LiteVLM: **1.89x** by the paper's measure, n/a from images to answer (100 questions" in page
    glance = "LiteVLM **1.89x** the baseline by the paper's measure (stages only), at one pinned thread"
    assert glance in readme.read_text() and "from images to answer (e2e): not in this run" in readme.read_text()
    # total = the stored mean, p50 = the stored median, stage means = share x mean total; the rest missing.
    # preprocessing and e2e (images to answer) were not measured then: n/a
    cells = ["baseline", 6.0, None, 187.2, 17.96, 17.58, 1.231, 18.9, 0.01, None, 54.447, 41.857, None, 1.0]
    assert row(report, [*cells, *[None] * 5, 0.5402, None, 0.0]) in page
    lite = ["litevlm", 6.0, None, 187.2, 9.21, 11.38, 1.231, 6.97, 1.29, None, 28.845, 18.192, None, 1.89]
    assert row(report, [*lite, *[None] * 5, 0.5402, None, 0.0]) in page
    assert "before the rows were means" in page
    assert "`visual_tokens`, `p90_total_ms`, `preprocess_ms` and e2e were not stored" in page
    # Its FP8 row, from a CPU run that did not say, is an accuracy row; its 0.62 is on the page nowhere.
    assert (
        "Accuracy only (fp8-dynamic-per-row+float32, emulated here: its times are no speed figure): litevlm fp8:"
        " views 6.0, visual_tokens n/a, input_tokens 187.2, score 0.5402, tau n/a." in page
    )
    assert "0.62" not in page and "120.927" not in page
    # Its plot stacked medians: neither the page nor the README shows it.
    assert "bench_1thread.png)" not in page and "bench_1thread.png" not in readme.read_text()
    assert "the next run draws it again by mean stage times" in readme.read_text()
    assert "Its plot, drawn from medians, is not shown" in page


def test_a_benchmark_not_run_is_said_plainly(tmp_path, report):
    runs = {k: v for k, v in FIXTURES.items() if k not in ("spec_sweep", "bench_default_threads")}
    page = write(tmp_path, report, runs)
    assert "**Not measured:** no results file for the EAGLE-2 sweep." in page
    assert "**Not measured:** no results file for `litevlm bench` at the default threads." in page
    assert "torch.compile" not in page and "compile_vs_native" not in page  # no past run: no pointer to one
    assert "**None measured yet.**" in page  # no GPU results
    assert "at the default threads (" not in page  # nor a glance figure for it


def test_past_comparisons_are_one_line_and_gpu_results_are_shown(tmp_path, report):
    compile_run = run_file(
        "compile_vs_native",
        {
            "benchmark": "compile_vs_native",
            "rows": [
                {"step": "decode", "threads": 1, "eager_ms": 2.378, "native_ms": 0.819}
                | {"inductor_ms": 1.234, "aoti_ms": None, "compile_s": 41.5}
            ],
            "kept": {"decode": "native"},
            "rule": "keep the fastest backend per step",
        },
        "python benchmarks/compile_vs_native.py",
    )
    gpu_run = run_file("gpu_bench_2b", bench(1, 3.03), "litevlm bench --shape 2b --json")
    compile_run["commit"] = "d6d5325"
    before_after = run_file("before_after", {"rows": []}, "python benchmarks/before_after.py") | {"commit": "99614ac"}
    runs = {**FIXTURES, "compile_vs_native": compile_run, "before_after": before_after, "gpu_bench_2b": gpu_run}
    page = write(tmp_path, report, runs)
    # past changes: no section, no figure, one line naming each JSON file and the commit that made it
    assert "## torch.compile" not in page and "2.378" not in page and "## Before and after" not in page
    past = next(line for line in page.splitlines() if line.startswith("Past comparisons"))
    assert "torch.compile against the native steps (benchmarks/results/compile_vs_native.json, commit d6d5325)" in past
    assert "before and after the execution backends (benchmarks/results/before_after.json, commit 99614ac)" in past
    assert "d6d5325" not in page.split("- commit:")[1].split("\n")[0]  # the header counts the figures shown only
    assert "None measured yet" not in page and "### gpu_bench_2b" in page
    assert row(report, [gpu_run["result"]["rows"][1][c] for c in report.BENCH_COLUMNS]) in page
    assert "Accuracy only (fp8-dynamic-per-row+float32" in page.split("### gpu_bench_2b")[1]


def test_a_run_keeps_the_last_json_line_with_its_command(report):
    script = 'print("progress"); print(\'{"benchmark": "x", "value": 1.5}\')'
    run = report.run_one(report.Benchmark("probe", ["-c", script], pinned=False), None)
    assert run["result"] == {"benchmark": "x", "value": 1.5}
    assert run["command"].startswith("python -c") and run["exit_code"] == 0
    assert {"cpu", "cores", "torch", "threads"} <= set(run["machine"]) and run["commit"]


def test_a_run_without_a_json_line_is_refused(report):
    with pytest.raises(SystemExit, match="no JSON line"):
        report.run_one(report.Benchmark("probe", ["-c", "print('done')"], pinned=False), None)


def test_the_readme_quotes_the_pages_three_figures_and_its_plot(tmp_path, report):
    readme = tmp_path / "README.md"
    readme.write_text(
        f"# x\n\n## Results at a glance\n\n{report.GLANCE[0]}\nold figures\n{report.GLANCE[1]}\n\n## After\n"
    )
    page = write(tmp_path, report, FIXTURES)
    text = readme.read_text()
    assert "old figures" not in text and text.startswith("# x\n") and text.endswith("## After\n")
    block = text.split(report.GLANCE[0])[1].split(report.GLANCE[1])[0]
    figures = [line for line in block.splitlines() if line.startswith("- ")]
    assert len(figures) == 3 and all(f in page for f in figures)  # the page's own lines, word for word
    assert "2.72x" in figures[0] and "2.21x" in figures[1] and "0.8631" in figures[2]
    assert "![Table 1 on drive-tiny, mean stage times](benchmarks/results/bench_1thread.png)" in block


def test_the_model_card_keeps_its_training_history_when_rewritten(tmp_path, benchmark_script):
    card = benchmark_script("drive_tiny_eval")
    meta = {"litevlm": {"name": "x"}, "format": "litevlm", "steps": 5, "recipe": {"lr": 3e-4, "frames": 10}}
    (tmp_path / "config.json").write_text(json.dumps(meta))
    scores = {"n": 4, "final": 0.5, "accuracy": 0.75, "language": 0.6, "match": 0.0, "closed_accuracy": 0.75}
    result = {
        "full": scores,
        "blank": {**scores, "closed_accuracy": 0.25},
        "data": "d",
        "pipeline": "views",
        "final_note": "no judge",
        "per_family_closed": {},
        "per_family_closed_blank": {},
        "machine": "m",
        "latency_ms": {**{s: 1.0 for s in card.STAGES}, "total": 5.0, "share": {s: 0.2 for s in card.STAGES}},
    }
    card.write_card(tmp_path, result)  # no card before: none to keep
    assert card.HISTORY not in (tmp_path / "MODEL.md").read_text()
    history = f"{card.HISTORY}\n\n| step | what changed |\n|---|---|\n| 1 | from scratch |\n"
    (tmp_path / "MODEL.md").write_text("# old card\n\nold scores\n\n" + history)
    card.write_card(tmp_path, {**result, "full": {**scores, "final": 0.625}})
    text = (tmp_path / "MODEL.md").read_text()
    assert "old scores" not in text and "| with the camera images | 0.6250 |" in text  # the scores are rewritten
    assert text.endswith(history) and text.count(card.HISTORY) == 1  # the history is kept once, at the end
    # any hand-written section after the generated footer is kept, whatever its heading, with or without a history
    stands = "## Where it stands\n\nIts goal is met.\n"
    (tmp_path / "MODEL.md").write_text(text + "\n" + stands)
    card.write_card(tmp_path, result)
    text = (tmp_path / "MODEL.md").read_text()
    assert "| with the camera images | 0.5000 |" in text
    assert text.endswith(history + "\n" + stands) and text.count(card.FOOTER) == 1
    (tmp_path / "MODEL.md").write_text(text[: text.index(card.HISTORY)] + stands)  # no history, one section
    card.write_card(tmp_path, {**result, "full": {**scores, "final": 0.625}})
    text = (tmp_path / "MODEL.md").read_text()
    assert "| with the camera images | 0.6250 |" in text and card.HISTORY not in text
    assert text.endswith(card.FOOTER + "\n\n" + stands) and text.count(stands) == 1


def test_the_server_levels_are_one_row_each_with_their_first_token_times(tmp_path, report):
    def level(answered, rps, p50, p99, t50, t99):
        return {
            "statuses": {"200": answered},
            "answered": answered,
            "five_xx": 0,
            "mismatches_vs_one_at_a_time": 0,
            "wall_s": 30.0,
            "throughput_rps": rps,
            "latency_ms": {"p50": p50, "p99": p99},
            "ttft_ms": {"p50": t50, "p99": t99},
        }

    levels = {"16": level(200, 6.6, 2404.8, 2619.5, 2380.5, 2612.5), "1": level(200, 6.5, 145.3, 212.6, 131.2, 150.8)}
    result = {"requests_per_level": 200, "max_queue": 16, "distinct_requests": 20, "clients": levels}
    page = write(tmp_path, report, {**FIXTURES, "serve_load": run_file("serve_load", result, "python serve_load.py")})
    assert "| 1 | 200 | 0 | 0 | 6.5 | 145.3 | 212.6 | 131.2 | 150.8 |" in page
    assert "| 16 | 200 | 0 | 0 | 6.6 | 2404.8 | 2619.5 | 2380.5 | 2612.5 |" in page
    assert page.index("| 1 | 200 |") < page.index("| 16 | 200 |")  # levels in client order, not key order
    assert "requests per level 200" in page


def test_the_one_at_a_time_and_the_batching_server_and_the_batch_sizes_show_their_ratios(tmp_path, report):
    def level(rps, p50):
        return {"answered": 48, "five_xx": 0, "mismatches_vs_one_at_a_time": 0, "throughput_rps": rps}, p50

    def levels(*figures):
        out = {}
        for n, (rps, p50) in zip(("8", "1", "4"), figures):  # keys out of client order
            lv, lat = level(rps, p50)
            out[n] = {**lv, "latency_ms": {"p50": lat, "p99": 2 * lat}, "ttft_ms": {"p50": lat / 2, "p99": lat}}
        return out

    by_batch = {
        "1": levels((10.0, 800.0), (10.0, 50.0), (10.0, 200.0)),
        "8": levels((25.0, 100.0), (10.0, 50.0), (20.0, 90.0)),
    }
    serve = {"requests_per_level": 48, "max_queue": 16, "config": "litevlm", "view_cache_mb": 0}
    serve |= {"clients": by_batch["8"], "by_max_batch": by_batch}

    def decode(rates, in_flight):
        return {
            b: {"tokens_per_s": r, "vs_batch_1": round(r / rates[0], 3), "mean_in_flight": in_flight,
                "identical_to_batch_1": "24/24"}
            for b, r in zip(("1", "2", "4", "8"), rates)
        }  # fmt: skip

    frame = {"one_at_a_time_ms_per_question": 40.0, "answer_all_ms_per_question": 20.0, "ratio": 0.5}
    configs = {
        "litevlm": {"decode": decode((100.0, 180.0, 300.0, 400.0), 6.5), "frame": {**frame, "equal_answers": "24/24"}}
    }
    batched = {"model": "drive-hd", "threads": 1, "configs": configs}
    page = write(
        tmp_path,
        report,
        {
            **FIXTURES,
            "serve_load": run_file("serve_load", serve, "python serve_load.py"),
            "batch_decode_hd": run_file("batch_decode_hd", batched, "python batch_decode.py --threads 1"),
        },
    )
    assert "--max-batch 1: 1 client(s) 10.0 requests/s, p50 50.0 ms" in page
    assert "8 client(s) 10.0 requests/s, p50 800.0 ms (**1.0x** the requests/s, **16.0x** the p50)" in page
    assert "8 client(s) 25.0 requests/s, p50 100.0 ms (**2.5x** the requests/s, **2.0x** the p50)" in page
    assert "view cache off" in page and "the litevlm configuration" in page
    assert "4 client(s)" not in page  # the fewest and the most clients on the page, every level in the JSON
    assert "litevlm at 1 thread(s) 100.0, 180.0, 300.0, 400.0 tokens/s at B = 1, 2, 4, 8 (**4.0x** at the most" in page
    assert "6.5 in flight on average" in page
    assert "litevlm at 1 thread(s) 20.0 against 40.0 (**0.5x**, 24/24 equal)" in page
    assert "Command: `python batch_decode.py --threads 1`" in page


def test_the_batch_page_shows_bench_batch_and_what_bounds_a_batched_step(tmp_path, report):
    def decode(rates):
        return {b: {"tokens_per_s": r, "vs_batch_1": round(r / rates[0], 3), "mean_in_flight": 2.0,
                    "identical_to_batch_1": "6/6"} for b, r in zip(("1", "8"), rates)}  # fmt: skip

    frame = {"one_at_a_time_ms_per_question": 40.0, "answer_all_ms_per_question": 30.0, "ratio": 0.75}
    steps = {"1": {"cached_ms": 1.0, "short_ms": 0.7, "cached_tokens": 850.0},
             "8": {"cached_ms": 5.5, "short_ms": 2.4, "cached_tokens": 860.0}}  # fmt: skip
    configs = {
        "baseline": {"decode": decode((100.0, 150.0)), "step_ms": steps, "frame": {**frame, "equal_answers": "6/6"}}
    }
    batched = {"model": "drive-hd", "threads": 1, "configs": configs}
    row = {
        "config": "litevlm",
        "batch_1": {"decode_tokens_per_s": 500.0, "mean_in_flight": 1.0},
        "batch_8": {"decode_tokens_per_s": 1250.0, "mean_in_flight": 5.5},
        "decode_tokens_per_s_ratio": 2.5,
        "questions_per_s_ratio": 1.2,
        "identical_to_batch_1": "96/96",
    }
    bench = {"model": "drive-hd", "mode": "batch", "batch": 8, "threads": 2, "batch_rows": [row]}
    page = write(
        tmp_path,
        report,
        {
            **FIXTURES,
            "batch_decode_hd": run_file("batch_decode_hd", batched, "python batch_decode.py --threads 1"),
            "bench_batch_hd_default_threads": run_file(
                "bench_batch_hd_default_threads", bench, "litevlm bench --batch 8"
            ),
        },
    )
    assert "one plain step costs 1.0 ms at B = 1 and 5.5 ms at B = 8 over 860.0 cached tokens a row" in page
    assert "0.7 and 2.4 ms over 16" in page
    assert "litevlm 500.0 -> 1250.0 decode tokens/s (**2.5x**, 5.5 in flight), questions/s **1.2x**" in page
    assert "same answers 96/96" in page and "Command: `litevlm bench --batch 8`" in page


def test_the_llama_cpp_section_and_glance_give_litevlm_against_each_peer_row(tmp_path, report):
    def peer(config, e2e, tokens=768, **extra):
        return {"config": config, "visual_tokens": tokens, "e2e_ms": e2e, "p50_e2e_ms": e2e, "score": 0.5, **extra}

    rows = [
        peer("litevlm baseline", 300.0, per_token_ms=0.9),
        peer("litevlm", 60.0, tokens=64, agreement=0.9),
        peer("llama.cpp f32", 360.0, tokens=1152, agreement=0.5, llama_cpp={"eval_ms_per_token": 0.85}),
        peer("llama.cpp q8_0", 240.0, tokens=1152, agreement=0.4),
        peer("llama.cpp f32, litevlm tiles", 330.0, agreement=0.97),
        peer("llama.cpp f32, chat", 370.0),
        peer("llama.cpp f32, chat + lookup 10", 300.0),
    ]
    models = {
        "drive-hd": {
            "threads": {"1": {"pinned": True, "rows": rows}},
            "tiling": {"litevlm": {"visual_tokens": 768}, "llama.cpp": {"visual_tokens": 1152}},
        },
        "drive-tiny": {
            "threads": {
                "2": {
                    "pinned": False,
                    "rows": [peer("litevlm baseline", 20.0), peer("litevlm", 10.0), peer("llama.cpp f32", 30.0)],
                }
            }
        },  # fmt: skip
    }
    result = {"versions": {"llama-cpp-python": "0.3.36", "llama.cpp system": "AVX2 = 1"}, "models": models}
    page = write(tmp_path, report, {**FIXTURES, "peers": run_file("peers", result, "python benchmarks/peers.py")})
    assert (
        "## Beside llama.cpp" in page and "prompts hold 1152 visual tokens where litevlm's baseline holds 768" in page
    )
    assert "| llama.cpp f32 | 1 | 1152 |" in page and "| **6.0x** | 0.5 | 0.5 |" in page
    assert "LiteVLM **6.0x** llama.cpp f32 and **4.0x** llama.cpp Q8_0 from images to answer" in page
    assert "the baseline **1.2x** llama.cpp f32 (on the same tiles **1.1x**)" in page
    assert "the baseline's plain decoding 0.9 ms a token against llama.cpp f32's 0.85 (its own counter" in page
    assert "drive-tiny at 2 thread(s): LiteVLM **3.0x** llama.cpp f32, the baseline **1.5x**" in page
    assert "prompt-lookup drafting, `chat + lookup 10`) 300.0 ms against 370.0 without, LiteVLM **5.0x** the" in page
    glance = report.glance({"peers": run_file("peers", result, "python benchmarks/peers.py")})
    assert any("LiteVLM **6.0x** llama.cpp f32 and **4.0x** llama.cpp Q8_0 on drive-hd" in line for line in glance)


def test_the_scale_out_table_shows_one_and_two_replicas_side_by_side(tmp_path, report):
    def replicas(answered, rps, p50, p99, t50, t99):
        return {
            "statuses": {"200": answered},
            "answered": answered,
            "five_xx": 0,
            "mismatches_vs_one_at_a_time": 0,
            "wall_s": 20.0,
            "throughput_rps": rps,
            "latency_ms": {"p50": p50, "p99": p99},
            "ttft_ms": {"p50": t50, "p99": t99},
        }

    result = {
        "requests_per_round": 64,
        "rounds": 2,
        "clients": 8,
        "threads_per_replica": 1,
        "host": "x86_64 2 cpus",
        "load_average": {"before": 0.4, "after": 2.1},
        "replicas": {
            "2": replicas(128, 9.1, 800.2, 1500.0, 780.5, 1490.1),
            "1": replicas(128, 5.2, 1500.3, 2100.9, 1480.0, 2090.2),
        },
        "throughput_ratio": 1.75,
    }
    command = "python benchmarks/serve_replicas.py --requests 64"
    page = write(tmp_path, report, {**FIXTURES, "serve_replicas": run_file("serve_replicas", result, command)})
    assert "## Scale-out" in page and "Two replicas: **1.75x** the answers/s of one." in page
    one = "1 replica(s): 128 answered, 0 5xx, 0 mismatches, 5.2 answers/s, p50 1500.3 ms, first token p50 1480.0 ms"
    two = "2 replica(s): 128 answered, 0 5xx, 0 mismatches, 9.1 answers/s, p50 800.2 ms, first token p50 780.5 ms"
    assert f"{one}; {two}; p99s in benchmarks/results/serve_replicas.json." in page
    assert "load average was 0.4 before the run and 2.1 after" in page and f"Command: `{command}`" in page
    (tmp_path / "none").mkdir()
    assert "**Not measured:** no results file for Ray Serve replicas" in write(tmp_path / "none", report, FIXTURES)


def test_the_torchrun_scale_out_table(tmp_path, report):
    result = {
        "questions": 100,
        "rounds": 2,
        "config": "litevlm",
        "threads_per_rank": 1,
        "host": "x86_64 2 cpus",
        "load_average": {"before": 0.3, "after": 1.9},
        "ranks": {
            "2": {
                "wall_s": [20.5, 21.0],
                "questions_per_s_best": 4.878,
                "questions_per_s_median": 4.819,
                "final": [0.5432],
            },
            "1": {
                "wall_s": [35.1, 36.0],
                "questions_per_s_best": 2.849,
                "questions_per_s_median": 2.813,
                "final": [0.5432],
            },
        },
        "speedup_best": 1.712,
        "same_final": True,
    }
    command = "python benchmarks/dist_eval.py --n 100"
    page = write(tmp_path, report, {**FIXTURES, "dist_eval": run_file("dist_eval", result, command)})
    assert "## Scale-out: `litevlm eval` under torchrun" in page
    assert "Two ranks: **1.712x** the questions/s of one; the same final score: yes." in page
    assert (
        "1 rank(s): 2.849 questions/s at best, wall 35.1, 36.0 s a round, final 0.5432; 2 rank(s): 4.878 questions/s"
        " at best, wall 20.5, 21.0 s a round, final 0.5432." in page
    )
    assert f"Command: `{command}`" in page
    (tmp_path / "none").mkdir()
    assert "**Not measured:** no results file for torchrun evaluation" in write(tmp_path / "none", report, FIXTURES)


def test_the_readme_scale_block_is_written_from_both_runs(tmp_path, report):
    readme = tmp_path / "README.md"
    readme.write_text(
        f"top\n{report.GLANCE[0]}\nold\n{report.GLANCE[1]}\nmid\n{report.SCALE[0]}\nstale\n{report.SCALE[1]}\nend\n"
    )
    runs = {
        "dist_eval": {
            "result": {
                "config": "litevlm",
                "questions": 300,
                "speedup_best": 1.732,
                "same_final": True,
                "ranks": {"1": {"questions_per_s_best": 10.4}, "2": {"questions_per_s_best": 18.0}},
            }
        },
        "serve_replicas": {
            "result": {
                "throughput_ratio": 1.495,
                "replicas": {
                    "1": {"throughput_rps": 4.41, "latency_ms": {"p50": 1788.1}},
                    "2": {"throughput_rps": 6.59, "latency_ms": {"p50": 1167.2}},
                },
            }
        },
    }
    assert report.update_readme(readme, runs)
    text = readme.read_text()
    assert "stale" not in text and text.startswith("top\n") and text.endswith("end\n") and "\nmid\n" in text
    assert "10.4 questions/s in one process, 18.0 on two ranks (**1.732x**), the same final score" in text
    assert "4.41 answers/s from one replica, 6.59 from two (**1.495x**; p50 latency 1788.1 and 1167.2 ms)" in text


# ------------------------------------------------------------------------------------------------
# drive-hd's Table 1 and the pruning benchmark's sections
# ------------------------------------------------------------------------------------------------
HD_COMMAND = "litevlm bench --model drive-hd --data .bench-data/heldout --json"


def hd_runs() -> dict:
    one = bench(1, 3.41) | {"model": "drive-hd"}
    default = bench(2, 3.05) | {"model": "drive-hd"}
    plot = " --plot benchmarks/results/bench_hd_1thread.png"
    return {
        "bench_hd_1thread": run_file(
            "bench_hd_1thread", one, f"OMP_NUM_THREADS=1 taskset -c 1 {HD_COMMAND}{plot} --n 100"
        ),
        "bench_hd_default_threads": run_file("bench_hd_default_threads", default, f"{HD_COMMAND} --n 100", threads=2),
    }


def scores(final: float, closed: float, kept: float) -> dict:
    return {"final": final, "closed_accuracy": closed, "accuracy": closed, "language": 0.5, "match": None} | {
        "visual_tokens": kept,
        "changed": 0.25,
    }


def timing(select: float, prefill: float) -> dict:
    return {"select_tokens_ms": select, "prefill_ms": prefill, "total_ms": round(select + prefill, 3)}


def pruning_result(model: str, with_selector: bool) -> dict:
    """A small run of benchmarks/token_pruning.py (its last JSON line), r = 0.1, 0.2 and 0.5."""
    finals = {  # method -> final at r = 0.1, 0.2, 0.5
        "token-selector": (0.5011, 0.5301, 0.5402),
        "fastv-k2": (0.4702, 0.5105, 0.5398),
        "dart": (0.5123, 0.5201, 0.5388),
        "divprune": (0.5077, 0.5007, 0.5301),
        "divprune-per-view": (0.4977, 0.4907, 0.5311),
    }
    if not with_selector:
        del finals["token-selector"]
    kept = (12.8, 25.6, 64.0)
    ratios = [0.1, 0.2, 0.5]
    methods = list(finals)
    labels = {"token-selector": "TokenSelector", "fastv-k2": "FastV K=2", "dart": "DART", "divprune": "DivPrune"}
    labels["divprune-per-view"] = "DivPrune per view"
    return {
        "benchmark": "token_pruning",
        "schema": 2,
        "model": model,
        "data": ".bench-data/heldout",
        "n": 40,
        "n_closed": 22,
        "views": "needed",
        "ratios": ratios,
        "methods": methods,
        "labels": {m: labels[m] for m in [*methods, *([] if with_selector else ["token-selector"])]},
        "absent": {} if with_selector else {"token-selector": f"{model} has no token_selector/ folder"},
        "per_view": True,
        "fastv_ranks_by": "layer K-1",
        "selection_timed_as": "select_tokens",
        "max_new_tokens": 160,
        "scoring": "DriveLM final without a judge (other weights renormalised), no graph gate",
        "visual_tokens": 128.0,
        "visual_share": 0.8912,
        "unpruned": scores(0.5433, 0.8636, 128.0),
        "scores": {
            f"{m}@{r}": scores(v, 0.8182 + i / 100, k)
            for m, vals in finals.items()
            for i, (r, v, k) in enumerate(zip(ratios, vals, kept))
        },
        "timing": {"prompts": 10, "repeats": 3, "backend": "native"},
        "timing_ms": {
            "unpruned": timing(0.017, 41.25),
            **{
                f"{m}@{r}": timing(0.5 + j, 10.0 + 10 * i + j)
                for j, m in enumerate(methods)
                for i, r in enumerate(ratios)
            },
        },
        "machine": {"platform": "Linux-test-x86_64", "processor": "x86_64", "threads": 1, "torch": "2.0.0+cpu"}
        | {"device": "cpu"},
        "commit": "0123456789abcdef0123456789abcdef01234567",
        "date": "2030-01-02 03:04 UTC",
        "plot": f"benchmarks/results/token_pruning_{model}.png",
    }


def pruning_run(model: str, with_selector: bool = True) -> dict:
    command = f"OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/token_pruning.py --model {model} --n 40"
    return run_file(f"token_pruning_{model}", pruning_result(model, with_selector), command)


def with_questions(res: dict, noisy: tuple[str, ...] = (), drops: dict | None = None) -> dict:
    """The run's per-question lists as benchmarks/token_pruning.py stores them (schema 3), 40 questions in 10 frames
    of 4, the first 22 closed, made so that each list's mean is the run's figure: every method shares the same
    question-to-question spread, so its difference from another is a constant shift (a zero-width interval), except
    for the `noisy` methods, whose frames also swing by +-0.2 (an interval wide enough to hold any small difference).
    Closed answers are the same for every method (a zero difference); `drops` gives a method's mean fidelity drop
    (0.05 by default)."""
    n, frames = 40, [f"scene_{i // 4}" for i in range(40)]
    spread = [0.1 * ((i % 7) - 3) / 3 for i in range(n)]
    centre = sum(spread) / n
    swing = [0.2 if (i // 4) % 2 else -0.2 for i in range(n)]  # five frames up, five down: mean 0
    correct = [int(i % 5 != 0) if i < 22 else None for i in range(n)]
    drops = drops or {}

    def lists(key: str, final: float) -> dict:
        m = key.rsplit("@", 1)[0]
        noise = swing if m in noisy else [0.0] * n
        out = {"final": [final + e - centre + z for e, z in zip(spread, noise)], "correct": correct}
        if key != "unpruned":
            drop = drops.get(m, 0.05)
            out |= {"same": [int(i % 3 != 0) for i in range(n)], "drop": [drop + e - centre for e in spread]}
        return out

    res["questions"] = {"id": [f"q{i}" for i in range(n)], "frame": frames, "closed": [int(i < 22) for i in range(n)]}
    res["per_question"] = {"unpruned": lists("unpruned", res["unpruned"]["final"])}
    res["unpruned"] |= {"final_se": 0.0213, "closed_se": 0.0731, "loglik": -0.1234}
    for key, sc in res["scores"].items():
        res["per_question"][key] = lists(key, sc["final"])
        drop = drops.get(key.rsplit("@", 1)[0], 0.05)
        sc |= {"final_se": 0.0211, "closed_se": 0.0702}
        sc["fidelity"] = {"same_answer": 0.65, "drop": drop, "low": drop - 0.01, "high": drop + 0.01, "se": 0.005}
    return res


def test_drive_hd_table1_comes_first_and_the_glance_names_both_models(tmp_path, report):
    readme = tmp_path / "README.md"
    readme.write_text(f"{report.GLANCE[0]}\nold\n{report.GLANCE[1]}\n")
    page = write(tmp_path, report, {**FIXTURES, **hd_runs()})
    hd, tiny = (page.index(f"## Table 1: every configuration on {m}, side by side") for m in ("drive-hd", "drive-tiny"))
    assert hd < tiny < page.index("## EAGLE-2")
    assert page.index("## Table 1") == hd  # drive-hd's tables are the first on the page
    frames, preprocess = page.index("## One frame, several questions"), page.index("## Reading and cutting a view")
    assert hd < frames < preprocess < tiny  # the frame rows and preprocessing next to drive-hd's Table 1
    peers = page.index("## Beside llama.cpp")
    assert hd < peers < frames  # litevlm beside llama.cpp right after drive-hd's Table 1
    hd_part = page[hd:peers]
    for name in ("bench_hd_1thread", "bench_hd_default_threads"):
        run = hd_runs()[name]
        for r in run["result"]["rows"][:2]:
            assert row(report, [r[c] for c in report.BENCH_COLUMNS]) in hd_part
        assert f"Command: `{run['command']}`" in hd_part
    assert "LiteVLM: **3.41x** by the paper's measure, **2.73x** from images to answer" in hd_part
    assert "LiteVLM: **3.05x** by the paper's measure, **2.44x** from images to answer" in hd_part
    assert "![Table 1 stages on drive-hd](benchmarks/results/bench_hd_1thread.png)" in hd_part
    assert "Its baseline prompts hold 96.0 visual tokens of 83.7" in hd_part  # from the run's own baseline row
    assert "Not measured" not in hd_part
    hd_glance = (
        "LiteVLM **2.73x** the baseline on drive-hd from images to answer (e2e), **3.41x** by the paper's measure"
    )
    assert f"{hd_glance} (stages only), at one pinned thread" in page
    assert "**2.72x** by the paper's measure (stages only), at one pinned thread" in page
    assert "LiteVLM **2.18x** the baseline on drive-tiny from images to answer (e2e)" in page
    figures = [line for line in readme.read_text().splitlines() if line.startswith("- ")]
    assert (
        len(figures) == 5 and "drive-hd" in figures[0] and "drive-hd" in figures[1] and all(f in page for f in figures)
    )


def test_drive_hd_not_measured_yet_shows_its_commands_and_no_figures(tmp_path, report):
    page = write(tmp_path, report, FIXTURES)
    hd = page[
        page.index("## Table 1: every configuration on drive-hd") : page.index(
            "## Table 1: every configuration on drive-tiny"
        )
    ]
    assert "**Not measured yet:** no results file for `litevlm bench` on drive-hd at one pinned thread." in hd
    assert "`python benchmarks/report.py --run --only bench_hd_1thread` runs" in hd
    assert f"`OMP_NUM_THREADS=1 taskset -c 1 {HD_COMMAND} --plot benchmarks/results/bench_hd_1thread.png --n 100`" in hd
    assert f"`{HD_COMMAND} --n 100`" in hd  # the default threads: not pinned
    assert "| baseline |" not in hd and "x** the baseline" not in hd  # nothing invented
    assert "on drive-hd" not in page.split("## Table 1")[0]  # nor a glance figure
    pruning = page[page.index("## Token pruning on drive-hd") :]
    assert "**Not measured yet:** no results file for token pruning on drive-hd." in pruning
    assert "python benchmarks/token_pruning.py --model drive-hd --data .bench-data/heldout" in pruning


def test_the_pruning_section_shows_every_method_and_says_which_is_best(tmp_path, report):
    runs = {**FIXTURES, "token_pruning_drive-hd": pruning_run("drive-hd")}
    page = write(tmp_path, report, runs)
    sec = page[page.index("## Token pruning on drive-hd: ") : page.index("## Token pruning on drive-hd, the race")]
    assert "40 questions (22 closed) over the views each needs" in sec and "(89% of its tokens)" in sec
    assert "Unpruned: final **0.5433** (0.8636)." in sec
    assert "| method | r=0.1 | r=0.2 | r=0.5 |" in sec
    assert "| visual tokens kept | 12.8 | 25.6 | 64.0 |" in sec
    assert "| TokenSelector | 0.5011 (0.8182) | 0.5301 (0.8282) | 0.5402 (0.8382) |" in sec
    assert "| DivPrune per view | 0.4977 (0.8182) | 0.4907 (0.8282) | 0.5311 (0.8382) |" in sec
    # One sentence for each r <= 0.3, none for 0.5; a run without per-question scores leaves every difference not
    # decided, however large, and claims no lead.
    assert (
        "- At r=0.1 (12.8 visual tokens kept), the TokenSelector scores 0.5011; the best training-free method, DART,"
        " 0.5123 (+0.0112): not decided (no per-question scores in this run, so no interval)." in sec
    )
    assert (
        "- At r=0.2 (25.6 visual tokens kept), the TokenSelector scores 0.5301; the best training-free method, DART,"
        " 0.5201 (-0.0100): not decided" in sec
    )
    assert "At r=0.5" not in sec
    assert "With 22 closed questions, a closed accuracy near 0.8636 has a standard error of about 0.073." in sec
    assert "This run stored no per-question scores: its differences have no interval and are not decided." in sec
    for claim in ("beats", "leads", "wins", "scores best", "ahead"):
        assert claim not in sec
    # Timing: the unpruned prefill, then one table of prefill + the method's own select_tokens ms at each r.
    assert "Unpruned prefill: **41.25 ms**" in sec and "first 10 prompts (3 repeats" in sec
    assert "each cell is the prefill ms + the method's own select_tokens ms" in sec
    assert "| TokenSelector | 10.0 + 0.5 | 20.0 + 0.5 | 30.0 + 0.5 |" in sec
    assert "| DART | 12.0 + 2.5 | 22.0 + 2.5 | 32.0 + 2.5 |" in sec
    assert "![token pruning on drive-hd](benchmarks/results/token_pruning_drive-hd.png)" in sec
    assert "Command: `OMP_NUM_THREADS=1 taskset -c 1 python benchmarks/token_pruning.py --model drive-hd" in sec
    assert "Commit abc1234, 2030-01-02 03:04 UTC, Test CPU 9000, 1 thread(s), 12.5 s." in sec


def test_the_pruning_section_on_a_model_without_a_token_selector(tmp_path, report):
    runs = {**FIXTURES, "token_pruning_drive-hd": pruning_run("drive-hd", with_selector=False)}
    page = write(tmp_path, report, runs)
    hd = page[page.index("## Token pruning on drive-hd") : page.index("## Token pruning on drive-hd, the race")]
    assert "| TokenSelector | absent | absent | absent |" in hd
    assert "TokenSelector: absent, drive-hd has no token_selector/ folder" in hd
    assert (
        "- At r=0.1 (12.8 visual tokens kept), the highest final is DART's, 0.5123 (closed accuracy 0.8182). No"
        " TokenSelector was measured (drive-hd has no token_selector/ folder)." in hd
    )
    assert "beats" not in hd and "ahead" not in hd


def test_each_difference_is_paired_with_its_interval_and_level_where_it_holds_zero(tmp_path, report):
    """With per-question scores, each r's sentence gives the TokenSelector's final and the best training-free
    method's with their standard errors, their paired difference with its 95% interval over frames, and "level"
    where the interval holds zero, never a lead; the others grouped by where they stand; the closed questions and the
    fidelity of the same pair. The table carries the fidelity beside each r's score."""
    res = with_questions(pruning_result("drive-hd", with_selector=True), noisy=("dart",), drops={"dart": 0.08})
    res["scores"]["dart@0.1"]["vs_selector"] = {"selector_only": 1, "method_only": 4, "p": 0.375}
    line = report.pruning_verdict(res, 0.1)
    assert line.startswith(
        "- At r=0.1 (12.8 visual tokens kept), the TokenSelector scores 0.5011 ± 0.0211; the best training-free"
        " method, DART, 0.5123 ± 0.0211; DART less the TokenSelector +0.0112 ["
    )
    assert "], level. The other training-free methods against the TokenSelector:" in line
    assert "ahead of it: DivPrune; behind it: FastV K=2 and DivPrune per view." in line
    assert (
        " Closed accuracy, DART less the TokenSelector: +0.0000 [+0.0000, +0.0000], level; on the closed questions"
        " where the two differ, only the TokenSelector is right on 1 and only DART on 4 (sign test p = 0.375)." in line
    )
    assert (
        " Fidelity (the unpruned answer's log-likelihood drop per token; answers the same): the TokenSelector 0.050"
        " (65%), DART 0.080 (65%); DART less the TokenSelector +0.030 [+0.030, +0.030], the TokenSelector ahead."
    ) in line
    p = report.paired(res, "dart", "token-selector", 0.1)
    assert p.low < 0 < p.high and p.diff == pytest.approx(0.0112) and p.frames == 10 and p.n == 40
    # a constant shift (no swing): the difference is exact and its interval has no width
    line = report.pruning_verdict(res, 0.2)
    assert "the best training-free method, DART, 0.5201 ± 0.0211; DART less the TokenSelector -0.0100 [" in line
    exact = report.paired(res, "divprune", "token-selector", 0.2)
    assert exact.diff == pytest.approx(-0.0294) and exact.high - exact.low == pytest.approx(0, abs=1e-12)
    assert not exact.level and exact.verdict("DivPrune", "the TokenSelector") == "the TokenSelector"
    for claim in ("beats", "leads", "wins", "scores best"):
        assert claim not in line
    page = write(tmp_path, report, {**FIXTURES, "token_pruning_drive-hd": run_file("token_pruning_drive-hd", res, "x")})
    sec = page[page.index("## Token pruning on drive-hd: ") : page.index("## Token pruning on drive-hd, the race")]
    assert (
        "Standard errors over frames (a frame's questions taken together): unpruned final ± 0.0213, closed accuracy"
        " ± 0.0731. Each difference below is paired over the same questions, with its 95% interval from resampling"
        ' the frames; "level" where the interval holds zero.' in sec
    )
    assert "| method | r=0.1 | r=0.1 fidelity | r=0.2 | r=0.2 fidelity | r=0.5 | r=0.5 fidelity |" in sec
    assert "| visual tokens kept | 12.8 |  | 25.6 |  | 64.0 |  |" in sec
    assert "| DART | 0.5123 (0.8182) | 0.080 (65%) | 0.5201 (0.8282) | 0.080 (65%) |" in sec
    assert "the mean drop in the unpruned answer's log-likelihood per token under the pruned prompt" in sec
    assert "| TokenSelector | 10.0 + 0.5 | 20.0 + 0.5 | 30.0 + 0.5 |" in sec  # the timing table keeps its columns
    for claim in ("beats", "leads", "wins", "scores best"):
        assert claim not in sec


def test_the_selectors_variant_inside_the_decoder_is_weighed_against_the_training_free_methods(tmp_path, report):
    """TokenSelector K=2 is the TokenSelector's own (trained) choice: never counted among the training-free methods
    that beat it; its own sentence says whether it is ahead of the best of them, and the page says what it is."""
    res = pruning_result("drive-hd", with_selector=True)
    res["methods"].insert(1, "token-selector-k2")
    res["labels"]["token-selector-k2"] = "TokenSelector K=2"
    for r, v in ((0.1, 0.5201), (0.2, 0.5102), (0.5, 0.5)):
        res["scores"][f"token-selector-k2@{r}"] = scores(v, 0.82, 1.0)
        res["timing_ms"][f"token-selector-k2@{r}"] = timing(0.5, 12.0)
    line = report.pruning_verdict(res, 0.1)
    assert "the best training-free method, DART, 0.5123 (+0.0112)" in line  # TokenSelector K=2 is not training-free
    assert line.endswith(" TokenSelector K=2 scores 0.5201 (+0.0078 on DART: not decided).")
    assert report.pruning_verdict(res, 0.2).endswith(" TokenSelector K=2 scores 0.5102 (-0.0099 on DART: not decided).")
    # with per-question scores: its paired difference from the best training-free method, and who is ahead
    assert report.pruning_verdict(with_questions(copy.deepcopy(res)), 0.1).endswith(
        " TokenSelector K=2 scores 0.5201 ± 0.0211; less DART +0.0078 [+0.0078, +0.0078], TokenSelector K=2 ahead."
    )
    runs = {**FIXTURES, "token_pruning_drive-hd": run_file("token_pruning_drive-hd", res, "python x.py")}
    page = write(tmp_path, report, runs)
    hd = page[page.index("## Token pruning on drive-hd") : page.index("## Token pruning on drive-hd, the race")]
    assert "| TokenSelector K=2 | 0.5201 (0.82) | 0.5102 (0.82) | 0.5 (0.82) |" in hd
    assert "TokenSelector K=2: the TokenSelector's own choice, made from the prompt before the decoder, applied" in hd
    assert "`--prune token-selector --keep R --prune-layer 2`" in hd


def test_the_run_list_measures_drive_hd(report):
    known = {b.name: b for b in report.benchmarks()}
    for name in ("bench_hd_1thread", "bench_hd_default_threads", "token_pruning_drive-hd"):
        assert name in known
    for past in ("token_pruning_drive-tiny", "compile_vs_native", "before_after"):  # pointed to, no longer run
        assert past not in known
    assert known["bench_hd_1thread"].pinned and not known["bench_hd_default_threads"].pinned
    for name in ("bench_hd_1thread", "bench_hd_default_threads"):
        hd, tiny = known[name].command(None), known[name.replace("_hd", "")].command(None)
        assert hd[:2] == tiny[:2] == ["litevlm", "bench"] and hd[2:4] == ["--model", "drive-hd"]
        assert [a for a in hd[4:] if "bench_hd_1thread" not in a] == [a for a in tiny[2:] if "bench_1thread" not in a]
    prune = known["token_pruning_drive-hd"].command(None)
    assert prune[:2] == ["python", "benchmarks/token_pruning.py"] and prune[prune.index("--model") + 1] == "drive-hd"
    assert "benchmarks/results/token_pruning_drive-hd.png" in prune
    assert "token_pruning" not in known  # the earlier run is read, no longer made


def test_the_pruning_verdict_pairs_the_strongest_pruner_with_the_selector(tmp_path, report):
    run = pruning_run("drive-hd")["result"]
    run["scores"]["dart@0.1"]["vs_selector"] = {"selector_only": 1, "method_only": 4, "p": 0.375}
    line = report.pruning_verdict(run, 0.1)
    assert line.endswith(
        " On the closed questions where the two differ, only the TokenSelector is right on 1 and only DART on 4"
        " (sign test p = 0.375)."
    )
    assert "sign test" not in report.pruning_verdict(run, 0.2)  # a run without the pairing says nothing of it


def test_the_bf16_rows_are_read_against_both_baselines(report):
    """Where the CPU multiplies bf16 natively the table holds `baseline bf16` and `litevlm bf16`: the page gives
    LiteVLM bf16 over the fp32 baseline (precision and techniques) and over the bf16 baseline (the techniques)."""
    rows = [
        bench_row("baseline", 100.0, 1.0, 0.5),
        bench_row("litevlm", 40.0, 2.5, 0.51),
        bench_row("baseline bf16", 80.0, 1.25, 0.5),
        bench_row("litevlm bf16", 25.0, 4.0, 0.512),
    ]
    line = report.bf16_line({"rows": rows})
    assert "4.00x the fp32 baseline" in line and "3.20x the bf16 baseline" in line
    assert "scores 0.512 (+0.0120 on the fp32 baseline)" in line
    assert report.bf16_line({"rows": rows[:2]}) is None  # a CPU without native bf16 runs no bf16 rows


def test_drive_hd_over_all_six_views_has_its_own_pruning_page(tmp_path, report):
    """A second drive-hd run with every view in the prompt: its own page after the needed-views one, saying what the
    setting is; the run list measures it with `--views all`; before a run, its command and no figures."""
    known = {b.name: b for b in report.benchmarks()}
    command = known["token_pruning_drive-hd-all-views"].command(None)
    assert command[command.index("--views") + 1] == "all" and command[command.index("--model") + 1] == "drive-hd"
    assert "benchmarks/results/token_pruning_drive-hd-all-views.png" in command
    heading = "## Token pruning on drive-hd over all six views"
    page = write(tmp_path / "before", report, FIXTURES)
    empty = page[page.index(heading) : page.index("## ViewSelector")]
    assert "**Not measured yet:** no results file for token pruning on drive-hd over all six views." in empty
    assert "--views all" in empty and "| TokenSelector |" not in empty
    res = pruning_result("drive-hd", with_selector=True)
    res["views"], res["plot"] = "all", "benchmarks/results/token_pruning_drive-hd-all-views.png"
    name = "token_pruning_drive-hd-all-views"
    runs = {**FIXTURES, "token_pruning_drive-hd": pruning_run("drive-hd"), name: run_file(name, res, "python x.py")}
    page = write(tmp_path / "after", report, runs)
    needed = page.index("## Token pruning on drive-hd: ")
    assert needed < page.index(heading) < page.index("## ViewSelector")
    sec = page[page.index(heading) : page.index("## ViewSelector")]
    assert "Every camera's view goes into each prompt, as when the ViewSelector is off" in sec
    assert "40 questions (22 closed) over all six views" in sec
    assert "| TokenSelector | 0.5011 (0.8182) | 0.5301 (0.8282) | 0.5402 (0.8382) |" in sec
    assert f"![token pruning on drive-hd over all six views]({res['plot']})" in sec
    assert "Every camera's view goes into" not in page[needed : page.index(heading)]


def test_drive_hd_on_every_held_out_question_has_its_own_pruning_page(tmp_path, report):
    """The strong methods on all 1688 held-out questions, untimed, without the per-camera variants: a page of its own
    right after the 600-question one, saying what it is."""
    command = {b.name: b for b in report.benchmarks()}["token_pruning_drive-hd-all-questions"].command(None)
    assert command[command.index("--n") + 1] == "1688" and command[command.index("--timing-n") + 1] == "0"
    methods = command[command.index("--methods") + 1].split(",")
    # the selector, its choice applied before layer 2 (where the training-free cutters prune), and the strongest
    assert methods == ["token-selector", "token-selector-k2", "fastv-k2", "dart", "divprune", "cdpruner"]
    assert "--per-view" not in command and "--views" not in command
    assert command[command.index("--r") + 1] == "0.05,0.1,0.2,0.3"
    res = pruning_result("drive-hd", with_selector=True)
    res["n"], res["timing_ms"] = 1688, {}
    name = "token_pruning_drive-hd-all-questions"
    runs = {**FIXTURES, "token_pruning_drive-hd": pruning_run("drive-hd"), name: run_file(name, res, "python x.py")}
    page = write(tmp_path, report, runs)
    heading = "## Token pruning on drive-hd, the race on more questions"
    assert page.index("## Token pruning on drive-hd: ") < page.index(heading) < page.index("over all six views")
    sec = page[page.index(heading) : page.index("## Token pruning on drive-hd over all six views")]
    assert "The race decided: the shipped TokenSelector against the four strongest training-free methods" in sec
    assert "1688 questions (22 closed) over the views each needs" in sec and "Timing, side by side" not in sec
    assert "- At r=0.1 (12.8 visual tokens kept), the TokenSelector scores 0.5011; the best training-free" in sec


def test_fastvs_choice_before_the_decoder_is_a_diagnostic_not_a_pruner_that_beats_the_selector(tmp_path, report):
    """fastv-k2-k0 scores above the TokenSelector here, yet it is no training-free pruner a user would run instead:
    the page names it beside FastV K=2 itself and never says it beats the selector."""
    res = pruning_result("drive-hd", with_selector=True)
    res["n"], res["timing_ms"] = 1688, {}
    res["methods"].append("fastv-k2-k0")
    res["labels"]["fastv-k2-k0"] = "FastV K=2's choice before the decoder"
    for r, v in zip(res["ratios"], (0.5999, 0.5998, 0.5997)):
        res["scores"][f"fastv-k2-k0@{r}"] = scores(v, 0.9, 1.0)
    name = "token_pruning_drive-hd-all-questions"
    runs = {**FIXTURES, "token_pruning_drive-hd": pruning_run("drive-hd"), name: run_file(name, res, "python x.py")}
    page = write(tmp_path, report, runs)
    heading = "## Token pruning on drive-hd, the race on more questions"
    sec = page[page.index(heading) : page.index("## Token pruning on drive-hd over all six views")]
    assert "is a diagnostic, not a pruner to run" in sec
    assert "| FastV K=2's choice before the decoder | 0.5999" in sec
    line = next(x for x in sec.splitlines() if x.startswith("- At r=0.2"))
    assert "the best training-free method, DART, 0.5201" in line  # the diagnostic is not a pruner to run
    assert line.endswith(
        "FastV K=2's choice before the decoder scores 0.5998 (FastV K=2, pruning before layer 2: 0.5105)."
    )
    with_questions(res)
    assert report.pruning_verdict(res, 0.2).endswith(
        "FastV K=2's choice before the decoder scores 0.5998 ± 0.0211 (FastV K=2, pruning before layer 2: 0.5105;"
        " the difference +0.0893 [+0.0893, +0.0893], FastV K=2's choice before the decoder ahead)."
    )


# ------------------------------------------------------------------------------------------------
# Both measures, frame rows, preprocessing, and the page's length
# ------------------------------------------------------------------------------------------------
FRAMES_COMMAND = (
    "litevlm bench --model drive-hd --data .bench-data/heldout --json --questions-per-frame 6 --configs"
    " baseline,litevlm --no-transformers --n 96"
)


def frame_row(config: str, mode: str, e2e: float, ratio: float, equal: bool = True) -> dict:
    k = 1 if mode == "strangers" else 6
    return (
        {"config": config, "mode": mode, "questions_per_frame": k, "e2e_ms": e2e, "p50_e2e_ms": e2e - 1.0}
        | {"p90_e2e_ms": e2e + 9.0, "preprocess_ms": 20.5 / k, "vit_ms": 11.25 / k, "total_ms": e2e - 20.5 / k}
        | {"views_encoded_per_question": 2.5 / k, "views_reused_per_question": 2.5 - 2.5 / k}
        | {"e2e_vs_strangers": ratio, "answers_equal": equal}
        | {"score": 0.5426, "closed_accuracy": 0.8742}
    )


def frames_result(threads: int = 1, equal: bool = True) -> dict:
    rows = [
        frame_row("baseline", "strangers", 180.5, 1.0),
        frame_row("baseline", "frame", 120.25, 0.666),
        frame_row("litevlm", "strangers", 52.0, 1.0),
        frame_row("litevlm", "frame", 30.5, 0.587, equal),
    ]
    head = {"model": "drive-hd", "threads": threads, "questions": 96, "questions_per_frame": 6, "frames": 16}
    return head | {"frame_rows": rows, "rows": []}


def preprocess_result(score: bool = True) -> dict:
    cases = [
        {"name": "front camera", "source": "JPEG 1600x900", "tiles": "2 x 448", "today_ms": 14.25, "new_ms": 4.5}
        | {"speedup": 3.17, "max_pixel_diff": 3, "mean_pixel_diff": 0.41},
        {"name": "raw frame", "source": "array 1600x900", "tiles": "2 x 448", "today_ms": 9.75, "new_ms": 1.25}
        | {"speedup": 7.8, "max_pixel_diff": 2, "mean_pixel_diff": 0.37},
    ]
    sc = {"litevlm_fast": 0.5426, "litevlm_pil": 0.5431, "litevlm_diff": -0.0005, "questions": 600, "model": "drive-hd"}
    sc |= {"baseline_fast": 0.5179, "baseline_pil": 0.5179, "baseline_diff": 0.0}
    return {"cases": cases, **({"score": sc} if score else {})}


def test_table1_shows_both_measures_and_an_old_run_without_e2e_as_na(tmp_path, report):
    """A row carries the paper's measure (the stages) and images to answer (e2e) side by side; a run from before e2e
    shows n/a there, in the table, the statement and the glance, and invents nothing."""
    header = next(line for line in table_lines(report, FIXTURES) if line.startswith("| config | views"))
    for col in ("total_ms (stages, the paper's measure)", "speedup", "preprocess_ms", "e2e_ms (images to answer)"):
        assert f"| {col} |" in header
    for col in ("p50_e2e_ms", "p90_e2e_ms", "e2e_speedup"):
        assert f"| {col} |" in header
    old = bench(1, 2.72)
    for r in old["rows"]:
        for key in ("e2e_ms", "p50_e2e_ms", "p90_e2e_ms", "e2e_speedup", "preprocess_share"):
            del r[key]
    runs = {**FIXTURES, "bench_1thread": {**FIXTURES["bench_1thread"], "result": old}}
    page = write(tmp_path, report, runs)
    lite = old["rows"][1]
    assert row(report, [lite.get(c) for c in report.BENCH_COLUMNS]) in page
    assert "| 2.72 | 3.1 | n/a | n/a | n/a | n/a | 0.5355 |" in page  # speedup, preprocess, then e2e's four n/a
    assert "LiteVLM: **2.72x** by the paper's measure, n/a from images to answer (100 questions" in page
    assert "**2.72x** the baseline by the paper's measure (stages only), at one pinned thread" in page
    assert "from images to answer (e2e): not in this run" in page


def table_lines(report, runs) -> list[str]:
    return report.render(runs).splitlines()


def test_the_frame_rows_are_a_table_with_litevlms_ratio_and_whether_the_answers_are_equal(tmp_path, report):
    known = {b.name: b for b in report.benchmarks()}
    one, free = known["bench_hd_frames"], known["bench_hd_frames_default_threads"]
    assert " ".join(one.command(None)) == " ".join(free.command(None)) == FRAMES_COMMAND
    assert one.pinned and not free.pinned
    page = write(tmp_path / "none", report, FIXTURES)  # not run: the commands, no figures
    sec = page[page.index("## One frame, several questions") : page.index("## Reading and cutting a view")]
    assert "**Not measured yet:** no results file for frame mode on drive-hd at one pinned thread." in sec
    assert f"`{FRAMES_COMMAND}`" in sec and "--only bench_hd_frames_default_threads" in sec and "| litevlm |" not in sec
    runs = {
        **FIXTURES,
        "bench_hd_frames": run_file("bench_hd_frames", frames_result(), f"OMP_NUM_THREADS=1 {FRAMES_COMMAND}"),
        "bench_hd_frames_default_threads": run_file(
            "bench_hd_frames_default_threads", frames_result(2, equal=False), FRAMES_COMMAND, threads=2
        ),
    }
    page = write(tmp_path / "both", report, runs)
    sec = page[page.index("## One frame, several questions") : page.index("## Reading and cutting a view")]
    for r in frames_result()["frame_rows"]:
        assert row(report, [r[c] for c in report.FRAME_COLUMNS]) in sec
    assert (
        "LiteVLM's mean e2e per question through a frame of 6 is **0.587** of its one-question-a-frame figure;"
        " answers equal: yes (96 questions in 16 frames, 1 thread(s))." in sec
    )
    assert "answers equal: no (96 questions in 16 frames, 2 thread(s))." in sec
    # the most a frame can save, from the strangers row: preprocessing and encoding shared, the rest per question:
    # (52 - 31.75 + 31.75 x (2.5 / 6) / 2.5) / 52 = 0.491
    assert "A frame shares only the views' reading and encoding: 61% of a stranger's e2e." in sec
    assert "the frame could reach **0.491** at best" in sec
    assert f"Command: `OMP_NUM_THREADS=1 {FRAMES_COMMAND}`" in sec and f"Command: `{FRAMES_COMMAND}`" in sec
    assert "Not measured" not in sec
    assert "asked as strangers" not in sec  # a run without the pairing says nothing of it
    paired = frames_result()
    zero = {"a": 0.55, "b": 0.55, "se_a": 0.02, "se_b": 0.02, "diff": 0.0, "low": 0.0, "high": 0.0}
    next(r for r in paired["frame_rows"] if (r["config"], r["mode"]) == ("litevlm", "frame"))["vs_strangers"] = {
        "final": zero | {"n": 96, "frames": 16}
    }
    runs["bench_hd_frames"] = run_file("bench_hd_frames", paired, f"OMP_NUM_THREADS=1 {FRAMES_COMMAND}")
    sec = write(tmp_path / "paired", report, runs)
    assert (
        "Its score against the same questions asked as strangers: paired difference +0.0000 [+0.0000, +0.0000]" in sec
    )


def test_a_frame_that_misses_the_goal_says_what_the_per_question_work_would_have_to_fall_to(report):
    """Shared work s (strangers) and l (frame), per-question work p: the frame reaches 0.6 only if
    (l + p) / (s + p) <= 0.6, i.e. p <= (0.6 s - l) / 0.4. A frame under the goal gets no such sentence."""
    res = frames_result()
    assert "To reach" not in report.frame_line(res)  # 0.491 at best: the goal is within reach
    rows = {(r["config"], r["mode"]): r for r in res["frame_rows"]}
    alone, frame, base = rows["litevlm", "strangers"], rows["litevlm", "frame"], rows["baseline", "frame"]
    alone |= {"preprocess_ms": 8.0, "vit_ms": 12.0, "e2e_ms": 100.0}  # s = 20, p = 80
    frame |= {"prefill_ms": 30.0, "select_ms": 4.0, "input_tokens": 120.0}  # l = 20 x (2.5 / 6) / 2.5 = 3.33
    base |= {"prefill_ms": 180.0, "input_tokens": 720.0}
    line = report.frame_line(res)
    # (0.6 x 20 - 3.33) / 0.4 = 21.7 ms, against 34 ms of selection and prefill, 250 us a prompt token
    assert "To reach 0.6, that per-question work would have to fall from 80.0 ms to 21.7 ms;" in line
    assert "its selection and prefill alone take 34.0 ms (the prefill 250 us a prompt token," in line
    assert "the baseline's 250 us with 6.0x the tokens" in line


def test_reading_and_cutting_a_view_has_its_table_and_the_score_with_both_resizes(tmp_path, report):
    b = {b.name: b for b in report.benchmarks()}["preprocess"]
    assert b.command(None)[:4] == ["python", "benchmarks/preprocess.py", "--threads", "1"] and b.pinned
    assert "--score-n" in b.command(None)
    page = write(tmp_path / "none", report, FIXTURES)
    sec = page[page.index("## Reading and cutting a view") : page.index("## Table 1: every configuration on drive-t")]
    assert "**Not measured yet:** no results file for preprocessing." in sec and "benchmarks/preprocess.py" in sec
    command = "OMP_NUM_THREADS=1 python benchmarks/preprocess.py --threads 1"
    page = write(
        tmp_path / "run", report, {**FIXTURES, "preprocess": run_file("preprocess", preprocess_result(), command)}
    )
    sec = page[page.index("## Reading and cutting a view") : page.index("## Table 1: every configuration on drive-t")]
    assert "| name | source | tiles | today_ms | new_ms | speedup | max_pixel_diff | mean_pixel_diff |" in sec
    assert "| front camera | JPEG 1600x900 | 2 x 448 | 14.25 | 4.5 | 3.17 | 3 | 0.41 |" in sec
    assert "| raw frame | array 1600x900 | 2 x 448 | 9.75 | 1.25 | 7.8 | 2 | 0.37 |" in sec
    assert (
        "DriveLM score on drive-hd, 600 held-out questions: litevlm 0.5426 with the new path, 0.5431 with PIL's" in sec
    )
    assert "(difference -0.0005, no interval in this run); baseline 0.5179 with the new path" in sec
    assert f"Command: `{command}`" in sec
    paired = preprocess_result()
    d = {"a": 0.5426, "b": 0.5431, "se_a": 0.02, "se_b": 0.02, "diff": -0.0005, "low": -0.004, "high": 0.003}
    paired["score"]["litevlm_paired"] = {"final": d | {"n": 600, "frames": 100}}
    page = write(tmp_path / "paired", report, {**FIXTURES, "preprocess": run_file("preprocess", paired, command)})
    assert (
        "0.5431 with PIL's (paired difference -0.0005 [-0.0040, +0.0030] (standard errors 0.0200 and 0.0200) over 600"
        " questions in 100 frames: level); baseline" in page
    )
    run = run_file("preprocess", preprocess_result(score=False), command)
    page = write(tmp_path / "unscored", report, {**FIXTURES, "preprocess": run})
    assert "| raw frame |" in page and "DriveLM score on" not in page


EXPLAINED = {"explain": "benchmarks/results/explain_hd.png", "explained": {"config": "litevlm", "question": "Any car?"}}


def test_the_explain_figure_is_on_the_page_with_its_question_and_command(tmp_path, report):
    page = write(tmp_path / "none", report, FIXTURES)
    assert "no results file for the explain figure" in page
    run = run_file("explain_hd", EXPLAINED, "litevlm demo --model drive-hd --litevlm-only --json")
    page = write(tmp_path / "run", report, {**FIXTURES, "explain_hd": run})
    sec = page[page.index("## What LiteVLM kept") :]
    assert 'LiteVLM\'s answer to "Any car?"' in sec and "![what LiteVLM kept](benchmarks/results/explain_hd.png)" in sec
    assert "Command: `litevlm demo --model drive-hd --litevlm-only --json`" in sec


def test_the_page_from_the_stored_results_fits_in_400_lines(report):
    """The stored JSON (benchmarks/results), with the new benchmarks' runs as they will come: a page read in
    minutes. The past comparisons are a line each at most, drive-tiny's pruning table gone."""
    runs = report.load(report.RESULTS)
    frames = frames_result()
    runs |= {
        "bench_hd_frames": run_file("bench_hd_frames", frames, FRAMES_COMMAND),
        "bench_hd_frames_default_threads": run_file("bench_hd_frames_default_threads", frames, FRAMES_COMMAND),
        "preprocess": run_file("preprocess", preprocess_result(), "python benchmarks/preprocess.py --threads 1"),
        "explain_hd": run_file("explain_hd", EXPLAINED, "litevlm demo --model drive-hd --litevlm-only --json"),
    }
    page = report.render(runs)
    assert len(page.splitlines()) <= 400
    # what each pruning method reads, said once, under the first pruning table's heading and before its table
    first = page.index("## Token pruning on drive-hd: ")
    assert page.count("**What each method sees.**") == 1 and first < page.index("**What each method sees.**")
    assert page.index("**What each method sees.**") < page.index("| method |", first)
    for gone in ("## torch.compile", "## Before and after", "## Token pruning on drive-tiny"):
        assert gone not in page
    assert "Not measured" not in page.split("## GPU")[0]  # every benchmark the page shows has its figures
    if "compile_vs_native" in runs:
        assert f"(benchmarks/results/compile_vs_native.json, commit {runs['compile_vs_native']['commit']})" in page


def test_the_neutral_decoders_race_beside_the_taught_one(tmp_path, report):
    """The every-question page carries the neutral decoder's run as more columns, with both decoders' verdicts and
    commands; the neutral 600-question page is its own section, said to be on the neutral decoder; the race section
    counts where the TokenSelector leads on each; a run from before FastV as published says so."""
    taught, neutral = pruning_result("drive-hd", True), pruning_result("drive-hd", True)
    before = {k: v for k, v in pruning_result("drive-hd", True).items() if k != "fastv_ranks_by"}
    neutral["scores"] = {k: v | {"final": round(v["final"] - 0.01, 4)} for k, v in neutral["scores"].items()}
    neutral["scores"]["divprune@0.1"]["final"] = 0.6  # a training-free method ahead of the selector there
    cmd = "python benchmarks/token_pruning.py --model drive-hd --n 40"
    ncmd = "python benchmarks/token_pruning.py --model .bench-data/drive-hd-neutral --n 40"
    runs = {
        **FIXTURES,
        "token_pruning_drive-hd-all-questions": run_file("token_pruning_drive-hd-all-questions", taught, cmd),
        "token_pruning_drive-hd-neutral-all-questions": run_file(
            "token_pruning_drive-hd-neutral-all-questions", neutral, ncmd
        ),
        "token_pruning_drive-hd-neutral": run_file("token_pruning_drive-hd-neutral", neutral, ncmd),
        "token_pruning_drive-hd": run_file("token_pruning_drive-hd", before, cmd),  # before
    }
    page = write(tmp_path, report, runs)
    every = page[page.index("## Token pruning on drive-hd, the race on more questions, on both decoders") :]
    every = every[: every.index("\n## ")]
    assert "| method | r=0.1 | r=0.2 | r=0.5 | neutral r=0.1 | neutral r=0.2 | neutral r=0.5 |" in every
    assert "| DivPrune | 0.5077 (0.8182) | 0.5007 (0.8282) | 0.5301 (0.8382) | 0.6 (0.8182) |" in every
    assert "- Taught decoder, at r=0.1" in every and "- Neutral decoder, at r=0.1" in every
    assert "Neutral decoder, at r=0.1 (12.8 visual tokens kept), the TokenSelector scores 0.4911; the best" in every
    assert "the best training-free method, DivPrune, 0.6 (+0.1089): not decided" in every
    assert f"Taught decoder's command: `{cmd}`" in every and f"Neutral decoder's command: `{ncmd}`" in every
    assert "## Token pruning on drive-hd's neutral decoder, the race on more questions" not in page
    neutral_page = page[page.index("## Token pruning on drive-hd's neutral decoder:") :]
    assert "The decoder is **neutral**" in neutral_page[: neutral_page.index("| method |")]
    shipped = page[page.index("## Token pruning on drive-hd:") : page.index("## Token pruning on drive-hd's neutral")]
    assert "taught the selector's prunings" in shipped and "This run predates FastV as published" in shipped
    assert "Timing, side by side" not in shipped and "timing of each method" in shipped  # timed as FastV was then
    race = page[page.index("## The pruning race on both decoders") :]
    race = race[: race.index("\n## ")]
    assert (
        "| more questions, the views each needs | 0.1 | TokenSelector 0.5011 | DART 0.5123 | -0.0112, not decided |"
        " TokenSelector 0.4911 | DivPrune 0.6 | -0.1089, not decided |" in race
    )
    assert "on the neutral decoder, of 4 rows: not decided in 4 (runs without per-question scores)" in race
    for claim in ("beats", "leads", "wins"):
        assert claim not in race
    # runs with per-question scores: each row's paired difference with its interval, and the outcomes counted
    taught, neutral = with_questions(taught, noisy=("token-selector",)), with_questions(neutral)
    runs["token_pruning_drive-hd-all-questions"]["result"] = taught
    runs["token_pruning_drive-hd-neutral-all-questions"]["result"] = neutral
    runs["token_pruning_drive-hd-neutral"]["result"] = neutral
    page = write(tmp_path / "paired", report, runs)
    race = page[page.index("## The pruning race on both decoders") :]
    race = race[: race.index("\n## ")]
    row_ = next(x for x in race.splitlines() if x.startswith("| more questions, the views each needs | 0.1 |"))
    assert "| TokenSelector 0.5011 ± 0.0211 | DART 0.5123 ± 0.0211 | -0.0112 [" in row_ and "], level |" in row_
    assert row_.endswith("| DivPrune 0.6 ± 0.0211 | -0.1089 [-0.1089, -0.1089], training-free ahead |")
    assert "on the decoder taught its prunings, of 4 rows: level in 2, not decided in 2 (runs without" in race
    assert "on the neutral decoder, of 4 rows: the TokenSelector ahead in 2, a training-free method ahead in 2" in race


def test_the_compile_cost_section_has_its_table_and_the_deepest_ratio(tmp_path, report):
    """benchmarks/compile_cost.py's rows on the page, and the sentence at the deepest model: one layer's compile
    against the whole step's, and their graphs; without a results file, the command that makes it."""
    b = {b.name: b for b in report.benchmarks()}["compile_cost"]
    assert b.command(None) == ["python", "benchmarks/compile_cost.py", "--threads", "1"] and b.pinned
    page = write(tmp_path / "none", report, FIXTURES)
    sec = page[page.index("## Compiling a step") :]
    assert "**Not measured yet:**" in sec and "--only compile_cost" in sec
    rows = [
        {"depth": d, "mode": m, "compile_s": s, "graphs": 1, "ops": o, "step_ms": 4.0, "max_diff": 0.0}
        for d, m, s, o in (
            (6, "layer", 9.5, 58),
            (6, "whole", 18.0, 380),
            (24, "layer", 10.0, 58),
            (24, "whole", 40.0, 1424),
        )
    ]
    runs = {**FIXTURES, "compile_cost": run_file("compile_cost", {"width": 512, "threads": 1, "rows": rows}, "x")}
    sec = write(tmp_path / "run", report, runs)
    sec = sec[sec.index("## Compiling a step") :]
    assert "At 24 layers one layer's compile takes **10.0 s** against 40.0 s for the whole step (4.0x as long)," in sec
    assert "in 1 graph of 58 operations against 1424." in sec
    for r in rows:
        assert row(report, [r[c] for c in report.COMPILE_COLUMNS]) in sec


def test_the_step_costs_of_a_gpu_run_show_the_floor_the_goals_and_each_step(tmp_path, report):
    result = {
        "benchmark": "step_costs",
        "device": "NVIDIA H100 80GB HBM3",
        "config": "internvl2.5-2b",
        "width": 1024,
        "tree_nodes": 17,
        "draft_depth": 16,
        "weight_bytes": 3_400_000_000,
        "kv_bytes": 100_663_296,
        "bandwidth_gbs": {"read_gbs": 2810.5, "copy_gbs": 2990.2},
        "floor_ms": 1.1707,
        "rows": [
            {"variant": "bf16", "steps": "eager", "decode_ms": 2.9, "verify_ms": 3.3, "draft_ms": 4.1}
            | {"prefill_ms": 20.5, "modules_ms": 31.0, "decode_vs_floor": 2.477, "verify_vs_decode": 1.138}
            | {"break_even_tau": 2.55, "setup_s": 2.1, "kernels": {"decode": "efficient"}},
            {"variant": "bf16", "steps": "compiled", "decode_ms": 1.6, "verify_ms": 1.9, "decode_vs_floor": 1.367}
            | {"verify_vs_decode": 1.188, "setup_s": 31.0, "kernels": {"decode": "efficient"}},
        ],
        "goals": {
            "decode_vs_floor": {"value": 1.367, "goal": 1.5, "met": True, "from": "bf16 compiled"},
            "verify_vs_decode": {"value": 1.188, "goal": 1.3, "met": True, "from": "bf16 compiled"},
        },
        "left_out": ["fp8-dynamic-per-row compiled: the time budget was spent"],
    }
    runs = {**FIXTURES, "gpu_step_costs": run_file("gpu_step_costs", result, "python benchmarks/step_costs.py")}
    page = write(tmp_path, report, runs).split("### gpu_step_costs")[1]
    assert "at 2990 GB/s (measured: read 2810.5, copy 2990.2): a decode step's floor is **1.1707 ms**" in page
    assert "a decode step over its floor 1.367 (goal <= 1.5, bf16 compiled): met" in page
    assert "a full tree's verification over a decode 1.188 (goal <= 1.3, bf16 compiled): met" in page
    assert row(report, [result["rows"][0].get(c) for c in report.STEP_COST_COLUMNS]) in page
    assert "Left out: fp8-dynamic-per-row compiled: the time budget was spent." in page
    assert "Attention kernels: bf16 eager: decode efficient; bf16 compiled: decode efficient." in page


def test_the_race_is_decided_on_fidelity_and_both_measures_separations_are_counted(tmp_path, report):
    """Where the runs keep per-question scores, the race section decides the shipped TokenSelector against the
    training-free method that loses the least likelihood, on fidelity's paired interval, and counts how many method
    pairs at r <= 0.2 each measure separates. Here the selector's finals swing by frame (every final interval holds
    zero) while its drop is a constant 0.02 below the others' (every fidelity interval excludes zero), except on the
    neutral decoder, where DART's drop equals it (level)."""
    taught = with_questions(pruning_result("drive-hd", True), noisy=("token-selector",), drops={"token-selector": 0.03})
    neutral = pruning_result("drive-hd", True)  # with the selector's choice applied before layer 2 too
    neutral["methods"].insert(1, "token-selector-k2")
    neutral["labels"]["token-selector-k2"] = "TokenSelector K=2"
    for r, v in ((0.1, 0.5201), (0.2, 0.5102), (0.5, 0.5)):
        neutral["scores"][f"token-selector-k2@{r}"] = scores(v, 0.82, 1.0)
    neutral = with_questions(
        neutral, noisy=("token-selector",), drops={"token-selector": 0.03, "dart": 0.03, "token-selector-k2": 0.02}
    )
    runs = {
        **FIXTURES,
        "token_pruning_drive-hd-all-questions": run_file("token_pruning_drive-hd-all-questions", taught, "x"),
        "token_pruning_drive-hd-neutral-all-questions": run_file(
            "token_pruning_drive-hd-neutral-all-questions", neutral, "y"
        ),
    }
    page = write(tmp_path, report, runs)
    race = page[page.index("## The pruning race on both decoders") :]
    race = race[: race.index("\n## ")]
    assert "**The race on fidelity.**" in race
    assert (
        "more questions, the views each needs, taught decoder, r = 0.1: the TokenSelector's drop 0.0300 against" in race
    )
    assert "difference -0.0200 [-0.0200, -0.0200]: **the TokenSelector ahead**" in race
    neutral_01 = race[race.index("neutral decoder, r = 0.1") :].split(";")[0]
    assert "DART's 0.0300 (the least of the training-free methods), difference +0.0000 [+0.0000, +0.0000]: level" in (
        neutral_01
    )
    # the same choice where DART cuts: 0.01 below DART's drop, said apart from the shipped placement's verdict
    assert neutral_01.endswith(
        " (its choice applied before layer 2, which is not how it ships, 0.0200: ahead, -0.0100 [-0.0100, -0.0100])"
    )
    assert "not how it ships" not in race[: race.index("neutral decoder, r = 0.1")]  # the taught run has no K=2
    # 4 training-free methods (FastV K=2, DART, DivPrune, DivPrune per view) x r = 0.1, 0.2 x two decoders
    assert "Of 16 method pairs at r <= 0.2" in race
    assert "the final score's interval excludes zero in **0**, fidelity's in **14**" in race


def test_litevlm_against_the_baseline_is_read_with_its_interval(tmp_path, report):
    runs = {**FIXTURES, **hd_runs()}
    res = runs["bench_hd_1thread"]["result"]
    lite = next(r for r in res["rows"] if r["config"] == "litevlm")
    d = {"a": 0.55, "b": 0.53, "se_a": 0.021, "se_b": 0.02, "diff": 0.02, "low": -0.004, "high": 0.044}
    lite["vs_baseline"] = {"final": d | {"n": 100, "frames": 17}, "closed": d | {"low": 0.01, "n": 40, "frames": 17}}
    page = write(tmp_path, report, runs)
    assert (
        "paired difference +0.0200 [-0.0040, +0.0440] (standard errors 0.0210 and 0.0200) over 100 questions in" in page
    )
    assert "17 frames: level; closed accuracy paired difference +0.0200 [+0.0100, +0.0440]" in page
    assert "40 questions in 17 frames: LiteVLM ahead" in page


def test_fp8_is_read_against_the_row_without_it(tmp_path, report):
    runs = {**FIXTURES, **hd_runs()}
    res = runs["bench_hd_1thread"]["result"]
    rows = {r["config"]: r for r in res["rows"]}
    d = {"a": 0.5351, "b": 0.5355, "se_a": 0.02, "se_b": 0.02, "diff": -0.0004, "low": -0.003, "high": 0.002}
    rows["litevlm fp8"]["vs_pair"] = {
        "against": "litevlm", "measures": "FP8 against full precision", "final": d | {"n": 100, "frames": 7}
    }  # fmt: skip
    page = write(tmp_path, report, runs)
    assert 'FP8 against full precision ("litevlm fp8" less "litevlm"), paired difference -0.0004' in page
    assert "over 100 questions in 7 frames: level" in page
