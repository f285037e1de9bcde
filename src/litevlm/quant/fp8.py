"""FP8 post-training quantisation of linear layers: calibrated scales, a real FP8 GEMM on GPUs of compute
capability >= 8.9, and a fake-quant reference with the same rounding everywhere else.

LiteVLM's last step (arXiv 2506.07416, Table 1) is FP8 PTQ of the deployed model. A tensor is
stored as float8_e4m3fn (max 448) times an fp32 *dequantisation* scale, `x ~ q * s` with
`s = amax / 448`. Two recipes, as NVIDIA ModelOpt names them:

- "fp8-static-per-tensor" (ModelOpt FP8_DEFAULT_CFG): one scale per weight, and one per layer input
  fixed by max calibration: the running max |x| each layer's input reaches over calibration data
  drawn from the post-selection pipeline, i.e. the inputs the layer really sees.
- "fp8-dynamic-per-row" (FP8_PER_CHANNEL_PER_TOKEN_CFG): one scale per weight row (output channel),
  and one per input row (token), computed at run time.

Values are clamped to +-448 before every cast: casts saturate on torch's CPU, but other stacks wrap
or give NaN, and static scales meet activations beyond the calibrated max. On CUDA with capability
>= 8.9 `FP8Linear` calls `torch._scaled_mm` (2-D operands, the first row-major and the second
column-major, K and N multiples of 16, fp32 scales of shape () or (M, 1) / (1, N)); elsewhere it
dequantises the same float8 operands and multiplies in fp32 (`fp8_mm_reference`). Both paths share
the quantisation code, so they differ only in accumulation order. The CUDA rules are asserted in our
own code (`check_scaled_mm_args`) on every device, because the CPU `_scaled_mm` accepts what CUDA
refuses. `torch._scaled_mm` is used rather than the newer `torch.nn.functional.scaled_mm` because
its CUDA behaviour is the one measured on an H200 (research B.2).

The converter quantises decoder linears by default; the LM head, embeddings, norms, selectors and
the draft head stay in high precision; the vision tower and projector only with `include_vision`.
A layer whose shape the FP8 GEMM cannot take is left in high precision and *reported*, never
skipped silently.

torchao: not importable in this project's environment, so none of this uses it. It would not do the
job better here anyway: its float8 inference refuses CPUs (no faithful CPU reference to test
against), static activation scales are a prototype, it silently skips layers whose sizes are not
multiples of 16, its default changes global Inductor settings, and its checkpoints are tensor
subclasses tied to its version. Our `FP8Linear` is plain tensor ops plus `_scaled_mm`, which
`torch.compile` sees through (so the activation quantisation can fuse with the ops before it), and its
checkpoint is plain float8 tensors with `weight_scale` / `input_scale` beside them (ModelOpt's names).
"""

from __future__ import annotations

import fnmatch
import re
import shutil
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import NamedTuple

import torch
import torch.nn as nn
from safetensors import safe_open
from tqdm import tqdm

from litevlm.config import flag
from litevlm.errors import LiteVLMError
from litevlm.model.modules import submodules

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0  # largest finite float8_e4m3fn
AMAX_EPS = 1e-12  # an all-zero tensor gets a tiny scale instead of dividing by zero
RECIPES = ("fp8-static-per-tensor", "fp8-dynamic-per-row")
MIN_CAPABILITY = (8, 9)  # Ada, Hopper, Blackwell

DECODER_LINEAR = re.compile(r"(?:.*\.)?language_model\.layers\.\d+\.(self_attn\.[qkvo]_proj|mlp\.(gate|up|down)_proj)")
VISION_LINEAR = re.compile(
    r"(?:.*\.)?(?:vision_tower\.encoder\.layer\.\d+\.(attention\.([qkv]_proj|projection_layer)|mlp\.fc[12])"
    r"|multi_modal_projector\.linear_[12])"
)
VISION_MODULES = ("vision_tower", "multi_modal_projector")
KEPT_WORDS = ("select", "draft", "router")  # view / token selectors, EAGLE draft head: small, accuracy-critical


@dataclass(frozen=True)
class FP8Recipe:
    """What to quantise and how. `exclude` holds fnmatch patterns of module names kept in high precision."""

    name: str = flag("fp8-static-per-tensor", "the quantisation recipe", flag="--recipe", choices=RECIPES)
    include_vision: bool = flag(False, "quantise the vision tower and projector too", flag="--vision")
    format: str = "e4m3"
    exclude: tuple[str, ...] = ()
    fast_accum: bool = False  # cuBLAS fast accumulation (Hopper): a little faster, a little less exact

    def __post_init__(self) -> None:
        if self.name not in RECIPES:
            raise ValueError(f"FP8Recipe field 'name': {self.name!r} is not one of {', '.join(RECIPES)}")
        if self.format != "e4m3":
            raise ValueError(f"FP8Recipe field 'format': only 'e4m3' (float8_e4m3fn) is supported, got {self.format!r}")
        object.__setattr__(self, "exclude", tuple(self.exclude))

    @property
    def static(self) -> bool:
        """Static per-tensor input scales from calibration (else dynamic per-row)."""
        return self.name == "fp8-static-per-tensor"

    def to_dict(self) -> dict:
        return {**asdict(self), "exclude": list(self.exclude)}

    @classmethod
    def from_dict(cls, d: dict) -> FP8Recipe:
        return cls(**{**d, "exclude": tuple(d.get("exclude", ()))})


# ================================================================================================
# Numerics
# ================================================================================================
def scale_from_amax(amax: torch.Tensor) -> torch.Tensor:
    """The fp32 dequantisation scale that maps |x| <= amax onto the e4m3 range."""
    return amax.float().clamp(min=AMAX_EPS) / E4M3_MAX


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """x / scale, clamped to +-448 (never rely on the cast to saturate), cast to float8_e4m3fn."""
    return (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)


def quantize_weight(w: torch.Tensor, per_row: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(N, K) weight -> (float8 weight, scale of shape (N, 1) per row, or () per tensor)."""
    amax = w.detach().abs().amax(dim=1, keepdim=True) if per_row else w.detach().abs().amax()
    scale = scale_from_amax(amax)
    return quantize_fp8(w.detach(), scale), scale


def sqnr(ref: torch.Tensor, test: torch.Tensor) -> float:
    """Signal-to-quantisation-noise ratio in dB: 20 log10(|ref| / |ref - test|)."""
    ref, test = ref.double(), test.double()
    return float(20 * torch.log10(ref.norm() / (ref - test).norm().clamp(min=1e-30)))


def check_scaled_mm_args(a: torch.Tensor, b: torch.Tensor, scale_a: torch.Tensor, scale_b: torch.Tensor) -> None:
    """The CUDA `_scaled_mm` rules (research B.2), checked on every device: the CPU kernel is more permissive."""
    if a.dim() != 2 or b.dim() != 2:
        raise ValueError(f"FP8 GEMM operands must be 2-D; got {tuple(a.shape)} and {tuple(b.shape)}")
    if a.dtype != E4M3 or b.dtype != E4M3:
        raise ValueError(f"FP8 GEMM operands must be float8_e4m3fn; got {a.dtype} and {b.dtype}")
    (m, k), (k2, n) = a.shape, b.shape
    if k != k2 or k % 16 or n % 16:
        raise ValueError(
            f"FP8 GEMM needs matching K and K, N multiples of 16; got A {tuple(a.shape)}, B {tuple(b.shape)}"
        )
    if a.stride(1) != 1 or b.stride(0) != 1:
        raise ValueError("FP8 GEMM needs A row-major and B column-major (pass weight.t() of a contiguous weight)")
    if scale_a.dtype != torch.float32 or scale_b.dtype != torch.float32:
        raise ValueError(f"FP8 GEMM scales must be float32; got {scale_a.dtype} and {scale_b.dtype}")
    tensorwise = scale_a.numel() == 1 and scale_b.numel() == 1 and scale_a.dim() <= 2 and scale_b.dim() <= 2
    rowwise = tuple(scale_a.shape) == (m, 1) and tuple(scale_b.shape) == (1, n)
    if not (tensorwise or rowwise):
        raise ValueError(
            f"FP8 GEMM scales must both be one element or be (M, 1)=({m}, 1) and (1, N)=(1, {n}); "
            f"got {tuple(scale_a.shape)} and {tuple(scale_b.shape)}"
        )


def _cuda_version() -> tuple[int, int]:
    """The CUDA release torch was built for, as (major, minor); (0, 0) for a build without CUDA."""
    major, _, minor = (torch.version.cuda or "0.0").partition(".")
    return int(major), int(minor.split(".")[0] or 0)


CUDA_BUILD = _cuda_version()  # read once: a compiled graph tracing `kernel_out_dtype` sees a constant


def kernel_out_dtype(
    out_dtype: torch.dtype, rowwise: bool, capability: tuple[int, int], cuda: tuple[int, int] | None = None
) -> torch.dtype:
    """The output dtype to ask of `torch._scaled_mm` for a product wanted in `out_dtype`, on a GPU of compute
    `capability` with torch built for CUDA `cuda` (default: this torch's).

    Tensor-wise scales take any output. Row-wise scales run in cuBLAS only on Hopper (9.x) with CUDA >= 12.9, which
    writes any output; everywhere else (Ada 8.9, Blackwell, older CUDA) torch runs a CUTLASS kernel that writes bf16
    only and refuses fp32, so the product is made in bf16 and cast to `out_dtype` after."""
    if not rowwise or out_dtype == torch.bfloat16:
        return out_dtype
    if capability[0] == 9 and (cuda or CUDA_BUILD) >= (12, 9):
        return out_dtype
    return torch.bfloat16


def fp8_mm(
    a,
    b,
    scale_a,
    scale_b,
    bias=None,
    out_dtype=torch.bfloat16,
    fast_accum: bool = False,
    capability: tuple[int, int] | None = None,
) -> torch.Tensor:
    """(a * scale_a) @ (b * scale_b) + bias with the real FP8 GEMM. a (M, K) row-major, b (K, N) column-major.

    capability: the GPU's compute capability (default: a's device's), which decides the kernel's output dtype
    (`kernel_out_dtype`)."""
    check_scaled_mm_args(a, b, scale_a, scale_b)
    rowwise = not (scale_a.numel() == 1 and scale_b.numel() == 1)
    if capability is None:
        capability = torch.cuda.get_device_capability(a.device)
    dtype = kernel_out_dtype(out_dtype, rowwise, capability)
    fused = bias is not None and dtype == out_dtype == torch.bfloat16  # the epilogue bias path measured on H200
    y = torch._scaled_mm(
        a,
        b,
        scale_a=scale_a,
        scale_b=scale_b,
        bias=bias.to(out_dtype) if fused else None,
        out_dtype=dtype,
        use_fast_accum=fast_accum,
    ).to(out_dtype)
    return y + bias.to(out_dtype) if bias is not None and not fused else y


def fp8_mm_reference(
    a, b, scale_a, scale_b, bias=None, out_dtype=torch.bfloat16, fast_accum: bool = False
) -> torch.Tensor:
    """The same product on any device: dequantise the float8 operands exactly, accumulate in fp32.

    The bias is added where `fp8_mm` adds it (before the output rounding for bf16, after otherwise),
    so the two differ only in accumulation order. `fast_accum` is accepted for symmetry and ignored.
    """
    check_scaled_mm_args(a, b, scale_a, scale_b)
    y = (a.float() @ b.float()) * (scale_a * scale_b)  # (M, N); scales broadcast as () or (M, 1) * (1, N)
    if bias is None:
        return y.to(out_dtype)
    if out_dtype == torch.bfloat16:
        return (y + bias.to(out_dtype).float()).to(out_dtype)
    return y.to(out_dtype) + bias.to(out_dtype)


def fp8_kernel_available(device: torch.device) -> bool:
    """True where `torch._scaled_mm` runs a real FP8 GEMM: CUDA devices of compute capability >= 8.9."""
    return device.type == "cuda" and torch.cuda.get_device_capability(device) >= MIN_CAPABILITY


# ================================================================================================
# The FP8 linear layer
# ================================================================================================
_FIXED_DTYPE = ("weight", "weight_scale", "input_scale")  # follow device moves, never dtype casts


class QuantizedInput(NamedTuple):
    """An activation quantised once for every FP8Linear that reads it (q/k/v, gate/up: `FP8Linear.shared_input`)."""

    xq: torch.Tensor  # (M, K) float8, row-major
    scale: torch.Tensor  # () static, or (M, 1) one per row
    lead: torch.Size  # the activation's leading dimensions
    dtype: torch.dtype  # the activation's dtype: the outputs'


class FP8Linear(nn.Module):
    """y = x W^T + b with W in float8_e4m3fn; x quantised per tensor (static scale) or per row (dynamic).

    Every tensor is a buffer: `model.to(torch.bfloat16)` moves them and casts the bias, but the float8
    weight and the fp32 scales keep their dtypes. The output has the input's dtype. Set `use_kernel`
    to False to force the reference path on a capable GPU.
    """

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        per_row: bool,
        static: bool,
        recipe: str = RECIPES[0],
        fast_accum: bool = False,
        device=None,
    ):
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.recipe, self.fast_accum = recipe, fast_accum
        self.register_buffer("weight", torch.zeros(out_features, in_features, dtype=E4M3, device=device))
        self.register_buffer("weight_scale", torch.ones((out_features, 1) if per_row else (), device=device))
        self.register_buffer("input_scale", torch.ones((), device=device) if static else None)
        self.register_buffer("bias", torch.zeros(out_features, device=device) if bias else None)
        self._set_kernel(self.weight.device)

    def _set_kernel(self, device: torch.device) -> None:
        """Whether the real FP8 GEMM runs here, and the GPU's compute capability that chooses its output dtype."""
        self.use_kernel = fp8_kernel_available(device)
        self.capability = torch.cuda.get_device_capability(device) if self.use_kernel else None

    @classmethod
    def from_linear(cls, linear: nn.Linear, recipe: FP8Recipe, input_amax: float | None = None) -> FP8Linear:
        if recipe.static and input_amax is None:
            raise ValueError("a static recipe needs the layer's calibrated input amax")
        n, k = linear.weight.shape
        m = cls(
            k,
            n,
            bias=linear.bias is not None,
            per_row=not recipe.static,
            static=recipe.static,
            recipe=recipe.name,
            fast_accum=recipe.fast_accum,
            device=linear.weight.device,
        )
        m.weight, m.weight_scale = quantize_weight(linear.weight, per_row=not recipe.static)
        if recipe.static:
            m.input_scale = scale_from_amax(torch.tensor(float(input_amax), device=linear.weight.device))
        if linear.bias is not None:
            m.bias = linear.bias.detach().clone()  # kept in high precision
        return m

    def quantize_input(self, x: torch.Tensor) -> QuantizedInput:
        """x (..., K) quantised as this layer's GEMM reads it."""
        x2 = x.reshape(-1, self.in_features)  # (M, K): the FP8 GEMM takes 2-D operands only
        if self.input_scale is not None:
            scale_x = self.input_scale  # (): static, calibrated
        else:
            scale_x = scale_from_amax(x2.detach().abs().amax(dim=1, keepdim=True))  # (M, 1): one per token
        xq = quantize_fp8(x2, scale_x).contiguous()  # row-major A even if x was a strided view
        return QuantizedInput(xq, scale_x, x.shape[:-1], x.dtype)

    def shared_input(self, x: torch.Tensor, readers) -> torch.Tensor | QuantizedInput:
        """x quantised once for every layer in `readers` (this one first) where they all quantise it alike: each
        dynamic per row (the scale comes from x alone), or static with one calibrated scale (`share_static`, set
        where the calibration gave them the same one). Otherwise x, for each to quantise on its own."""
        dynamic = self.input_scale is None
        for r in readers:
            if not isinstance(r, FP8Linear) or r.in_features != self.in_features:
                return x
            if (r.input_scale is None) != dynamic or (not dynamic and not getattr(r, "share_static", False)):
                return x
        return self.quantize_input(x)

    def forward(self, x: torch.Tensor | QuantizedInput) -> torch.Tensor:
        q = x if isinstance(x, QuantizedInput) else self.quantize_input(x)
        scale_w = self.weight_scale.view(1, -1) if self.weight_scale.dim() else self.weight_scale  # () or (1, N)
        args = (q.xq, self.weight.t(), q.scale, scale_w, self.bias, q.dtype, self.fast_accum)  # W^T: column-major B
        y = fp8_mm(*args, capability=self.capability) if self.use_kernel else fp8_mm_reference(*args)
        return y.reshape(*q.lead, self.out_features)  # (..., N)

    def _apply(self, fn, recurse: bool = True):
        device = fn(torch.empty(0, device=self.weight.device)).device  # where `fn` sends tensors
        for name, t in self._buffers.items():
            if t is not None:
                self._buffers[name] = t.to(device) if name in _FIXED_DTYPE else fn(t)
        self._set_kernel(device)
        return self

    def extra_repr(self) -> str:
        return (
            f"in_features={self.in_features}, out_features={self.out_features}, bias={self.bias is not None}, "
            f"recipe={self.recipe}, kernel={self.use_kernel}"
        )


# ================================================================================================
# Which layers: the filter and its report
# ================================================================================================
@dataclass
class QuantReport:
    """Every module that owns parameters, accounted for: quantised, kept (with why), or unsupported (with why)."""

    recipe: str
    quantized: list[str] = field(default_factory=list)
    kept: dict[str, str] = field(default_factory=dict)
    unsupported: dict[str, str] = field(default_factory=dict)

    def to_dict(self) -> dict:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> QuantReport:
        return cls(d["recipe"], list(d["quantized"]), dict(d["kept"]), dict(d["unsupported"]))

    def summary(self) -> str:
        lines = [
            f"{self.recipe}: {len(self.quantized)} linear layers quantised to FP8, "
            f"{len(self.kept)} modules kept in high precision, {len(self.unsupported)} of unsupported shape"
        ]
        reasons: dict[str, int] = {}
        for why in self.kept.values():
            reasons[why] = reasons.get(why, 0) + 1
        lines += [f"  kept ({n}): {why}" for why, n in sorted(reasons.items(), key=lambda kv: -kv[1])]
        lines += [f"  UNSUPPORTED {name}: {why}" for name, why in self.unsupported.items()]
        return "\n".join(lines)


def keep_reason(name: str, module: nn.Module, recipe: FP8Recipe) -> str | None:
    """Why `name` stays in high precision under `recipe`, or None if it is to be quantised."""
    parts = name.split(".")
    for pattern in recipe.exclude:
        if fnmatch.fnmatchcase(name, pattern):
            return f"excluded by the recipe pattern {pattern!r}"
    if "lm_head" in parts:
        return "LM head: logits are accuracy-critical (ModelOpt keeps *lm_head* too)"
    if any(w in p for p in parts for w in KEPT_WORDS):
        return "selector or draft head: small and accuracy-critical"
    if isinstance(module, nn.Embedding):
        return "embedding"
    if "norm" in type(module).__name__.lower():
        return "normalisation layer"
    if any(p in VISION_MODULES for p in parts) and not recipe.include_vision:
        return "vision tower / projector: quantised only with include_vision=True"
    if type(module) is not nn.Linear:
        return f"not a Linear layer ({type(module).__name__})"
    if DECODER_LINEAR.fullmatch(name) or (recipe.include_vision and VISION_LINEAR.fullmatch(name)):
        return None
    return "not a decoder linear (the default filter)"


def shape_problem(linear: nn.Linear) -> str | None:
    """Why the FP8 GEMM cannot take this layer's shape, or None."""
    n, k = linear.weight.shape
    bad = [f"{what}={v} is not a multiple of 16" for what, v in (("in_features", k), ("out_features", n)) if v % 16]
    return "; ".join(bad) or None


def plan(model: nn.Module, recipe: FP8Recipe) -> QuantReport:
    """Classify every module that owns parameters (and every Linear) without changing anything."""
    report = QuantReport(recipe.name)
    for name, m in model.named_modules():
        if isinstance(m, FP8Linear):
            raise LiteVLMError(f"the model is already FP8-quantised ({name} is an FP8Linear)")
        if not (isinstance(m, nn.Linear) or any(True for _ in m.parameters(recurse=False))):
            continue
        why = keep_reason(name, m, recipe)
        if why is not None:
            report.kept[name] = why
        elif (problem := shape_problem(m)) is not None:
            report.unsupported[name] = f"{problem}; kept in high precision"
        else:
            report.quantized.append(name)
    return report


def recipe_filter(recipe: FP8Recipe) -> Callable[[str, nn.Module], bool]:
    """(name, module) -> True for exactly the layers `quantize_model(model, recipe)` converts."""
    return lambda name, m: type(m) is nn.Linear and keep_reason(name, m, recipe) is None and shape_problem(m) is None


# ================================================================================================
# Calibration and conversion
# ================================================================================================
@torch.no_grad()
def calibrate(
    model: nn.Module,
    batches: Callable[[], object] | Iterable[Callable[[], object]],
    layer_filter: FP8Recipe | Callable[[str, nn.Module], bool] | None = None,
    *,
    progress: bool = True,
    total: int | None = None,
    d=None,
) -> dict[str, float]:
    """Max calibration: the running max |x| of each selected layer's input while `batches` drives the model.

    `batches` is either one callable that runs all calibration inputs through the model, or an
    iterable of zero-argument callables (one per sample, e.g. `functools.partial(pipe.answer, q, images)`),
    shown with a progress bar. Run it eagerly: forward pre-hooks do not fire inside a captured CUDA graph.
    `layer_filter` is a recipe (the layers it would quantise; default `FP8Recipe()`) or a predicate.
    `d`: the `litevlm.dist.Dist` of a `torchrun` job whose ranks each drive their own share of the inputs;
    every rank gets the max over all of them (`reduce_amax`).
    """
    if layer_filter is None or isinstance(layer_filter, FP8Recipe):
        layer_filter = recipe_filter(layer_filter or FP8Recipe())
    amax: dict[str, torch.Tensor] = {}

    def observer(name: str):
        def hook(module, args):
            x = args[0]
            if x.numel():
                a = x.detach().abs().amax().float()
                amax[name] = a if name not in amax else torch.maximum(amax[name], a)  # stays on device: no sync

        return hook

    names = [n for n, m in model.named_modules() if layer_filter(n, m)]
    handles = [model.get_submodule(n).register_forward_pre_hook(observer(n)) for n in names]
    if not handles:
        raise LiteVLMError("calibration selected no layers: the filter matches no Linear of this model")
    try:
        if callable(batches):
            batches()
        else:
            for run in tqdm(batches, desc="calibrating FP8", total=total, disable=not progress):
                run()
    finally:
        for h in handles:
            h.remove()
    if not amax:
        raise LiteVLMError(
            "calibration observed no layer inputs: its hooks fire in the modules only, so run the calibration "
            "pipeline on the modules backend (Pipeline(..., backend='modules'))"
        )
    out = {n: float(a) for n, a in amax.items()}
    bad = sorted(n for n, a in out.items() if not torch.isfinite(torch.tensor(a)))
    if bad:
        raise LiteVLMError(
            f"calibration saw non-finite inputs (inf/NaN) at {', '.join(bad)}: check the model and inputs"
        )
    return reduce_amax(out, names, d) if d is not None else out


def reduce_amax(amax: dict[str, float], names: list[str], d) -> dict[str, float]:
    """The largest calibrated amax of each layer over the ranks of a `torchrun` job (`litevlm.dist.Dist` `d`),
    on every rank. `names` lists the calibrated layers in the same order on every rank; a layer no sample reached
    on a rank counts as absent there (-1 under the max), and stays absent if it is absent everywhere."""
    if d.world_size == 1:
        return dict(amax)
    import torch.distributed as dist

    device = d.device if d.device.startswith("cuda") else "cpu"
    t = torch.tensor([amax.get(n, -1.0) for n in names], dtype=torch.float64, device=device)  # (layers,)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return {n: float(a) for n, a in zip(names, t.tolist()) if a >= 0.0}


def quantize_model(
    model: nn.Module, recipe: FP8Recipe | None = None, amax: dict[str, float] | None = None, *, strict: bool = False
) -> QuantReport:
    """Replace the selected nn.Linear modules in place with FP8Linear; return what was done and why.

    The static recipe needs `amax` from `calibrate` (ignored by the dynamic recipe). Layers of a shape
    the FP8 GEMM cannot take stay as they are and are listed in `report.unsupported`; with
    `strict=True` they raise instead. Quantise before `torch.compile`.
    """
    recipe = recipe or FP8Recipe()
    report = plan(model, recipe)
    if strict and report.unsupported:
        raise LiteVLMError(
            "layers of unsupported shape: " + "; ".join(f"{n}: {w}" for n, w in report.unsupported.items())
        )
    if recipe.static:
        if amax is None:
            raise LiteVLMError(f"the {recipe.name} recipe needs calibrated input ranges: call calibrate(...) first")
        missing = [n for n in report.quantized if n not in amax]
        if missing:
            raise LiteVLMError(
                f"no calibration data reached {len(missing)} layers ({', '.join(missing[:6])}...): "
                "calibrate with the same recipe over inputs that run the whole model"
            )
    for name in report.quantized:
        parent_name, _, child = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        lin = getattr(parent, child)
        setattr(parent, child, FP8Linear.from_linear(lin, recipe, amax[name] if recipe.static else None))
    if recipe.static:  # layers that read one input with one calibrated range quantise it once between them
        for group in SHARED_INPUTS:
            for name in report.quantized:
                prefix, _, child = name.rpartition(".")
                if child != group[0]:
                    continue
                names = [f"{prefix}.{c}" for c in group]
                if all(n in report.quantized for n in names) and len({amax[n] for n in names}) == 1:
                    for n in names:
                        model.get_submodule(n).share_static = True
    return report


SHARED_INPUTS = (("q_proj", "k_proj", "v_proj"), ("gate_proj", "up_proj"))  # projections that read one activation


def precision_of(model: nn.Module) -> str:
    """'bfloat16', or e.g. 'fp8-static-per-tensor+bfloat16' (FP8 recipe + dtype of what stays high precision)."""
    # `submodules`, not `Module.modules()`: this runs at every answer
    recipes = sorted({m.recipe for m in submodules(model) if isinstance(m, FP8Linear)})
    dtype = next((p.dtype for p in model.parameters() if p.is_floating_point()), torch.float32)
    base = str(dtype).removeprefix("torch.")
    bf16 = ["bf16-matmul"] if getattr(model, "matmul_precision", None) == "bf16" else []
    return "+".join([*recipes, *bf16, base])


# ================================================================================================
# Calibration data
# ================================================================================================
SYNTH_CALIB_SEED = 2  # synthetic frames of seed 2: neither drive-tiny's training (0) nor its held-out (1) frames


@dataclass
class CalibrationSet:
    """The questions FP8 calibration runs (`samples`) and where they come from (`source`, saved in the checkpoint's
    config.json and printed by `litevlm quantize --json`)."""

    samples: list
    source: dict

    def describe(self) -> str:
        s = self.source
        if "scenes" not in s:
            return f"calibrated on {s['questions']} questions of {s['data']}"
        return (
            f"calibrated on {s['questions']} questions from {len(s['scenes'])} held-out scenes of {s['data']} "
            f"({s['split']}; {s['held_out_questions']} questions held out)"
        )


def calibration_set(n: int, data=None, images_root=None, fraction: float = 0.1, seed: int = 0) -> CalibrationSet:
    """`n` calibration questions. With `data` (a DriveLM JSON or synth folder), from the scenes that
    `litevlm.data.source.scene_split(samples, fraction, seed)` holds out: the held-out scenes taken in turn in the
    split's order, one question from each per turn, in file order within a scene, so that a few questions already
    span many scenes; fewer than `n` if the held-out scenes hold fewer. Without it, synthetic frames of seed 2."""
    from litevlm.data.drivelm import samples_from_frame
    from litevlm.data.source import load_data, scene_key, scene_split
    from litevlm.data.synthetic import make_frame, render_views

    if n < 1:
        raise LiteVLMError(f"calibration needs at least 1 question; got {n}")
    if data is None:
        samples, i = [], 0
        while len(samples) < n:
            frame = make_frame(SYNTH_CALIB_SEED, i)
            samples += samples_from_frame(frame, render_views(frame, size=(800, 450)))
            i += 1
        return CalibrationSet(samples[:n], {"data": f"synthetic frames of seed {SYNTH_CALIB_SEED}", "questions": n})
    _, held = scene_split(load_data(data, images_root), fraction, seed)
    if not held:
        raise LiteVLMError(
            f"{data} holds a single scene: calibration takes held-out scenes only, so it needs data of two or more "
            f"scenes (or a --calib-fraction above 0; it is {fraction})"
        )
    by_scene: dict[str, list] = {}
    for s in held:
        by_scene.setdefault(s.scene_id, []).append(s)
    queues = [by_scene[sc] for sc in sorted(by_scene, key=lambda sc: scene_key(sc, seed))]
    picked = []
    for turn in range(max(len(q) for q in queues)):
        picked += [q[turn] for q in queues if turn < len(q)]
    picked = picked[:n]
    return CalibrationSet(
        picked,
        {
            "data": str(data),
            "split": f"held-out scenes of scene_split(fraction={fraction}, seed={seed})",
            "scenes": sorted({s.scene_id for s in picked}),
            "questions": len(picked),
            "held_out_questions": len(held),
        },
    )


# ================================================================================================
# Checkpoints
# ================================================================================================
MODULE_PARTS = ("view_selector", "token_selector", "draft")  # trained modules: copied as they are, full precision


def check_out_dir(out_dir, source=None) -> None:
    """Refuse, before any work, an `out_dir` that `save_fp8` could not replace: a file, a non-empty folder that is
    not a checkpoint, or the source checkpoint itself (or a folder holding it)."""
    out = Path(out_dir).resolve()
    if source is not None and Path(source).resolve().is_relative_to(out):
        raise LiteVLMError(f"{out_dir} holds the checkpoint being quantised: write the FP8 checkpoint elsewhere")
    if out.exists() and not out.is_dir():
        raise LiteVLMError(f"{out_dir} exists and is not a directory")
    if out.is_dir() and any(out.iterdir()) and not (out / "config.json").is_file():
        raise LiteVLMError(f"{out_dir} is a non-empty directory that is not a checkpoint; refusing to replace it")


def save_fp8(
    model: nn.Module,
    out_dir,
    recipe: FP8Recipe,
    report: QuantReport,
    source=None,
    *,
    tokenizer=None,
    prompt_format=None,
    calibration: dict | None = None,
) -> Path:
    """Our checkpoint format (`save_native`) with the float8 weights and scales in model.safetensors and
    config.json["fp8"] = {"recipe", "report", "calibration"}, plus everything `Pipeline.from_pretrained` needs.

    source: the checkpoint folder the model was loaded from: its tokenizer files (chat template included) and
    its trained modules (view_selector/, token_selector/, draft/) are copied. tokenizer: written as tokenizer.json
    when the source has none (an original InternVL layout whose slow tokenizer was converted). prompt_format:
    written as prompt.json, so the FP8 checkpoint is prompted as its calibration was. The folder is written
    beside `out_dir` and renamed into place: a failure leaves nothing half-written.
    """
    from litevlm.model.hf import TOKENIZER_FILES, _atomic_dir, _save_native_into
    from litevlm.model.prompt import PROMPT_FILE

    if report.recipe != recipe.name:
        raise LiteVLMError(f"the report is for {report.recipe} but the recipe is {recipe.name}")
    check_out_dir(out_dir, source)
    src = Path(source) if source is not None else None
    meta = {"recipe": recipe.to_dict(), "report": report.to_dict()}
    if calibration is not None:
        meta["calibration"] = calibration
    with _atomic_dir(out_dir) as tmp:
        _save_native_into(model, tmp, extra_meta={"fp8": meta})
        if src is not None:
            for name in TOKENIZER_FILES:
                if (src / name).is_file():
                    shutil.copy2(src / name, tmp / name)
            for part in MODULE_PARTS:
                if (src / part).is_dir():
                    shutil.copytree(src / part, tmp / part)
        if tokenizer is not None and not (tmp / "tokenizer.json").is_file():
            (tmp / "tokenizer.json").write_text(tokenizer.to_str(), encoding="utf-8")
        if prompt_format is not None:
            prompt_format.save(tmp)
        elif src is not None and (src / PROMPT_FILE).is_file():
            shutil.copy2(src / PROMPT_FILE, tmp / PROMPT_FILE)
    return Path(out_dir)


def read_fp8_meta(path) -> tuple[FP8Recipe, QuantReport] | None:
    """The recipe and report of an FP8 checkpoint, or None for an unquantised one."""
    from litevlm.model.hf import read_native_meta

    fp8 = read_native_meta(path).get("fp8")
    if fp8 is None:
        return None
    return FP8Recipe.from_dict(fp8["recipe"]), QuantReport.from_dict(fp8["report"])


def load_fp8(path, device="cpu", dtype: torch.dtype | None = None):
    """Load a checkpoint written by `save_fp8` strictly; `dtype` casts only what is kept in high precision."""
    from litevlm.config import VLMConfig
    from litevlm.model.hf import read_native_meta
    from litevlm.model.vlm import VLM

    d = Path(path)
    meta = read_native_meta(d)
    if "fp8" not in meta:
        raise LiteVLMError(f"{d} is not an FP8 checkpoint (config.json has no 'fp8' entry): load it with load_native")
    recipe, report = FP8Recipe.from_dict(meta["fp8"]["recipe"]), QuantReport.from_dict(meta["fp8"]["report"])
    cfg = VLMConfig.from_dict(meta["litevlm"])
    with torch.device("meta"):
        model = VLM(cfg)
        for name in report.quantized:
            parent_name, _, child = name.rpartition(".")
            lin = model.get_submodule(name)
            setattr(
                model.get_submodule(parent_name),
                child,
                FP8Linear(
                    lin.in_features,
                    lin.out_features,
                    bias=lin.bias is not None,
                    per_row=not recipe.static,
                    static=recipe.static,
                    recipe=recipe.name,
                    fast_accum=recipe.fast_accum,
                ),
            )
    expected = {k: (tuple(v.shape), v.dtype) for k, v in model.state_dict().items()}
    tied = cfg.text.tie_embeddings
    if tied:
        expected.pop("lm_head.weight")
    if not (d / "model.safetensors").is_file():
        raise LiteVLMError(f"{d} has no model.safetensors")
    with safe_open(str(d / "model.safetensors"), framework="pt", device="cpu") as f:
        state = {k: f.get_tensor(k) for k in f.keys()}
    problems = [f"missing {k}" for k in sorted(set(expected) - set(state))]
    problems += [f"unexpected {k}" for k in sorted(set(state) - set(expected))]
    fixed = {f"{n}.{b}" for n in report.quantized for b in _FIXED_DTYPE}  # float8 weights, fp32 scales
    for k, (shape, want) in expected.items():
        t = state.get(k)
        if t is not None and (tuple(t.shape) != shape or (k in fixed and t.dtype != want)):
            problems.append(f"{k} is {t.dtype} {tuple(t.shape)}, expected {want if k in fixed else 'any'} {shape}")
    if problems:
        raise LiteVLMError(f"FP8 checkpoint {d} does not match its config and report: " + "; ".join(problems[:12]))
    if tied:
        state["lm_head.weight"] = state["language_model.embed_tokens.weight"]
    model.load_state_dict(state, strict=True, assign=True)
    if tied:
        model.lm_head.weight = model.language_model.embed_tokens.weight
    if dtype is not None:
        model.to(dtype)  # FP8Linear keeps its float8 weights and fp32 scales
    return model.to(device).eval()
