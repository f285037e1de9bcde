"""Command-line options shared by several commands: the pipeline's, and the recipes' generated from their dataclasses.

A recipe field becomes a flag when its `dataclasses.field` carries `metadata={"help": ...}`; the field's default is
the flag's default, so each default and each help text is written once, beside the field. Metadata may also name
the flag (`"flag": "--own-layer"`), its `choices` and `metavar`, and for a dict field the `parse` function of one
repeatable `KEY=VALUE` item. A bool flag flips the field's default.
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing

from litevlm.errors import LiteVLMError
from litevlm.presets import BACKENDS, LITEVLM

MODEL_HELP = (
    "bundled model name or checkpoint directory: ours, a transformers InternVL (-hf) folder or the original "
    "InternVL layout, with its tokenizer"
)


def add_format_options(p: argparse.ArgumentParser) -> None:
    """How the checkpoint was prompted in fine-tuning, for a model folder without a prompt.json (a folder with one
    keeps it: its trained modules were made with it)."""
    g = p.add_argument_group("prompt format (saved as prompt.json beside the trained modules)")
    g.add_argument("--system", default=None, help="the system message (default: the chat template's own, if any)")
    g.add_argument(
        "--camera-label",
        default=None,
        metavar="FORMAT",
        help='written before each view\'s image; {camera} is its name, {index} its place (default "{camera}: ")',
    )
    g.add_argument(
        "--tiles-per-view", type=int, default=None, metavar="N", help="fixed tiles per view, cut left to right"
    )
    g.add_argument(
        "--max-tiles", type=int, default=None, metavar="N", help="InternVL's dynamic tiling with at most N tiles a view"
    )
    g.add_argument(
        "--thumbnail",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="add the whole view as one more tile when it is cut into several",
    )


def format_options(args: argparse.Namespace) -> dict:
    """`litevlm.models.load_model`'s prompt-format keyword arguments from parsed format options."""
    return dict(
        system=args.system,
        camera_label=args.camera_label,
        tiles=args.tiles_per_view,
        max_tiles=args.max_tiles,
        thumbnail=args.thumbnail,
    )


def add_model_options(p: argparse.ArgumentParser, default: str | None = "drive-tiny") -> None:
    """`--model`, the device and dtype, and the prompt format options: what a recipe needs to load its target."""
    g = p.add_argument_group("model")
    g.add_argument("--model", default=default, required=default is None, help=MODEL_HELP)
    g.add_argument("--device", default="cpu")
    g.add_argument("--dtype", default="float32", help="float32 | bfloat16 | float16")
    add_format_options(p)


def load_model_from_args(args: argparse.Namespace):
    """The `litevlm.models.Loaded` that parsed model options describe."""
    from litevlm.models import load_model
    from litevlm.pipeline import torch_dtype

    return load_model(args.model, device=args.device, dtype=torch_dtype(args.dtype), **format_options(args))


def add_pipeline_options(p: argparse.ArgumentParser) -> None:
    """The options of `Pipeline.from_pretrained`, as flags of the commands that build a pipeline."""
    add_model_options(p)
    g = p.add_argument_group("pipeline")
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
        "--prune",
        default=None,
        metavar="METHOD",
        help="token pruning keeping --keep R of the visual tokens: token-selector (= --select-tokens R), fastv (at "
        "--prune-layer, default 2), dart (before decoder layer 2), divprune, cdpruner, random or uniform (on the "
        "projector's output)",
    )
    g.add_argument(
        "--keep", type=float, default=None, metavar="R", help="with --prune: the fraction of visual tokens kept"
    )
    g.add_argument(
        "--prune-layer",
        type=int,
        default=None,
        metavar="K",
        help="with --prune fastv or dart: prune before decoder layer K (default: the method's paper's, 2); with "
        "--prune token-selector: apply its choice before layer K, layers 0..K-1 reading the whole prompt",
    )
    g.add_argument(
        "--per-view",
        action="store_true",
        help="with --prune dart, divprune, cdpruner or random: keep R of each camera's tokens (= --prune-split view)",
    )
    g.add_argument(
        "--prune-split",
        choices=("all", "view", "crop"),
        default=None,
        help="with --prune: spread the budget over all visual tokens at once, each camera's, or each tile's "
        "(default: the method's authors' own on multi-crop input: crop for cdpruner, view for uniform, else all)",
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
        "--backend",
        default="auto",
        choices=BACKENDS,
        help="the model's execution backend, chosen once: auto (cuda on a GPU, else the native CPU steps where they "
        "apply), the modules, native, cuda (CUDA graphs), or cuda-twin (the CUDA backend's mechanisms on the CPU)",
    )
    g.add_argument(
        "--compile-steps",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="the cuda backend's decode, verification and draft-chain steps compiled by inductor before capture "
        "(fused norms, RoPE, SwiGLU, FP8 quantisation): one compile per KV bucket and step at setup, kept on disk "
        "for the next start (default: on for a GPU's cuda backend, off for its CPU twin)",
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
        help="the full LiteVLM configuration (litevlm.presets.LITEVLM): --select-views --select-tokens "
        "R (the r the model's TokenSelector stores as its own) "
        f"--select-min-tokens {LITEVLM['min_select_tokens']} --speculative",
    )


def pipeline_options(args: argparse.Namespace) -> dict:
    """`Pipeline.from_pretrained` keyword arguments from parsed pipeline options, `--litevlm` applied: its preset
    switches its stages on and fills the keep ratio and the threshold the command line left unset (with --prune,
    the pruning asked for replaces the preset's TokenSelector). Bad --prune / --keep values are refused here."""
    opts = dict(
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
        prune=args.prune,
        keep=args.keep,
        prune_layer=args.prune_layer,
        prune_per_view=args.per_view,
        prune_split=args.prune_split,
        speculative=args.speculative,
        tree_top_k=args.tree_top_k,
        tree_depth=args.tree_depth,
        tree_total=args.tree_total,
        tree_min_value=args.tree_min_value,
        fp8=args.fp8,
        matmul=args.matmul,
        backend=args.backend,
        compile_steps=args.compile_steps,
        min_select_tokens=args.select_min_tokens,
        openings=not args.no_openings,
        **format_options(args),
    )
    if any(opts[k] is not None for k in ("prune", "keep", "prune_layer", "prune_split")) or args.per_view:
        # a bad value is a clear error before any model is loaded
        from litevlm.select.pruners import PruneConfig

        PruneConfig.from_options(
            opts["prune"], opts["keep"], opts["prune_layer"], opts["prune_per_view"], opts["prune_split"]
        )
    if args.litevlm:  # --prune is the token pruning asked for: the preset's TokenSelector gives way to it
        preset = {k: v for k, v in LITEVLM.items() if not (k == "select_tokens" and opts["prune"] is not None)}
        opts.update({k: v for k, v in preset.items() if opts[k] is None or opts[k] is False})
    opts["min_select_tokens"] = opts["min_select_tokens"] or 0
    return opts


def pipeline_from_args(args: argparse.Namespace, **extra):
    """The `Pipeline` that parsed pipeline options describe (`extra`: more `from_pretrained` options)."""
    from litevlm.pipeline import Pipeline

    return Pipeline.from_pretrained(args.model, **pipeline_options(args), **extra)


# ------------------------------------------------------------------------------------------------
# Recipe flags, generated from the recipe dataclasses
# ------------------------------------------------------------------------------------------------
def _flagged(recipe_cls) -> list[tuple[dataclasses.Field, str, object]]:
    """(field, flag, default) of each field of `recipe_cls` that is a command-line flag."""
    out = []
    for f in dataclasses.fields(recipe_cls):
        if "help" in f.metadata:
            default = f.default if f.default is not dataclasses.MISSING else f.default_factory()
            out.append((f, f.metadata.get("flag", "--" + f.name.replace("_", "-")), default))
    return out


def _dest(flag: str) -> str:
    return flag.lstrip("-").replace("-", "_")


def _scalar(hint):
    """`X` of a `X | None` hint; any other hint unchanged."""
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        return next(a for a in typing.get_args(hint) if a is not type(None))
    return hint


def add_recipe_options(parser: argparse.ArgumentParser, recipe_cls) -> None:
    """One flag per field of `recipe_cls` whose metadata has a help text, with the field's default and type."""
    hints = typing.get_type_hints(recipe_cls)
    g = parser.add_argument_group(f"recipe ({recipe_cls.__name__})")
    for f, flag, default in _flagged(recipe_cls):
        hint = _scalar(hints[f.name])
        kw = dict(dest=_dest(flag), help=f.metadata["help"].replace("%", "%%"))
        for key in ("choices", "metavar"):
            if key in f.metadata:
                kw[key] = f.metadata[key]
        if hint is bool:
            kw["action"] = "store_true"
        elif "parse" in f.metadata:  # a dict: repeatable KEY=VALUE items
            kw.update(type=f.metadata["parse"], action="append", default=[])
        elif typing.get_origin(hint) is tuple:  # a variable-length tuple, tuple[int, ...]
            kw.update(type=typing.get_args(hint)[0], nargs="+", default=list(default))
        else:
            kw.update(type=hint, default=default)
            if default is not None:
                kw["help"] += " (default: %(default)s)"
        g.add_argument(flag, **kw)


def recipe_from_args(recipe_cls, args: argparse.Namespace, **fields):
    """The recipe that parsed recipe flags (plus `fields`) describe; an invalid field is a `LiteVLMError`."""
    hints = typing.get_type_hints(recipe_cls)
    kw = {}
    for f, flag, default in _flagged(recipe_cls):
        value = getattr(args, _dest(flag))
        hint = _scalar(hints[f.name])
        if hint is bool:
            value = (not default) if value else default
        elif typing.get_origin(hint) is dict:
            value = dict(value)
        elif typing.get_origin(hint) is tuple:
            value = tuple(value)
        kw[f.name] = value
    try:
        return recipe_cls(**kw, **fields)
    except ValueError as e:
        raise LiteVLMError(str(e)) from None
