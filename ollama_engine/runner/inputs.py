"""One position of a sequence: a token, or multimodal data known by its hash (Ollama's input.Input)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any


@dataclass(eq=False, slots=True)
class Input:
    """A single input position.

    Mutable on purpose: the runner queues a placeholder input for the next batch before the token
    is sampled, then fills in `token` once it is known.
    """

    token: int = 0
    # The model's encoding of an image (or other media); opaque to the runner and the input cache.
    multimodal: Any = None
    # Identifies multimodal content for prefix matching; only compared within one process.
    multimodal_hash: int = 0
    # This input and the `same_batch` inputs after it must go into the same forward batch
    # (e.g. all the placeholder tokens of one image).
    same_batch: int = 0
    # On an image view's first input: its rows' positions, for models with multimodal RoPE.
    positions: ViewPositions | None = None


@dataclass(frozen=True, slots=True)
class ViewPositions:
    """The position components (time, height, width, spare) of an image view's rows, relative to the text
    position where its image begins, and how far the text position moves after the view: the image's
    extent on its last view, 0 on the others (llama.cpp's mtmd_image_tokens_get_n_pos)."""

    offsets: Any  # (rows, 4) int32
    advance: int


def kept_together(inputs: Sequence[Input], i: int) -> int:
    """How many inputs after inputs[i] must stay in the context with it (0: none): its same-batch group, and
    for an image the runs that continue it, each first input carrying the same image's embeddings (its views
    when it is longer than a batch, Llama 4's further tiles). Truncation and shifts keep them whole."""
    head = inputs[i]
    end = i + head.same_batch
    if head.multimodal is not None and head.multimodal_hash:
        while (end + 1 < len(inputs) and inputs[end + 1].multimodal is not None
               and inputs[end + 1].multimodal_hash == head.multimodal_hash):
            end += 1 + inputs[end + 1].same_batch
    return end - i


def group_boundary(inputs: Sequence[Input], num_keep: int) -> int:
    """num_keep, or the start of the same-batch group (or image: kept_together) it would end inside of."""
    for i in range(min(num_keep, len(inputs))):
        span = kept_together(inputs, i)
        if span and i + span >= num_keep:
            return i
    return num_keep
