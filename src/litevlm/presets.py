"""Named pipeline configurations: what `--litevlm` means and the rows of `litevlm bench`.

A preset is a dict of `Pipeline.from_pretrained` options. The paper's ablation rows (arXiv 2506.07416,
Table 1) are presets of one pipeline, so the command line, the bench and the scripts read them from here.
"""

from __future__ import annotations

from litevlm.errors import LiteVLMError

# The execution backends a pipeline can be built on (`litevlm.model.backend.choose_backend`): auto, the modules, the
# native CPU steps, CUDA graphs, and the CUDA backend's mechanisms twinned on the CPU.
BACKENDS = ("auto", "modules", "native", "cuda", "cuda-twin")
GRAPH_BACKENDS = ("cuda", "cuda-twin")  # those that capture decode graphs (on the GPU, or their CPU twin)
# The TokenSelector scores a prompt in about half a decoder layer; pruning half of n visual tokens saves
# n / 2 tokens of the other layers. On drive-tiny (16 tokens a view) that pays from three views on
# (`research/select_threshold.py`), so smaller prompts are not pruned.
LITEVLM_MIN_SELECT_TOKENS = 48
# The full LiteVLM configuration (`--litevlm`); the table's LiteVLM rows add a precision to it.
LITEVLM: dict = {
    "select_views": True,
    "select_tokens": True,  # the fraction r the model's TokenSelector stores as its own (chosen on validation data)
    "min_select_tokens": LITEVLM_MIN_SELECT_TOKENS,
    "speculative": True,
}
CONFIGS: dict[str, dict] = {
    "baseline": {},
    "fastv r=0.7": {"fastv_k": 1, "fastv_r": 0.7},
    "fastv r=0.3": {"fastv_k": 1, "fastv_r": 0.3},
    "eagle": {"speculative": True},
    # LiteVLM without its TokenSelector: what the selector's one decoder layer costs against the
    # prefill it saves depends on how much of the prompt is visual (drive-tiny: 16 tokens a view).
    "views + eagle": {"select_views": True, "speculative": True},
    "litevlm": LITEVLM,
    "litevlm fp8": {**LITEVLM, "fp8": "fp8-dynamic-per-row"},
}
# The CPU's counterpart of the low-precision step, where the CPU multiplies bf16 natively (AMX /
# AVX512-BF16): the vision tower and the prefill in bf16. The baseline gets it too, so the table shows how much
# of the LiteVLM row's gain is precision and how much the techniques.
BF16_CONFIGS: dict[str, dict] = {
    "baseline bf16": {"matmul": "bf16"},
    "litevlm bf16": {**LITEVLM, "matmul": "bf16"},
}
# Rows of the bench that run transformers' `generate` instead of a pipeline.
HF_ROWS = ("transformers eager", "transformers static")
# Rows outside the default table, for ablations by name (`--configs`): LiteVLM without the answer openings its
# draft head verifies inside the prefill (`litevlm.spec.openings`).
ABLATION_CONFIGS: dict[str, dict] = {"litevlm w/o openings": {**LITEVLM, "openings": False}}


def configs_named(names: str) -> dict[str, dict]:
    """The rows named in a comma-separated list (the transformers rows are `hf`'s), in the table's order."""
    known = {**CONFIGS, **BF16_CONFIGS, **ABLATION_CONFIGS}
    wanted = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in wanted if n not in known and n not in HF_ROWS]
    if unknown or not wanted:
        raise LiteVLMError(f"unknown bench rows {unknown}: choose among {', '.join(known)}")
    return {name: cfg for name, cfg in known.items() if name in wanted}
