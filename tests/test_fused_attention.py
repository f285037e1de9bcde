"""The CUDA backend's attention on fused kernels (`litevlm.model.attention`): the bias-and-expanded-heads form equals
the boolean mask with grouped-query heads, each step kind is pinned to one fused kernel and refuses the math path, and
the kernels are recorded (on the backend and in the bench's JSON). The CPU twin runs the same choice with the CPU's
fused kernel; the `gpu`-marked tests at the end run it on CUDA."""

import warnings

import pytest
import torch
import torch.nn.functional as F
from test_backend import BUCKETS, cached
from test_spec import assert_greedy_up_to_a_near_tie, assert_reordered_fp32, prompt, random_draft, tiny_vlm
from torch.nn.attention import SDPBackend, sdpa_kernel

from litevlm.errors import LiteVLMError
from litevlm.model import attention
from litevlm.model.attention import FUSED_KERNELS, additive_bias, choose_kernel, fused_attention, fused_kernels
from litevlm.model.backend import CudaBackend, ModulesBackend, tree_mask_over
from litevlm.model.generate import generate
from litevlm.spec import speculative_generate
from litevlm.spec.tree import TreeConfig, ancestor_mask

WIDTH = 128  # a KV bucket
HEADS, KV_HEADS, HEAD_DIM = 8, 2, 16


def qkv(queries: int, device="cpu", dtype=torch.float32, seed: int = 0):
    """q (1, HEADS, queries, D), k / v (1, KV_HEADS, WIDTH, D): random, as a step's attention sees them."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(1, HEADS, queries, HEAD_DIM, generator=g)
    k, v = (torch.randn(1, KV_HEADS, WIDTH, HEAD_DIM, generator=g) for _ in range(2))
    return (t.to(device, dtype) for t in (q, k, v))


def decode_mask(slot: int = 40, device="cpu") -> torch.Tensor:
    """(1, 1, 1, WIDTH): a decode at `slot` sees slots 0..slot of its bucket; the rest is padding."""
    return (torch.arange(WIDTH, device=device) <= slot)[None, None, None]


def tree_mask(start: int = 30, device="cpu") -> torch.Tensor:
    """(1, 1, 5, WIDTH): a five-node tree at slots start.. over the committed slots 0..start-1."""
    parents = torch.tensor([-1, 0, 0, 1, 2])
    return tree_mask_over(ancestor_mask(parents, 2), start, WIDTH).to(device)


MASKS = {"a decode over a padded bucket": decode_mask, "a tree": tree_mask}


def watch_kernel_kv(monkeypatch) -> list:
    """What each SDPA call `fused_attention` makes is handed as K and V: [((K heads, V heads), (K ptr, V ptr))]. A
    K/V the kernel reads where it lies keeps the caller's heads and memory; any copy of repeated heads has neither."""
    seen = []
    real = F.scaled_dot_product_attention

    def sdpa(q, k, v, *args, **kw):
        seen.append(((k.shape[1], v.shape[1]), (k.data_ptr(), v.data_ptr())))
        return real(q, k, v, *args, **kw)

    monkeypatch.setattr(attention.F, "scaled_dot_product_attention", sdpa)
    return seen


@pytest.mark.parametrize("case", list(MASKS))
def test_the_fused_form_equals_the_boolean_mask_with_grouped_heads(case):
    mask = MASKS[case]()
    q, k, v = qkv(mask.shape[2])
    want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    got = fused_attention(q, k, v, additive_bias(mask, q.dtype))
    # The same softmax-weighted sums of the same fp32 terms (a masked key adds an exact 0 either way); the kernels may
    # order the WIDTH-term sums differently, so they agree to fp32 reordering (`assert_reordered_fp32`), far below the
    # O(1) change a wrong mask or a wrong K/V head makes.
    assert_reordered_fp32(got, want, n=WIDTH)
    assert additive_bias(mask, torch.bfloat16).dtype == torch.bfloat16  # the bias takes q's dtype


def test_the_fused_form_of_a_prompt_is_causal_without_a_mask():
    """A prompt over its own keys: no bias, causal (flash's fast path), the K/V heads expanded."""
    q, k, v = qkv(WIDTH)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert_reordered_fp32(fused_attention(q, k, v), want, n=WIDTH)  # as above


@pytest.mark.parametrize("case", list(MASKS))
def test_few_query_rows_fold_their_grouped_heads_and_read_the_kv_uncopied(monkeypatch, case):
    """A decode or a tree attends with the query heads that share a K/V head folded into its rows: the K/V never
    copied (no repeat_interleave), the same attention as the K/V expanded to every head (fp32 reordering). A prompt
    with a bias over as many keys as rows, where the bias's copy would outweigh the K/V's, expands them instead."""
    mask = MASKS[case]()
    q, k, v = qkv(mask.shape[2])
    bias = additive_bias(mask, q.dtype)
    groups = HEADS // KV_HEADS
    expanded = F.scaled_dot_product_attention(
        q, k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1), attn_mask=bias
    )
    kernel_kv = watch_kernel_kv(monkeypatch)
    assert_reordered_fp32(fused_attention(q, k, v, bias), expanded, n=WIDTH)
    # whatever form a copy would take (repeat_interleave, expand + reshape or contiguous, repeat, a cat of heads),
    # the kernel would get new memory of HEADS heads: it gets the caller's own K/V, KV_HEADS heads
    assert kernel_kv == [((KV_HEADS, KV_HEADS), (k.data_ptr(), v.data_ptr()))]
    rows = 4 * HEADS * HEAD_DIM  # past the fold's break-even, 2 H D / G rows
    g = torch.Generator().manual_seed(2)
    q = torch.randn(1, HEADS, rows, HEAD_DIM, generator=g)
    k, v = (torch.randn(1, KV_HEADS, rows, HEAD_DIM, generator=g) for _ in range(2))
    causal = additive_bias(torch.ones(rows, rows, dtype=torch.bool).tril()[None, None], q.dtype)
    want = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    kernel_kv.clear()
    assert_reordered_fp32(fused_attention(q, k, v, causal), want, n=rows)
    ((heads, ptrs),) = kernel_kv
    assert heads == (HEADS, HEADS) and k.data_ptr() not in ptrs  # K and V expanded


def test_no_fused_kernel_list_holds_the_math_path():
    assert all(SDPBackend.MATH not in kernels for kernels in FUSED_KERNELS.values())
    assert FUSED_KERNELS["cpu"] == (SDPBackend.FLASH_ATTENTION,)


@pytest.mark.parametrize("version", [None, 91400, attention.CUDNN_FIRST, 92000])
def test_cudnn_attention_is_offered_only_from_the_release_torch_itself_puts_first(monkeypatch, version):
    """On CUDA, cuDNN attention leads the list only where the installed cuDNN is at least 9.15.1 (torch's own rule for
    putting it first on Hopper); otherwise flash and memory-efficient remain, in that order. The CPU list stays."""
    monkeypatch.setattr(torch.backends.cudnn, "is_available", lambda: version is not None)
    monkeypatch.setattr(torch.backends.cudnn, "version", lambda: version)
    cuda = fused_kernels("cuda")
    if version is not None and version >= attention.CUDNN_FIRST:
        assert cuda == FUSED_KERNELS["cuda"] and cuda[0] == SDPBackend.CUDNN_ATTENTION
    else:
        assert cuda == (SDPBackend.FLASH_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
    assert fused_kernels("cpu") == FUSED_KERNELS["cpu"] and fused_kernels(torch.device("cpu")) == FUSED_KERNELS["cpu"]


def test_a_step_only_the_math_path_runs_is_refused():
    """A query whose last dimension is strided: the CPU's fused kernel refuses it and only the math path would run
    it (checked first), so choosing a kernel for the step raises, naming it, its shapes and the reason."""
    q, k, v = qkv(1)
    q = torch.cat([q, q], -1)[..., ::2]  # (1, H, 1, D), last-dim stride 2
    bias = additive_bias(decode_mask(), q.dtype)
    with sdpa_kernel([SDPBackend.MATH]):
        fused_attention(q, k, v, bias)
    with warnings.catch_warnings(record=True) as why, pytest.raises(RuntimeError):
        warnings.simplefilter("always")
        with sdpa_kernel([SDPBackend.FLASH_ATTENTION]):
            fused_attention(q, k, v, bias)
    assert any("stride 1" in str(w.message) for w in why)
    with pytest.raises(LiteVLMError, match=r"the decode step \(q strided\).*math path is refused.*stride"):
        choose_kernel("decode", lambda: fused_attention(q, k, v, bias), FUSED_KERNELS["cpu"], "q strided")
    q = q.contiguous()  # what the model's steps pass: the CPU's fused kernel takes it
    assert choose_kernel("decode", lambda: fused_attention(q, k, v, bias), FUSED_KERNELS["cpu"], "") is (
        SDPBackend.FLASH_ATTENTION
    )


def test_a_backend_whose_kernels_all_refuse_raises_naming_the_step(monkeypatch):
    """The backend's own choice, at setup: with only kernels the CPU lacks on its list, no step may fall back."""
    monkeypatch.setitem(attention.FUSED_KERNELS, "cpu", (SDPBackend.EFFICIENT_ATTENTION,))
    model = cached(tiny_vlm())
    with pytest.raises(LiteVLMError, match=r"the decode step \(1 queries over 32 keys.*math path is refused"):
        CudaBackend(model, twin=True, **BUCKETS)


def test_a_kernel_that_refuses_a_step_falls_through_to_the_next_on_the_list(monkeypatch):
    """Kernels the CPU lacks (cuDNN, memory-efficient: they refuse every step here) put ahead of its one fused kernel
    on the list: each is tried alone, in order, its refusal passed over, and the step is pinned to flash, the first
    that runs it, whose attention is the boolean mask's with grouped heads. A backend made on that list pins every
    step kind to flash and decodes the modules' tokens, plain and speculative."""
    refusing = (SDPBackend.CUDNN_ATTENTION, SDPBackend.EFFICIENT_ATTENTION)
    kernels = (*refusing, SDPBackend.FLASH_ATTENTION)
    tried, allow = [], attention.sdpa_kernel

    def recording(backends, *args, **kw):
        tried.append(list(backends))
        return allow(backends, *args, **kw)

    monkeypatch.setattr(attention, "sdpa_kernel", recording)
    for case, mask in MASKS.items():
        tried.clear()
        q, k, v = qkv(mask().shape[2])
        bias = additive_bias(mask(), q.dtype)
        kernel = choose_kernel("decode", lambda: fused_attention(q, k, v, bias), kernels, "")
        assert kernel is SDPBackend.FLASH_ATTENTION and tried == [[k] for k in kernels], case
        with sdpa_kernel([kernel]):
            got = fused_attention(q, k, v, bias)
        want = F.scaled_dot_product_attention(q, k, v, attn_mask=mask(), enable_gqa=True)
        assert_reordered_fp32(got, want, n=WIDTH)

    monkeypatch.setitem(attention.FUSED_KERNELS, "cpu", kernels)
    twin, _ = twin_decodes_like_the_modules()
    assert twin.kernels == {"decode": "flash", "verify": "flash", "prefill": "flash"}


def twin_decodes_like_the_modules(before=lambda twin: None):
    """A tiny model with a draft head answered on the modules, then on a cuda-twin made after them (before(twin) run
    on it first): the twin's tokens, plain and speculative, must be the modules' -> (twin, the modules backend)."""
    model = cached(tiny_vlm(vocab=24))
    head = random_draft(model)
    embeds, pos = prompt(model, seed=3)
    tree = TreeConfig(top_k=2, depth=3, total_tokens=6)
    ref = ModulesBackend(model, head)
    with torch.no_grad():
        want = generate(ref, embeds, pos, 40, None).tokens
        want_spec = speculative_generate(ref, head, embeds, pos, 40, None, tree=tree).tokens
    twin = CudaBackend(model, head, tree_nodes=tree.total_tokens, twin=True, **BUCKETS)
    before(twin)
    with torch.no_grad():
        assert generate(twin, embeds, pos, 40, None).tokens == want
        assert speculative_generate(twin, head, embeds, pos, 40, None, tree=tree).tokens == want_spec
    return twin, ref


def test_the_twin_records_its_kernels_and_decodes_like_the_modules():
    """The cuda-twin on the CPU's fused kernel (a math fallback would raise under the pin): the modules' tokens,
    plain and speculative, token for token, and "flash" for every step kind."""

    def before(twin):
        assert twin.kernels == {"decode": "flash", "verify": "flash"}  # the prefill's is chosen on its first prompt

    twin, ref = twin_decodes_like_the_modules(before)
    assert twin.stats["eager_steps"] == 0
    assert twin.kernels == {"decode": "flash", "verify": "flash", "prefill": "flash"}
    assert ref.kernels is None


def test_the_bench_reports_the_attention_kernels(full_model_dir):
    from litevlm.eval.bench import run_bench
    from litevlm.presets import configs_named

    result, _ = run_bench(
        str(full_model_dir),
        n=1,
        warmup=0,
        max_new_tokens=4,
        configs=configs_named("baseline"),
        hf=False,
        progress=False,
        backend="cuda-twin",
    )
    assert result["attention_kernels"] == {"baseline": {"decode": "flash", "prefill": "flash"}}


# ------------------------------------------------------------------------------------------------
# On a GPU
# ------------------------------------------------------------------------------------------------
def on_each_offered_kernel(run) -> dict[SDPBackend, torch.Tensor]:
    """run() with each CUDA kernel a step may be pinned to (`fused_kernels`) allowed alone: its output in fp32 for
    each kernel that takes the inputs (one that refuses them raises, and is left out)."""
    outs = {}
    for kernel in fused_kernels("cuda"):
        try:
            with sdpa_kernel([kernel]):
                outs[kernel] = run().float()
        except RuntimeError:
            continue
    return outs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("case", list(MASKS))
def test_the_fused_form_on_each_cuda_kernel_that_takes_it(case, dtype):
    """Every kernel of the CUDA list that runs the fused form agrees with the boolean mask with grouped heads in fp32
    (the math path, the reference); at least one runs it, and flash (which refuses a bias) never does."""
    mask = MASKS[case]("cuda")
    q, k, v = qkv(mask.shape[2], "cuda", dtype)
    with sdpa_kernel([SDPBackend.MATH]):
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=mask, enable_gqa=True)
    outs = on_each_offered_kernel(lambda: fused_attention(q, k, v, additive_bias(mask, dtype)))
    # fp32: the fused kernels may multiply on tensor cores (TF32-level rounding); bf16: its own rounding of q, k, v
    # and the output. Both far below the O(1) change a wrong mask or K/V head makes.
    tol = 1e-3 if dtype == torch.float32 else 2e-2
    for kernel, got in outs.items():
        assert ((got - want).norm() / want.norm()) < tol, kernel
    assert outs and SDPBackend.FLASH_ATTENTION not in outs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("queries,width", [(1, 256), (1, 3584), (17, 3584)])
def test_every_offered_kernel_attends_like_the_math_path_at_the_2b_shapes(queries, width):
    """A decode (one query) and a 17-node tree over KV buckets of the 2B model (16 query heads and 8 K/V heads of
    128, bf16), the live slots a prefix: each kernel a step may be pinned to here gives the math path's attention."""
    g = torch.Generator().manual_seed(1)
    q = torch.randn(1, 16, queries, 128, generator=g).to("cuda", torch.bfloat16)
    k, v = (torch.randn(1, 8, width, 128, generator=g).to("cuda", torch.bfloat16) for _ in range(2))
    live = width - 77  # padding past the live slots, as a bucket has
    visible = torch.zeros(1, 1, queries, width, dtype=torch.bool, device="cuda")
    visible[..., : live - queries] = True
    visible[0, 0, :, live - queries : live] = torch.ones(queries, queries, dtype=torch.bool, device="cuda").tril()
    with sdpa_kernel([SDPBackend.MATH]):
        want = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=visible, enable_gqa=True)
    outs = on_each_offered_kernel(lambda: fused_attention(q, k, v, additive_bias(visible, q.dtype)))
    for kernel, got in outs.items():
        assert ((got - want).norm() / want.norm()) < 2e-2, kernel
    assert outs


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_the_cuda_backend_records_fused_kernels_and_decodes_like_the_modules(dtype):
    """On the GPU every step kind runs a fused kernel of the list (decode and verification on a bias, so not flash;
    fp32 on memory-efficient, the one that takes it), and the greedy tokens are the modules'."""
    model = tiny_vlm(vocab=24)
    head = random_draft(model)
    embeds, pos = prompt(model, seed=3)
    model = model.to("cuda", dtype)
    model.language_model.setup_cache(1, 96, scratch=8)
    head.to("cuda", dtype)
    embeds, pos = embeds.to("cuda", dtype), pos.cuda()
    tree = TreeConfig(top_k=2, depth=3, total_tokens=6)
    with torch.no_grad():
        want = generate(ModulesBackend(model), embeds, pos, 40, None).tokens
        backend = CudaBackend(model, head, tree.total_tokens, **BUCKETS)
        plain = generate(backend, embeds, pos, 40, None).tokens
        spec = speculative_generate(backend, head, embeds, pos, 40, None, tree=tree).tokens
    if dtype == torch.float32:
        assert plain == want and spec == want
    else:  # bf16: another kernel rounds differently; the answers part, if at all, only at a near tie
        assert_greedy_up_to_a_near_tie(model, embeds, pos, plain, want, margin=0.1, relative=True)  # as in test_backend
        assert_greedy_up_to_a_near_tie(model, embeds, pos, spec, want, margin=0.1, relative=True)
    kernels = backend.kernels
    assert set(kernels) == {"decode", "verify", "prefill"}
    assert set(kernels.values()) <= {"cudnn", "efficient", "flash"}
    assert kernels["decode"] != "flash" and kernels["verify"] != "flash"
    if dtype == torch.float32:
        assert set(kernels.values()) == {"efficient"}
