"""The CPU steps four ways, side by side: the eager modules, the native C++ steps (cpu_steps.cpp), and the step
functions of `litevlm.model.cpu_steps` built by `torch.compile` (inductor on the CPU) and by AOTInductor.

    python benchmarks/compile_vs_native.py --model drive-tiny

On the model's decoder with a cache filled to --context slots (random K/V), the same inputs for every path:
(a) a plain decode step (layers, final norm, LM head); (b) the verification of the default draft tree (a chain of
depth + 1 tokens) with its greedy acceptance; (c) a draft cycle: the draft head's extend over 5 committed pairs,
then its chain at the default depth, uncut. Medians after warm-up, at 1 thread and at the machine's default count.
The compiled paths see the step's integers (cache slot, position) as dynamic, as a generation would. A compile that
fails is reported with its error. The rule: a library path replaces the C++ for a step where it is within 10% of it
at every thread count measured.
The last stdout line is one JSON object.
"""

from __future__ import annotations

import argparse
import copy
import json
import math
import tempfile
import time
from pathlib import Path

import torch
from torch.utils._pytree import tree_map

from litevlm.eval import timing
from litevlm.model import cpu_steps
from litevlm.model.layers import linear, row_major
from litevlm.pipeline import Pipeline
from litevlm.spec.tree import TreeConfig, accept_greedy, chain_tree, draft_tree

RULE = "a library path replaces the C++ where it is within 10% of it"
PAIRS = 5  # committed pairs the draft's extend takes in
CALL_INPUTS = ("token", "tokens", "feats", "nxt", "pair_pos", "root", "caches")  # what changes from call to call


class Step:
    """One computation: `modules()` runs it through the model's modules; `fn` is the cpu_steps function and `args`
    its arguments (weights, caches and sizes included); `dynamic` names the integer arguments a generation varies."""

    def __init__(self, name: str, modules, fn, args: dict, dynamic: tuple[str, ...]):
        self.name, self.modules, self.fn, self.args, self.dynamic = name, modules, fn, args, dynamic

    def call(self, impl):
        return impl(**self.args)

    def shifted(self) -> dict:
        """The arguments one slot and position further on: a second call that makes a compiler's integers dynamic."""
        return {k: (v + 1 if k in self.dynamic else v) for k, v in self.args.items()}


def setup(model, draft, context: int, depth: int, gen: torch.Generator) -> list[Step]:
    lm = model.language_model
    cfg = lm.cfg
    lm.setup_cache(1, 512)
    for layer in lm.layers:
        layer.self_attn.kv_cache.k.normal_(generator=gen)
        layer.self_attn.kv_cache.v.normal_(generator=gen)
    draft.prepare(512, 600)
    for buf in (draft.layer.self_attn.kv_cache.k, draft.layer.self_attn.kv_cache.v):
        buf.normal_(generator=gen)
    at, width, vocab = context, cfg.hidden_size, cfg.vocab_size
    cos, sin = lm.rope_table(600, torch.float32, "cpu")
    plan = lm.step_plan()
    target = dict(
        cos_table=cos,
        sin_table=sin,
        embed=lm.embed_tokens.weight.detach(),
        weights=plan.weights,
        caches=cpu_steps.caches(lm.layers),
        hq=cfg.num_heads,
        hkv=cfg.num_kv_heads,
        d=cfg.head_dim,
        eps=cfg.norm_eps,
        norm_w=lm.norm.weight.detach(),
        head=row_major(model.lm_head),
    )
    token = torch.tensor([7])

    def decode_modules():
        hidden = lm(lm.embed_tokens(token[None]), torch.tensor([[at]]), slots=torch.tensor([at]), kv_len=at + 1)
        return linear(hidden[:, -1], model.lm_head), hidden

    chain = torch.randint(10, vocab, (depth + 1,), generator=gen)
    tree = chain_tree(chain)

    def verify_modules():
        n = len(tree)
        mask = torch.cat([torch.ones(n, at, dtype=torch.bool), tree.mask], 1)[None, None]  # (1, 1, N, at + N)
        hidden = lm(
            lm.embed_tokens(chain)[None],
            (tree.depth + at)[None],
            slots=torch.arange(at, at + n),
            mask=mask,
            kv_len=at + n,
        )[0]
        return accept_greedy(tree, linear(hidden, model.lm_head))

    feats = torch.randn(PAIRS, width, generator=gen)
    nxt = lm.embed_tokens.weight[torch.randint(10, vocab, (PAIRS,), generator=gen)].detach()
    pair_pos = torch.arange(at, at + PAIRS)
    done, root, root_pos = 40, torch.tensor([7]), at + PAIRS
    chain_cfg = TreeConfig.chain(depth, 0.0)

    # a copy of the draft whose layer carries a no-op hook: the CPU steps never run under hooks, so it runs its modules
    module_draft = copy.deepcopy(draft)
    module_draft.layer.register_forward_pre_hook(lambda *args: None)
    module_draft.prepare(512, 600)

    def cycle_modules():
        h_root = module_draft.extend(feats, nxt, pair_pos, done, last_only=True)
        return draft_tree(module_draft, root, h_root, done + PAIRS, root_pos, chain_cfg)

    embed, fc_w, fc_b, head, vocab_map = draft._chain_args
    dcfg = draft.cfg
    cycle_args = dict(
        feats=feats,
        nxt=nxt,
        pair_pos=pair_pos,
        done=done,
        root=root,
        root_pos=root_pos,
        depth=depth,
        log_min=-math.inf,  # uncut: every path drafts the whole chain
        eos=-1,
        cos_table=draft._rope[0],
        sin_table=draft._rope[1],
        embed=embed,
        fc_w=fc_w,
        fc_b=fc_b,
        head=head,
        vocab_map=vocab_map,
        weights=draft._plan.weights,
        caches=cpu_steps.caches((draft.layer,)),
        hq=dcfg.num_heads,
        hkv=dcfg.num_kv_heads,
        d=dcfg.head_dim,
        eps=dcfg.norm_eps,
    )
    return [
        Step(
            "decode step",
            decode_modules,
            cpu_steps.decode_logits,
            dict(token=token, position=at, slot=at, **target),
            ("position", "slot"),
        ),
        Step(
            "tree verification",
            verify_modules,
            cpu_steps.verify_chain,
            dict(tokens=chain, start=at, root_pos=at, **target),
            ("start", "root_pos"),
        ),
        Step("draft cycle", cycle_modules, cpu_steps.draft_cycle, cycle_args, ("done", "root_pos")),
    ]


class Exported(torch.nn.Module):
    """A step function with its fixed arguments (weights, sizes) held, for torch.export: the forward takes the
    tensors a call changes (inputs and caches, written in place) and the dynamic integers."""

    def __init__(self, step: Step):
        super().__init__()
        self.step = step
        self.inputs = [k for k in step.args if k in step.dynamic or k in CALL_INPUTS]

    def forward(self, *values):
        args = dict(self.step.args)
        args.update(zip(self.inputs, values))
        return self.step.fn(**args)


def compile_inductor(step: Step):
    """torch.compile (inductor) -> (the compiled callable, seconds to compile: its first calls)."""
    compiled = torch.compile(step.fn, backend="inductor")
    t0 = time.perf_counter()
    compiled(**step.args)
    compiled(**step.shifted())  # integers seen changing: one dynamic graph from here on
    compiled(**step.args)
    return lambda: compiled(**step.args), time.perf_counter() - t0


def compile_aoti(step: Step, folder: Path, static: bool = False):
    """torch.export + AOTInductor -> (the loaded package as a callable, seconds to export and compile). static: the
    step's integers baked in (a build per cache slot, which no generation can use: for reference only)."""
    module = Exported(step)
    values = tuple(step.args[k] for k in module.inputs)
    dynamic = tuple(
        (None if static else torch.export.Dim.DYNAMIC) if k in step.dynamic else tree_map(lambda _: None, step.args[k])
        for k in module.inputs
    )
    t0 = time.perf_counter()
    program = torch.export.export(module, values, dynamic_shapes=(dynamic,))
    name = f"{step.name.replace(' ', '_')}{'_static' if static else ''}.pt2"
    path = torch._inductor.aoti_compile_and_package(program, package_path=str(folder / name))
    runner = torch._inductor.aoti_load_package(path)
    seconds = time.perf_counter() - t0
    runner(*values)
    return lambda: runner(*values), seconds


def short(err: Exception) -> str:
    lines = [line.strip() for line in str(err).strip().splitlines() if line.strip()]
    return f"{type(err).__name__}: {lines[0] if lines else ''}"[:200]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="drive-tiny")
    ap.add_argument("--context", type=int, default=120, help="cached slots before the timed steps")
    ap.add_argument("--k", type=int, default=200, help="timed calls per median")
    args = ap.parse_args()
    torch.set_grad_enabled(False)
    default_threads = torch.get_num_threads()

    pipe = Pipeline.from_pretrained(args.model, speculative=True)
    if pipe.model.language_model.steps.name != "native":
        raise SystemExit(f"the native CPU steps are unavailable here ({cpu_steps.backend()}): nothing to compare")
    native = pipe.model.language_model.steps
    depth = TreeConfig().depth
    steps = setup(pipe.model, pipe.draft, args.context, depth, torch.Generator().manual_seed(0))
    native_fn = {
        steps[0].name: native.decode,
        steps[1].name: native.verify_chain,
        steps[2].name: native.draft_cycle,
    }

    compiled, compile_s, errors, reference = {}, {}, {}, {}
    with tempfile.TemporaryDirectory() as folder:
        for step in steps:
            for kind, build in (("inductor", compile_inductor), ("aoti", lambda s: compile_aoti(s, Path(folder)))):
                try:
                    compiled[step.name, kind], compile_s[step.name, kind] = build(step)
                except Exception as err:  # reported in the table and the JSON, not hidden
                    errors[step.name, kind] = short(err)
                    print(f"{step.name}: {kind} failed: {errors[step.name, kind]}", flush=True)
            if (step.name, "aoti") in errors:  # the integers baked in: what AOTInductor would give at best
                try:
                    compiled[step.name, "aoti static"], _ = compile_aoti(step, Path(folder), static=True)
                except Exception as err:
                    errors[step.name, "aoti static"] = short(err)

        rows = []
        for threads in sorted({1, default_threads}):
            torch.set_num_threads(threads)
            for step in steps:
                warm = max(10, args.k // 10)
                row = {
                    "step": step.name,
                    "threads": threads,
                    "eager_ms": timing.median_ms(step.modules, args.k, warmup=warm),
                    "native_ms": timing.median_ms(lambda: step.call(native_fn[step.name]), args.k, warmup=warm),
                }
                for kind in ("inductor", "aoti"):
                    fn = compiled.get((step.name, kind))
                    row[f"{kind}_ms"] = None if fn is None else timing.median_ms(fn, args.k, warmup=warm)
                static = compiled.get((step.name, "aoti static"))
                if static is not None:  # the table only: no generation can run it
                    reference[step.name, threads] = timing.median_ms(static, args.k, warmup=warm)
                row["compile_s"] = {kind: _round(compile_s.get((step.name, kind))) for kind in ("inductor", "aoti")}
                rows.append({k: _round(v) for k, v in row.items()})
        torch.set_num_threads(default_threads)

    kept = {}
    for step in steps:
        ratios = {
            kind: max(r[f"{kind}_ms"] / r["native_ms"] for r in rows if r["step"] == step.name)
            for kind in ("inductor", "aoti")
            if all(r[f"{kind}_ms"] is not None for r in rows if r["step"] == step.name)
        }  # a library path's worst ratio to the C++ over the thread counts
        best = min(ratios, key=ratios.get, default=None)
        kept[step.name] = best if best is not None and ratios[best] <= 1.10 else "native"

    print(f"{'step':>26} {'thr':>4} {'eager':>9} {'native':>9} {'inductor':>9} {'aoti':>9}   compile s (ind / aoti)")
    for r in rows:
        cells = [r["eager_ms"], r["native_ms"], r["inductor_ms"], r["aoti_ms"]]
        comp = " / ".join("failed" if v is None else f"{v:.1f}" for v in r["compile_s"].values())
        print(f"{r['step']:>26} {r['threads']:>4} " + " ".join(_cell(v) for v in cells) + f"   {comp}")
    for (name, kind), why in errors.items():
        print(f"{name}: {kind} failed: {why}")
    for (name, threads), ms in reference.items():
        print(f"{name}, {threads} thread(s): AOTInductor with the slot and position baked in (one build per slot, no")
        print(f"  use to a generation; for reference): {ms:.3f} ms")
    print("kept: " + ", ".join(f"{k}: {v}" for k, v in kept.items()) + f" ({RULE})")
    print(
        json.dumps(
            {
                "benchmark": "compile_vs_native",
                "rows": rows,
                "kept": kept,
                "rule": RULE,
                "errors": {f"{name}, {kind}": why for (name, kind), why in errors.items()},
                "aoti_static_ms": {
                    f"{name}, {threads} thread(s)": _round(ms) for (name, threads), ms in reference.items()
                },
            }
        )
    )


def _round(v):
    return round(v, 4) if isinstance(v, float) else v


def _cell(v) -> str:
    return f"{'failed':>9}" if v is None else f"{v:>9.3f}"


if __name__ == "__main__":
    main()
