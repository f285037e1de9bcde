"""EAGLE-2 speculative decoding: the draft head, the dynamic draft tree, the decode loop."""

from litevlm.models import DRAFT_SUBDIR, draft_dir
from litevlm.spec.decode import speculative_generate
from litevlm.spec.draft import DraftConfig, DraftHead
from litevlm.spec.tree import (
    Tree,
    TreeConfig,
    accept_greedy,
    accept_sampled,
    ancestor_mask,
    commit_path,
    draft_tree,
    target_probs,
    tree_from_pool,
    verify_tree,
)

__all__ = [
    "DRAFT_SUBDIR",
    "DraftConfig",
    "DraftHead",
    "Tree",
    "TreeConfig",
    "accept_greedy",
    "accept_sampled",
    "ancestor_mask",
    "commit_path",
    "draft_dir",
    "draft_tree",
    "speculative_generate",
    "target_probs",
    "tree_from_pool",
    "verify_tree",
]
