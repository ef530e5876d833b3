"""One position of a sequence: a token, or multimodal data known by its hash (Ollama's input.Input)."""

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
