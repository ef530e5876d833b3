"""The runner's prompt cache (Ollama's runner/ollamarunner/cache.go).

Each slot is one sequence of the model's KV cache, and `slot.inputs` records exactly which inputs
that sequence holds, position by position. A new prompt is given the slot whose record shares the
longest prefix with it, so only the rest of the prompt has to be evaluated. Whenever KV entries are
removed or shifted here, the slot's record is trimmed the same way: if the two ever disagree, the
model silently attends to the wrong history, so that is the first thing to check when prompt
caching misbehaves (DEBUG logging of this module shows every load, fork, eviction and shift).

Exact reuse (the default, OLLAMA_ENGINE_EXACT_CACHE): a prompt reuses only cached inputs computed as a
cold run computes them, so that a cache hit answers bitwise as a cold run does (see runner/exact.py).
A hybrid's recurrent states continue only where a checkpoint is: the cache is told where a later prompt
extending a prompt will resume (its `resume_rule`), and keeps checkpoints there.
"""

import logging
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Protocol

from ollama_engine.runner.exact import extension_resumes, resume_point, row_kernels
from ollama_engine.runner.inputs import Input, group_boundary, kept_together

log = logging.getLogger(__name__)

TO_END = sys.maxsize
"""The `end` to pass to KVCache.remove for "through the last position" (nothing is shifted then)."""


class KVCache(Protocol):
    """What the input cache needs from the model's KV cache (ollama_engine.kvcache)."""

    def remove(self, seq: int, begin: int, end: int) -> None:
        """Drop positions [begin, end) of seq; with a finite end, later positions move down to begin.

        Raises when it cannot (cells shared with another sequence, a model that cannot shift);
        remove(seq, 0, TO_END) must always succeed.
        """

    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        """Make dst_seq hold positions [0, length) of src_seq instead of what it held."""

    def can_resume(self, seq: int, pos: int) -> bool:
        """Whether seq still holds what continuing at pos needs (a sliding window may have dropped it)."""


@dataclass
class InputCacheSlot:
    id: int
    """The KV-cache sequence this slot owns."""
    inputs: list[Input] = field(default_factory=list)
    """What that sequence holds, position by position."""
    in_use: bool = False
    last_used: float = 0.0
    """time.monotonic() when a prompt last loaded this slot; 0.0 if never."""
    kernels: bytearray = field(default_factory=bytearray)
    """The kernel class that computed each input (runner/exact.py), as far as recorded."""


class ReprocessInputsError(Exception):
    """The KV cache could not shift, so the slot was cleared; its surviving inputs must be evaluated again."""

    def __init__(self, inputs: list[Input]) -> None:
        super().__init__(
            f"kv cache shift not supported, inputs need reprocessing (input count: {len(inputs)})"
        )
        self.inputs = inputs


def count_common_prefix(a: Sequence[Input], b: Sequence[Input]) -> int:
    """How many leading inputs agree; multimodal inputs match by hash, since their token is a placeholder."""
    count = 0
    for x, y in zip(a, b, strict=False):
        if x.token != y.token or x.multimodal_hash != y.multimodal_hash:
            break
        count += 1
    return count


class InputCache:
    """The slots of one runner, and how prompts are matched to them and how full slots are shifted.

    `kv_cache` is None for models without one (e.g. plain embedding models): then only the records
    are kept, and `enabled` tells the runner to send the whole history with every batch.
    `multi_user` is OLLAMA_MULTIUSER_CACHE: reuse least-recently-used slots and fork shared prefixes
    rather than always extending the slot with the longest match.
    `remove_errors` are the exceptions kv_cache.remove raises when it cannot remove part of a
    sequence; the slot is then cleared and its inputs evaluated again.
    """

    def __init__(
        self,
        kv_cache: KVCache | None,
        kv_size: int,
        num_slots: int,
        batch_size: int,
        *,
        multi_user: bool,
        remove_errors: type[Exception] | tuple[type[Exception], ...],
        exact: bool = False,
    ) -> None:
        if num_slots < 1:
            raise ValueError(f"parallel must be at least 1 (parallel: {num_slots})")
        num_ctx = kv_size // num_slots
        if num_ctx < batch_size:
            raise ValueError(
                "kv size must be at least as large as batch size * parallel "
                f"(kv: {kv_size} batch: {batch_size} parallel: {num_slots})"
            )
        self.num_ctx = num_ctx
        """Context length of each slot."""
        self.slots = [InputCacheSlot(id=i) for i in range(num_slots)]
        self.multi_user = multi_user
        self.exact = exact
        """Reuse only what a cold run would compute alike (OLLAMA_ENGINE_EXACT_CACHE)."""
        self.batch_size = batch_size
        self.kv_cache = kv_cache
        self._remove_errors = remove_errors
        if hasattr(kv_cache, "resume_rule"):  # kvcache.Recurrent
            kv_cache.resume_rule = self.extension_resumes

    def extension_resumes(self, length: int, first: int, row: int, batch_rows: int) -> tuple[int, ...]:
        """Where a later prompt extending a `length`-input one (its last batch: positions first.. in rows row..
        of batch_rows) may resume: under exact reuse the points runner/exact.py would choose; otherwise the
        prompt's end, where a checkpoint is anyway."""
        return extension_resumes(length, self.batch_size, first, row, batch_rows) if self.exact else ()

    @property
    def enabled(self) -> bool:
        """Whether evaluated inputs stay cached between batches."""
        return self.kv_cache is not None

    def load_slot(self, prompt: list[Input], cache_prompt: bool) -> tuple[InputCacheSlot, list[Input]]:
        """Claim a slot for a new sequence; returns it and the part of the prompt still to evaluate."""
        if not prompt:
            raise ValueError("no input provided")
        if self.multi_user:
            slot, num_past = self.find_best_slot(prompt)
        else:
            slot, num_past = self.find_longest_slot(prompt)
        if not cache_prompt:
            num_past = 0
        if num_past == len(prompt):
            # Evaluate the last input again: its output gives the logits for the first new token.
            num_past -= 1
        if self.exact:
            num_past = resume_point(slot.kernels, num_past, len(prompt), self.batch_size)
        num_past = group_boundary(prompt, num_past)  # never inside an image: its rows are evaluated together

        if self.kv_cache is not None:
            num_past = self._resumable(slot, num_past, len(prompt))
            try:
                self.kv_cache.remove(slot.id, num_past, TO_END)
            except self._remove_errors as err:
                log.debug("partial removal failed, clearing cache slot %d: %s", slot.id, err)
                self.kv_cache.remove(slot.id, 0, TO_END)
                num_past = 0

        log.debug(
            "loading cache slot %d: cached %d, prompt %d, used %d, remaining %d",
            slot.id, len(slot.inputs), len(prompt), num_past, len(prompt) - num_past,
        )
        slot.inputs = prompt[:num_past]
        del slot.kernels[num_past:]
        slot.in_use = True
        slot.last_used = time.monotonic()
        return slot, prompt[num_past:]

    def _resumable(self, slot: InputCacheSlot, num_past: int, length: int) -> int:
        """num_past, or the nearest earlier position the KV cache can continue from, or 0.

        A cache with recurrent layers (kvcache.Recurrent) continues only where its state is or just after
        one of its state checkpoints, which its optional resume_position(seq, pos) finds.
        """
        nearest = getattr(self.kv_cache, "resume_position", None)
        while num_past > 0 and not self.kv_cache.can_resume(slot.id, num_past):
            earlier = nearest(slot.id, num_past) if nearest is not None else 0
            if self.exact:
                earlier = resume_point(slot.kernels, earlier, length, self.batch_size)
            if earlier >= num_past:
                return 0
            num_past = earlier
        return num_past

    def chunk_limit(self, position: int) -> int:
        """How many prompt inputs from `position` one batch takes: exact reuse cuts at multiples of
        batch_size, as a cold run does."""
        return self.batch_size - position % self.batch_size if self.exact else self.batch_size

    def record_rows(self, slot: InputCacheSlot, begin: int, rows: Sequence[int], batch_rows: int) -> None:
        """The inputs from position `begin` on were computed in rows `rows` of a batch of `batch_rows`."""
        del slot.kernels[begin:]
        slot.kernels.extend(bytes(begin - len(slot.kernels)))  # positions never recorded: unknown
        slot.kernels.extend(row_kernels(rows, batch_rows, len(rows)))

    def find_longest_slot(self, prompt: Sequence[Input]) -> tuple[InputCacheSlot, int]:
        """The free slot sharing the longest prefix with prompt (the first one on ties), and that length.

        Single-user mode: few slots ever hold data, which keeps the KV cache small and fast.
        """
        best: InputCacheSlot | None = None
        longest = -1
        for slot in self.slots:
            if slot.in_use:
                continue
            count = count_common_prefix(slot.inputs, prompt)
            if count > longest:
                best, longest = slot, count
        if best is None:
            raise RuntimeError("no available cache slots")
        return best, longest

    def find_best_slot(self, prompt: Sequence[Input]) -> tuple[InputCacheSlot, int]:
        """Multi-user mode: extend a slot only if the prompt continues all of it, otherwise take the
        least recently used free slot, first copying in the longest matching prefix found in any slot.

        That keeps other users' conversations cached instead of overwriting them, at the cost of a
        larger KV cache.
        """
        counts = [count_common_prefix(slot.inputs, prompt) for slot in self.slots]
        longest = max(counts)
        longest_slot = self.slots[counts.index(longest)]
        if longest == len(longest_slot.inputs) and not longest_slot.in_use:
            return longest_slot, longest

        free = [slot for slot in self.slots if not slot.in_use]
        if not free:
            raise RuntimeError("no available cache slots")
        oldest = min(free, key=lambda slot: slot.last_used)
        if oldest.inputs:
            log.debug("evicting cache slot %d: %d inputs", oldest.id, len(oldest.inputs))

        if longest > 0 and longest_slot is not oldest:
            log.debug(
                "forking cache slot %d into %d: %d of %d inputs",
                longest_slot.id, oldest.id, longest, len(longest_slot.inputs),
            )
            oldest.inputs = longest_slot.inputs[:longest]
            oldest.kernels = longest_slot.kernels[:longest]
            if self.kv_cache is not None:
                self.kv_cache.copy_prefix(longest_slot.id, oldest.id, longest)
        return oldest, longest

    def shift_discard(self, inputs: Sequence[Input], num_keep: int) -> int:
        """How many inputs after the first num_keep to drop so that about half the free context is free.

        A same-batch group (e.g. an image, with all its views: kept_together) is dropped whole or not at all,
        since part of one cannot be evaluated again on its own.
        """
        target_free = max((self.num_ctx - num_keep) // 2, 1)
        current_free = self.num_ctx - len(inputs)
        discard = 0
        group_left = 0  # inputs of the current same-batch group still to drop
        for i in range(num_keep, len(inputs)):
            if group_left <= 0 and current_free >= target_free:
                break
            group_left -= 1
            current_free += 1
            discard += 1
            span = kept_together(inputs, i)
            if span > 0:
                group_left = span
        return discard

    def shift_slot(self, slot: InputCacheSlot, num_keep: int) -> None:
        """Make room in a full slot: drop the oldest inputs after the first num_keep and move the rest down.

        Raises ReprocessInputsError, after clearing the slot, when the KV cache cannot shift.
        """
        if num_keep >= self.num_ctx:
            raise ValueError(
                f"unable to shift context - keep exceeds context (keep: {num_keep} context: {self.num_ctx})"
            )
        discard = self.shift_discard(slot.inputs, num_keep)
        if discard <= 0:
            return
        log.debug(
            "context limit hit - shifting slot %d: limit %d, inputs %d, keep %d, discard %d",
            slot.id, self.num_ctx, len(slot.inputs), num_keep, discard,
        )
        kept = slot.inputs[:num_keep] + slot.inputs[num_keep + discard :]
        del slot.kernels[num_keep:]  # the moved keys were rotated again: no cold run has them
        if self.kv_cache is not None:
            try:
                self.kv_cache.remove(slot.id, num_keep, num_keep + discard)
            except self._remove_errors as err:
                log.debug("kv cache shift failed, clearing slot %d for reprocessing: %s", slot.id, err)
                self.kv_cache.remove(slot.id, 0, TO_END)
                slot.inputs, slot.kernels = [], bytearray()
                raise ReprocessInputsError(kept) from err
        slot.inputs = kept
