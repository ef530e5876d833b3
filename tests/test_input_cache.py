"""The runner's input cache: ports of Ollama's runner/ollamarunner/cache_test.go, plus its KV-cache calls."""

import time

import pytest

from ollama_engine.runner.inputs import Input
from ollama_engine.runner.prompt_cache import (
    TO_END,
    InputCache,
    InputCacheSlot,
    ReprocessInputsError,
    count_common_prefix,
)


class FakeShiftError(Exception):
    """Stands in for the KV cache's "cannot remove part of this sequence" error."""


class RecordingKVCache:
    """Implements the KVCache protocol by recording calls; can be told to refuse removals."""

    def __init__(self, fail_partial: bool = False, fail_all: bool = False, resumable: bool = True) -> None:
        self.fail_partial = fail_partial
        self.fail_all = fail_all
        self.resumable = resumable
        self.calls: list[tuple] = []

    def remove(self, seq: int, begin: int, end: int) -> None:
        self.calls.append(("remove", seq, begin, end))
        if self.fail_all or (self.fail_partial and (begin, end) != (0, TO_END)):
            raise FakeShiftError("shifting cells shared by multiple sequences not supported")

    def copy_prefix(self, src_seq: int, dst_seq: int, length: int) -> None:
        self.calls.append(("copy_prefix", src_seq, dst_seq, length))

    def can_resume(self, seq: int, pos: int) -> bool:
        self.calls.append(("can_resume", seq, pos))
        return self.resumable


def toks(*ids: int) -> list[Input]:
    return [Input(token=i) for i in ids]


def image(hash_: int) -> Input:
    return Input(multimodal=f"embedding {hash_}", multimodal_hash=hash_)


def tokens_of(inputs: list[Input]) -> list[int]:
    return [inp.token for inp in inputs]


def ago(seconds: float) -> float:
    return time.monotonic() - seconds


NEVER = 0.0


def make_cache(
    slots: list[tuple[list[Input], float, bool]],
    multi_user: bool = False,
    kv_cache: RecordingKVCache | None = None,
    num_ctx: int = 2048,
) -> InputCache:
    """A cache whose slots hold the given (inputs, last_used, in_use), like Ollama's struct literals."""
    cache = InputCache(
        kv_cache, num_ctx * len(slots), len(slots), 1, multi_user=multi_user, remove_errors=FakeShiftError
    )
    for slot, (inputs, last_used, in_use) in zip(cache.slots, slots, strict=True):
        slot.inputs, slot.last_used, slot.in_use = list(inputs), last_used, in_use
    return cache


# --- TestCountCommon ---------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("a", "b", "expected"),
    [
        pytest.param(toks(1, 2, 3), toks(1, 2, 3), 3, id="Equal"),
        pytest.param(toks(1), toks(1, 2, 3), 1, id="Prefix"),
        pytest.param([image(1)], [image(1), image(2), image(3)], 1, id="Image Prefix"),
        pytest.param([Input(token=1), image(1)], [Input(token=1), image(1), Input(token=5)], 2, id="Mixed"),
        pytest.param([Input(token=1), image(1)], [Input(token=1), image(2)], 1, id="Mixed, Same Length"),
        pytest.param([], toks(1, 2, 3), 0, id="Empty"),
        pytest.param([], [], 0, id="Both Empty"),
    ],
)
def test_count_common_prefix(a, b, expected):
    assert count_common_prefix(a, b) == expected


# --- TestFindCacheSlot -------------------------------------------------------------------------

# slot 0, slot 1 as (inputs, last_used, in_use); prompt; (id, length) for longest and best
S = False  # a free slot
U = True  # a slot in use
FIND_SLOT_CASES = [
    pytest.param(([], NEVER, S), ([], NEVER, S), toks(1), (0, 0), (0, 0), id="Empty"),
    pytest.param((toks(1), ago(1), S), (toks(1, 2), ago(2), S), toks(1, 2), (1, 2), (1, 2), id="Extend"),
    pytest.param((toks(1, 2), ago(1), S), ([], NEVER, S), toks(2), (0, 0), (1, 0), id="New"),
    pytest.param((toks(1, 2), ago(1), S), ([], NEVER, S), toks(1), (0, 1), (1, 1), id="Fork"),
    pytest.param((toks(1), ago(1), S), (toks(1, 2), ago(2), S), toks(2, 3), (0, 0), (1, 0), id="Evict"),
    pytest.param((toks(1, 2), ago(1), U), (toks(1), ago(2), S), toks(1, 2), (1, 1), (1, 2), id="In use"),
]


@pytest.mark.parametrize(("slot0", "slot1", "prompt", "longest", "best"), FIND_SLOT_CASES)
def test_find_longest_slot(slot0, slot1, prompt, longest, best):
    slot, length = make_cache([slot0, slot1]).find_longest_slot(prompt)
    assert (slot.id, length) == longest


@pytest.mark.parametrize(("slot0", "slot1", "prompt", "longest", "best"), FIND_SLOT_CASES)
def test_find_best_slot(slot0, slot1, prompt, longest, best):
    slot, length = make_cache([slot0, slot1], multi_user=True).find_best_slot(prompt)
    assert (slot.id, length) == best


def test_find_slot_none_free():
    cache = make_cache([(toks(1, 2), ago(1), True), (toks(3), ago(2), True)])
    with pytest.raises(RuntimeError, match="^no available cache slots$"):
        cache.find_longest_slot(toks(1, 2))
    with pytest.raises(RuntimeError, match="^no available cache slots$"):
        cache.find_best_slot(toks(1, 2))


def test_best_slot_forks_prefix_into_lru_slot():
    kv = RecordingKVCache()
    slots = [(toks(1, 2, 3), ago(1), False), (toks(9), ago(5), False)]
    cache = make_cache(slots, multi_user=True, kv_cache=kv)
    slot, length = cache.find_best_slot(toks(1, 2, 7))
    assert (slot.id, length) == (1, 2)
    assert kv.calls == [("copy_prefix", 0, 1, 2)]
    assert tokens_of(cache.slots[1].inputs) == [1, 2]
    assert tokens_of(cache.slots[0].inputs) == [1, 2, 3], "the source slot keeps its conversation"


def test_best_slot_evicts_least_recently_used():
    cache = make_cache(
        [(toks(5), ago(3), False), (toks(6), ago(9), False), (toks(7), ago(1), False)], multi_user=True
    )
    slot, length = cache.find_best_slot(toks(8))
    assert (slot.id, length) == (1, 0)


# --- TestShiftDiscard --------------------------------------------------------------------------

def inputs_with_groups(count: int, groups: dict[int, int]) -> list[Input]:
    return [Input(token=i, same_batch=groups.get(i, 0)) for i in range(count)]


@pytest.mark.parametrize(
    ("num_ctx", "num_keep", "inputs", "expected"),
    [
        pytest.param(2048, 5, inputs_with_groups(2048, {}), 1021, id="Shift"),
        pytest.param(2048, 2047, inputs_with_groups(2048, {}), 1, id="Max Keep"),
        pytest.param(2048, 0, inputs_with_groups(2048, {}), 1024, id="No Keep"),
        pytest.param(2048, 5, inputs_with_groups(5000, {}), 3973, id="Truncate"),
        pytest.param(2048, 2047, inputs_with_groups(5000, {}), 2953, id="Truncate Keep"),
        pytest.param(2048, 5, inputs_with_groups(512, {}), 0, id="No Op"),
        pytest.param(2048, 5, inputs_with_groups(2048, {1024: 511}), 1531, id="Same Batch"),
        pytest.param(2048, 5, inputs_with_groups(2048, {10: 511}), 1021, id="Same Batch Near Start"),
        pytest.param(
            32, 0, inputs_with_groups(32, {0: 9, 10: 9, 20: 9, 30: 9}), 20, id="Consecutive Same Batch"
        ),
        pytest.param(32, 0, inputs_with_groups(32, {4: 9, 8: 9, 14: 9}), 24, id="Overlapping Same Batch"),
    ],
)
def test_shift_discard(num_ctx, num_keep, inputs, expected):
    cache = InputCache(None, num_ctx, 1, 1, multi_user=False, remove_errors=FakeShiftError)
    assert cache.shift_discard(inputs, num_keep) == expected


# --- TestLoadCacheSlot -------------------------------------------------------------------------

@pytest.mark.parametrize(
    ("slots", "multi_user", "prompt", "slot_id", "remaining"),
    [
        pytest.param([(toks(1, 2), ago(1), False), ([], ago(2), False)], False, toks(1, 2, 3), 0, [3],
                     id="Basic cache hit - single user"),
        pytest.param([(toks(1, 2), ago(1), False), ([], ago(2), False)], True, toks(1, 2, 3), 0, [3],
                     id="Basic cache hit - multi user"),
        pytest.param([(toks(1, 2), ago(1), False)], False, toks(1, 2), 0, [2],
                     id="Exact match - leave one input"),
    ],
)
def test_load_slot(slots, multi_user, prompt, slot_id, remaining):
    cache = make_cache(slots, multi_user=multi_user)
    slot, rest = cache.load_slot(prompt, cache_prompt=True)
    assert slot.id == slot_id
    assert slot.in_use
    assert tokens_of(rest) == remaining
    assert slot.inputs + rest == prompt, "the slot records what the KV cache keeps; the rest is evaluated"


def test_load_slot_no_available_slots():
    cache = make_cache([(toks(1, 2), ago(1), True)])
    with pytest.raises(RuntimeError, match="^no available cache slots$"):
        cache.load_slot(toks(1, 2, 3), cache_prompt=True)


def test_load_slot_trims_kv_cache_after_shared_prefix():
    kv = RecordingKVCache()
    cache = make_cache([(toks(1, 2, 3, 4), ago(1), False)], kv_cache=kv)
    slot, rest = cache.load_slot(toks(1, 2, 9), cache_prompt=True)
    assert kv.calls == [("can_resume", 0, 2), ("remove", 0, 2, TO_END)]
    assert tokens_of(slot.inputs) == [1, 2]
    assert tokens_of(rest) == [9]
    assert slot.last_used > ago(1)


def test_load_slot_without_prompt_caching_starts_over():
    kv = RecordingKVCache()
    cache = make_cache([(toks(1, 2, 3), ago(1), False)], kv_cache=kv)
    slot, rest = cache.load_slot(toks(1, 2, 3, 4), cache_prompt=False)
    assert kv.calls == [("remove", 0, 0, TO_END)]
    assert slot.inputs == []
    assert tokens_of(rest) == [1, 2, 3, 4]


def test_load_slot_that_cannot_resume_starts_over():
    kv = RecordingKVCache(resumable=False)
    cache = make_cache([(toks(1, 2, 3), ago(1), False)], kv_cache=kv)
    slot, rest = cache.load_slot(toks(1, 2, 3, 4), cache_prompt=True)
    assert kv.calls == [("can_resume", 0, 3), ("remove", 0, 0, TO_END)]
    assert tokens_of(rest) == [1, 2, 3, 4]


def test_load_slot_falls_back_to_clearing_when_partial_removal_fails():
    kv = RecordingKVCache(fail_partial=True)
    cache = make_cache([(toks(1, 2, 3), ago(1), False)], kv_cache=kv)
    slot, rest = cache.load_slot(toks(1, 2, 5), cache_prompt=True)
    assert kv.calls == [("can_resume", 0, 2), ("remove", 0, 2, TO_END), ("remove", 0, 0, TO_END)]
    assert slot.inputs == []
    assert tokens_of(rest) == [1, 2, 5]


def test_load_slot_propagates_failure_to_clear():
    cache = make_cache([(toks(1, 2, 3), ago(1), False)], kv_cache=RecordingKVCache(fail_all=True))
    with pytest.raises(FakeShiftError):
        cache.load_slot(toks(1, 2, 5), cache_prompt=True)


def test_load_slot_multi_user_forks_then_trims():
    kv = RecordingKVCache()
    cache = make_cache([(toks(1, 2, 3), ago(1), False), ([], NEVER, False)], multi_user=True, kv_cache=kv)
    slot, rest = cache.load_slot(toks(1, 2, 8), cache_prompt=True)
    assert slot.id == 1
    assert kv.calls == [("copy_prefix", 0, 1, 2), ("can_resume", 1, 2), ("remove", 1, 2, TO_END)]
    assert tokens_of(rest) == [8]
    assert tokens_of(cache.slots[0].inputs) == [1, 2, 3]


def test_load_slot_multi_user_reuses_lru_slot_without_forking_it_into_itself():
    kv = RecordingKVCache()
    slots = [(toks(1, 2, 3), ago(5), False), (toks(9), ago(1), False)]
    cache = make_cache(slots, multi_user=True, kv_cache=kv)
    slot, rest = cache.load_slot(toks(1, 2, 7), cache_prompt=True)
    assert slot.id == 0
    assert kv.calls == [("can_resume", 0, 2), ("remove", 0, 2, TO_END)]
    assert tokens_of(rest) == [7]


def test_load_slot_rejects_empty_prompt():
    with pytest.raises(ValueError, match="no input provided"):
        make_cache([([], NEVER, False)]).load_slot([], cache_prompt=True)


# --- TestShiftCacheSlot ------------------------------------------------------------------------

def shift_cache(kv: RecordingKVCache | None) -> tuple[InputCache, InputCacheSlot]:
    cache = InputCache(kv, 10, 1, 1, multi_user=False, remove_errors=FakeShiftError)
    slot = cache.slots[0]
    slot.inputs = toks(*range(1, 11))
    return cache, slot


def test_shift_slot():
    kv = RecordingKVCache()
    cache, slot = shift_cache(kv)
    cache.shift_slot(slot, 2)
    assert kv.calls == [("remove", 0, 2, 6)]
    assert tokens_of(slot.inputs) == [1, 2, 7, 8, 9, 10]


def test_shift_slot_when_cache_cannot_shift():
    kv = RecordingKVCache(fail_partial=True)
    cache, slot = shift_cache(kv)
    with pytest.raises(ReprocessInputsError) as err:
        cache.shift_slot(slot, 2)
    assert str(err.value) == "kv cache shift not supported, inputs need reprocessing (input count: 6)"
    assert tokens_of(err.value.inputs) == [1, 2, 7, 8, 9, 10]
    assert slot.inputs == []
    assert kv.calls == [("remove", 0, 2, 6), ("remove", 0, 0, TO_END)]


def test_shift_slot_when_every_removal_fails():
    """Go's "cache removal fails" case: its mock fails every Remove, and Go ignores the failure to clear.

    We do not: a cache that can neither shift nor clear a sequence still holds its cells, so the error
    goes to the caller and the slot keeps the record of what the cache holds.
    """
    kv = RecordingKVCache(fail_all=True)
    cache, slot = shift_cache(kv)
    with pytest.raises(FakeShiftError):
        cache.shift_slot(slot, 2)
    assert kv.calls == [("remove", 0, 2, 6), ("remove", 0, 0, TO_END)]
    assert tokens_of(slot.inputs) == list(range(1, 11))


def test_shift_slot_without_kv_cache_trims_the_record():
    cache, slot = shift_cache(None)
    cache.shift_slot(slot, 2)
    assert tokens_of(slot.inputs) == [1, 2, 7, 8, 9, 10]


def test_shift_slot_with_room_does_nothing():
    kv = RecordingKVCache()
    cache, slot = shift_cache(kv)
    slot.inputs = toks(1, 2, 3)
    cache.shift_slot(slot, 2)
    assert kv.calls == []
    assert tokens_of(slot.inputs) == [1, 2, 3]


def test_shift_slot_keep_exceeds_context():
    cache, slot = shift_cache(RecordingKVCache())
    message = r"^unable to shift context - keep exceeds context \(keep: 10 context: 10\)$"
    with pytest.raises(ValueError, match=message):
        cache.shift_slot(slot, 10)


def test_shift_slot_does_not_swallow_other_errors():
    class BrokenKVCache(RecordingKVCache):
        def remove(self, seq: int, begin: int, end: int) -> None:
            raise IndexError("bug in the kv cache")

    cache, slot = shift_cache(BrokenKVCache())
    with pytest.raises(IndexError):
        cache.shift_slot(slot, 2)


# --- Construction ------------------------------------------------------------------------------

def test_construction():
    cache = InputCache(RecordingKVCache(), 4096, 4, 512, multi_user=True, remove_errors=FakeShiftError)
    assert cache.num_ctx == 1024
    assert [slot.id for slot in cache.slots] == [0, 1, 2, 3]
    assert cache.enabled
    assert not InputCache(None, 4096, 4, 512, multi_user=False, remove_errors=FakeShiftError).enabled


def test_construction_kv_smaller_than_batch_per_slot():
    message = "kv size must be at least as large as batch size * parallel (kv: 2048 batch: 512 parallel: 8)"
    with pytest.raises(ValueError) as err:
        InputCache(None, 2048, 8, 512, multi_user=False, remove_errors=FakeShiftError)
    assert str(err.value) == message


def test_construction_needs_a_slot():
    with pytest.raises(ValueError, match="parallel must be at least 1"):
        InputCache(None, 2048, 0, 512, multi_user=False, remove_errors=FakeShiftError)
