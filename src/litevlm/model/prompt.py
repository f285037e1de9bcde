"""Multimodal prompt assembly in InternVL's chat format, one image block per camera view.

    <|im_start|>user\n
    CAM_FRONT: <img><IMG_CONTEXT> x n</img>\n        (one line per kept view, in the given order)
    ...
    {question}<|im_end|>\n<|im_start|>assistant\n

The camera marker before each block tells the model which view it is looking at, so a pruned set
of views (view selection) still reads unambiguously. The same layout works for drive-tiny's
tokenizer and for InternVL checkpoints that bring their own (`<img>`, `</img>`, `<IMG_CONTEXT>`,
`<|im_start|>`, `<|im_end|>` are InternVL's own special tokens).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class PromptLayout:
    ids: list[int]
    # (camera, first placeholder index, one past the last) for each view, in prompt order
    view_spans: list[tuple[str, int, int]]


def view_prefix(tokenizer, views: list[str], tokens_per_view: int) -> PromptLayout:
    """The user turn up to the question: the view blocks with their camera markers."""
    ids = [tokenizer.im_start_id] + tokenizer.encode("user\n")
    spans = []
    for cam in views:
        ids += tokenizer.encode(f"{cam}: ") + [tokenizer.img_start_id]
        spans.append((cam, len(ids), len(ids) + tokens_per_view))
        ids += [tokenizer.image_id] * tokens_per_view + [tokenizer.img_end_id] + tokenizer.encode("\n")
    return PromptLayout(ids, spans)


def question_suffix(tokenizer, question_ids: list[int]) -> list[int]:
    """The question, the end of the user turn and the start of the assistant's."""
    return (
        question_ids
        + [tokenizer.eos_id]
        + tokenizer.encode("\n")
        + [tokenizer.im_start_id]
        + tokenizer.encode("assistant\n")
    )


def build_prompt(tokenizer, question: str, views: list[str], tokens_per_view: int) -> PromptLayout:
    layout = view_prefix(tokenizer, views, tokens_per_view)
    layout.ids += question_suffix(tokenizer, tokenizer.encode(question))
    return layout
