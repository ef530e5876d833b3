"""kvcache.Recurrent: forks, divergence, checkpoints, rollback, eviction and shifts, on a real hybrid model.

Each test drives the cache of the tiny-lfm2 model (short convolutions and attention, Q8_0: its rows are
computed alike in batches of any size) and compares the logits a sequence gets after a fork, a rollback
or a prompt-cache hit with those of a fresh sequence fed the same tokens in the same chunks: bitwise.
The bookkeeping tests port Ollama's kvcache/recurrent_checkpoints_test.go where its behaviour is ours
(best checkpoint below a target, the ring keeping the newest, pruning after a restore, no checkpoints);
its "remove in the middle shifts the checkpoints" is deliberately not ours: a shift is refused.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from synthetic.models import write_synthetic

from ollama_engine.kvcache import Batch, Recurrent, ShiftError, StateError, cache_dtype
from ollama_engine.models import load_model
from ollama_engine.runner.inputs import Input
from ollama_engine.runner.prompt_cache import TO_END, InputCache, ReprocessInputsError

A = [int(t) for t in np.random.default_rng(1).integers(100, 5000, 40)]  # token ids of the gpt-2 vocabulary
B = [int(t) for t in np.random.default_rng(2).integers(100, 5000, 40)]


@pytest.fixture(scope="module")
def path(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_synthetic(tmp_path_factory.mktemp("recurrent") / "lfm2.gguf", "lfm2", weight_type="Q8_0")


@pytest.fixture
def hybrid(path):
    """Open the model with a Recurrent cache of the given options for `sequences` sequences (contexts of 64)."""
    models = []

    def open_model(sequences: int = 3, **options: int):
        model = load_model(path, num_threads=1)
        models.append(model)
        model.cache = Recurrent(model.shift, model.cache.state_sizes, **options)
        model.backend.load()
        model.cache.init(model.backend, cache_dtype("f16"), sequences, 64, 16)
        return model

    yield open_model
    for model in models:
        model.close()


def feed(model, seq: int, tokens: list[int], start: int, chunk: int = 64) -> np.ndarray:
    """Feed tokens to seq from position start, `chunk` at a time, as the runner feeds a prompt (only its
    last row asks for logits); the logits after the last token."""
    for begin in range(0, len(tokens), chunk):
        part = tokens[begin:begin + chunk]
        last = begin + len(part) == len(tokens)
        logits = model.graphs.compute(Batch(positions=range(start + begin, start + begin + len(part)),
                                            sequences=[seq] * len(part), outputs=[len(part) - 1] if last else [],
                                            tokens=part))
    return logits[0]


def fresh(model, seq: int, chunks: list[tuple[list[int], int]]) -> np.ndarray:
    """What a new sequence gets from the same tokens in the same chunks: (tokens, chunk size) after each other."""
    model.cache.remove(seq, 0)
    start = 0
    for tokens, chunk in chunks:
        logits = feed(model, seq, tokens, start, chunk)
        start += len(tokens)
    return logits


def test_forks_share_a_state_until_one_of_them_moves_on(hybrid):
    model = hybrid()
    cache = model.cache
    feed(model, 0, A[:20], 0)
    cache.copy_prefix(0, 1, 20)
    assert cache.slot(1) == cache.slot(0) and cache.position(1) == 20
    assert cache.checkpoints(1) == cache.checkpoints(0) == [19]  # the prompt's end
    forked = feed(model, 1, [A[20]], 20)
    assert cache.slot(1) != cache.slot(0)  # copy-on-write: the fork wrote to a slot of its own
    original = feed(model, 0, [B[0]], 20)
    np.testing.assert_array_equal(forked, fresh(model, 2, [(A[:20], 64), ([A[20]], 1)]))
    np.testing.assert_array_equal(original, fresh(model, 2, [(A[:20], 64), ([B[0]], 1)]))


def test_a_fork_between_checkpoints_resumes_from_the_one_below(hybrid):
    """Forking 18 positions of a sequence whose state is at 24 and checkpointed after 15: the fork has no
    state at 18 (it cannot continue there), and dropping its positions from 16 on restores the checkpoint."""
    model = hybrid(min_position=0)
    cache = model.cache
    feed(model, 0, A[:24], 0, 16)
    assert cache.checkpoints(0) == [15, 23]
    cache.copy_prefix(0, 1, 18)
    assert cache.position(1) == -1 and not cache.can_resume(1, 18) and cache.resume_position(1, 18) == 16
    with pytest.raises(ShiftError):
        cache.remove(1, 4, 8)  # still no shift
    cache.remove(1, 16, TO_END)
    assert cache.position(1) == 16 and cache.checkpoints(1) == [15]
    np.testing.assert_array_equal(feed(model, 1, A[16:20], 16), fresh(model, 2, [(A[:16], 16), (A[16:20], 16)]))


def test_a_rollback_resumes_from_the_checkpoint_at_the_prompts_end(hybrid):
    model = hybrid(min_position=0)
    cache = model.cache
    feed(model, 0, A[:20], 0)
    for i in range(4):  # a reply of four tokens, one at a time: no checkpoint (interval 1664)
        feed(model, 0, [B[i]], 20 + i)
    assert cache.checkpoints(0) == [19] and cache.position(0) == 24
    assert cache.can_resume(0, 20) and cache.can_resume(0, 24) and not cache.can_resume(0, 22)
    assert cache.resume_position(0, 22) == 20
    cache.remove(0, 20, TO_END)
    assert cache.position(0) == 20
    np.testing.assert_array_equal(feed(model, 0, [A[20]], 20), fresh(model, 1, [(A[:20], 64), ([A[20]], 1)]))


def test_checkpoints_at_intervals_keep_the_newest_and_a_restore_prunes_the_later_ones(hybrid):
    """Ollama's ring (TestSlotCheckpointStoreBestIndex, RingBufferWrapAround, PruneAfter): every 4 positions,
    the newest 3 kept; resuming at 15 restores the one after 12 and drops the one after 16."""
    model = hybrid(checkpoints=3, interval=4, min_position=0)
    cache = model.cache
    for p in range(20):
        feed(model, 0, [A[p]], p)
    assert cache.checkpoints(0) == [8, 12, 16]
    assert cache.resume_position(0, 15) == 13 and cache.resume_position(0, 8) == 0
    cache.remove(0, 13)
    assert cache.checkpoints(0) == [8, 12] and cache.position(0) == 13
    resumed = [feed(model, 0, [A[p]], p) for p in range(13, 20)]
    model.cache.remove(1, 0)
    cold = [feed(model, 1, [A[p]], p) for p in range(20)][13:]
    for step, (a, b) in enumerate(zip(resumed, cold, strict=True)):
        np.testing.assert_array_equal(a, b, err_msg=f"position {13 + step}")


def test_the_last_full_batch_of_a_prompt_keeps_a_checkpoint(hybrid):
    """Prompt batches ending at a multiple of the batch size (16 here) are checkpointed until the next one
    is: a 60-input prompt keeps the checkpoints after 15 (the first), 47 (its last full batch, which
    replaced 31) and 59 (its end)."""
    model = hybrid(min_position=0)
    feed(model, 0, (A + B)[:60], 0, 16)
    assert model.cache.checkpoints(0) == [15, 47, 59]
    assert model.cache.resume_position(0, 50) == 48


def test_best_checkpoint_below_a_target_and_none_kept(hybrid):
    """Bookkeeping alone (prepare, no compute): Ollama's TestCachePrepareRestore (checkpoints after 5, 9
    and 15: a target of 12 resumes at 10) and TestSlotCheckpointStoreEmptyBuffer (no checkpoints)."""
    for count, expected in ((3, 10), (0, 0)):
        cache = hybrid(checkpoints=count, min_position=0).cache
        for begin, end in ((0, 6), (6, 10), (10, 16)):  # three prompts' ends
            cache.prepare(Batch(positions=range(begin, end), sequences=[0] * (end - begin), outputs=[end - begin - 1],
                                tokens=A[begin:end]))
        assert cache.checkpoints(0) == ([5, 9, 15] if count else [])
        assert cache.resume_position(0, 12) == expected
        assert cache.resume_position(0, 16) == 16  # where the state is


def test_a_rollback_without_a_checkpoint_is_refused_and_clearing_always_works(hybrid):
    model = hybrid()
    cache = model.cache
    feed(model, 0, A[:10], 0)  # below min_position 16: no checkpoint
    assert cache.checkpoints(0) == [] and cache.resume_position(0, 8) == 0
    with pytest.raises(ShiftError, match="no recurrent checkpoint"):
        cache.remove(0, 5)
    assert cache.position(0) == 10  # untouched
    cache.remove(0, 0)
    assert cache.position(0) == 0
    with pytest.raises(StateError, match="recurrent state is at position 0"):
        feed(model, 0, [A[10]], 10)  # a batch must continue where the state is


def test_a_context_shift_is_refused_and_the_runner_reprocesses_the_kept_inputs(hybrid):
    model = hybrid(sequences=2)
    cache = model.cache
    inputs = InputCache(cache, kv_size=64, num_slots=2, batch_size=16, multi_user=False, remove_errors=ShiftError)
    slot, remaining = inputs.load_slot([Input(token=t) for t in A[:30]], cache_prompt=True)
    feed(model, slot.id, [i.token for i in remaining], 0, 16)
    slot.inputs = [Input(token=t) for t in A[:30]]
    with pytest.raises(ShiftError, match="cannot be shifted"):
        cache.remove(slot.id, 4, 16)
    assert cache.position(slot.id) == 30  # refused before anything changed
    with pytest.raises(ReprocessInputsError) as raised:
        inputs.shift_slot(slot, num_keep=4)
    assert [i.token for i in raised.value.inputs] == A[:4] + A[16:30]  # Ollama's fallback: evaluate them again
    assert cache.position(slot.id) == 0 and slot.inputs == []


def test_a_prompt_cache_hit_resumes_from_the_nearest_checkpoint(hybrid):
    """A second prompt sharing 20 of the first one's 30 inputs resumes after the checkpoint at 15 (the
    runner's chunks of 8 end there), evaluating 14 inputs instead of 30, with a cold run's logits."""
    model = hybrid(sequences=2, interval=8, min_position=0)
    cache = model.cache
    inputs = InputCache(cache, kv_size=128, num_slots=2, batch_size=8, multi_user=False, remove_errors=ShiftError)
    first = A[:30]
    slot, remaining = inputs.load_slot([Input(token=t) for t in first], cache_prompt=True)
    feed(model, slot.id, [i.token for i in remaining], 0, 8)
    slot.inputs, slot.in_use = [Input(token=t) for t in first], False
    assert cache.checkpoints(slot.id) == [7, 15, 23, 29]
    second = A[:20] + B[:10]
    slot, remaining = inputs.load_slot([Input(token=t) for t in second], cache_prompt=True)
    assert len(remaining) == 14 and cache.position(slot.id) == 16
    hit = feed(model, slot.id, [i.token for i in remaining], 16, 8)
    np.testing.assert_array_equal(hit, fresh(model, 1 - slot.id, [(second, 8)]))


def test_an_evicted_slot_is_reused_from_a_zero_state_and_a_fork_into_it_shares_the_prefix(hybrid):
    """Multi-user prompt cache with two slots: a third conversation that shares 16 inputs of the second
    evicts the least recently used slot (the first conversation's) and forks the second's prefix into it:
    the fork reads the second's checkpoint after position 15 in place, and writes its own row from then on."""
    model = hybrid(sequences=2, interval=8, min_position=0)
    cache = model.cache
    inputs = InputCache(cache, kv_size=128, num_slots=2, batch_size=8, multi_user=True, remove_errors=ShiftError)
    for prompt in (A[:20], B[:20]):
        slot, remaining = inputs.load_slot([Input(token=t) for t in prompt], cache_prompt=True)
        feed(model, slot.id, [i.token for i in remaining], 0, 8)
        slot.inputs, slot.in_use = [Input(token=t) for t in prompt], False
    assert cache.checkpoints(1) == [7, 15, 19]
    third = B[:16] + A[:5]
    slot, remaining = inputs.load_slot([Input(token=t) for t in third], cache_prompt=True)
    assert slot.id == 0 and len(remaining) == 5
    assert cache.position(0) == 16 and cache.checkpoints(0) == [7, 15]
    extended = feed(model, 0, [i.token for i in remaining], 16, 8)
    assert cache.slot(0) != cache.slot(1)
    np.testing.assert_array_equal(extended, fresh(model, 1, [(B[:16], 8), (A[:5], 8)]))
    cache.remove(0, 0)  # evicted: the next sequence in this slot starts from zeros, not the old state
    np.testing.assert_array_equal(feed(model, 0, A[:20], 0), fresh(model, 1, [(A[:20], 64)]))


def test_a_prompt_end_keeps_resume_checkpoints_inside_its_batch_until_the_next_one(hybrid):
    """resume_rule (the runner's exact prompt cache sets it) names where a later prompt may resume: the batch
    ending the prompt keeps the state there too, only for positions inside it, the newest K (2) of them, and
    the next prompt end replaces them. Restoring one continues as a sequence fed up to there does, bitwise."""
    model = hybrid(min_position=0, resumes=2)
    cache = model.cache
    asked: list[tuple[int, int, int, int]] = []

    def rule(length: int, first: int, row: int, rows: int) -> tuple[int, ...]:
        asked.append((length, first, row, rows))
        return (length - 70, length - 7, length - 6, length - 3, length)  # outside, inside x3, the end

    cache.resume_rule = rule
    tokens = A + B
    feed(model, 0, tokens[:40], 0, 16)  # batches 0..15, 16..31 and 32..39: only the last ends the prompt
    assert asked == [(40, 32, 0, 8)]
    assert cache.checkpoints(0) == [15, 31, 33, 36, 39]  # the interval's, the last full batch's, two cuts, the end
    feed(model, 0, tokens[40:44], 40, 16)  # the next prompt end replaces 33 and 36 by 40 (44 - 3 alone is inside)
    assert cache.checkpoints(0) == [15, 31, 39, 40, 43]
    cache.remove(0, 41, TO_END)
    assert cache.position(0) == 41 and cache.checkpoints(0) == [15, 31, 39, 40]
    cache.resume_rule = None
    np.testing.assert_array_equal(feed(model, 0, tokens[41:48], 41, 16),
                                  fresh(model, 1, [(tokens[:40], 16), (tokens[40:41], 16), (tokens[41:48], 16)]))


def test_resume_checkpoints_take_rows_of_their_own(hybrid):
    """K (3) resume checkpoints per sequence beside the C others: (S * (1 + C + K) + 2) rows a layer (fit
    reports the tensor init allocates: tests/recurrent_checks.assert_states_fit_and_run)."""
    with_resumes, without = hybrid(sequences=3, checkpoints=4), hybrid(sequences=3, checkpoints=4, resumes=0)
    for layer, sizes in with_resumes.cache.state_sizes.items():
        row = sum(sizes) * 4
        assert with_resumes.cache.state_bytes(layer) == row * (3 * (1 + 4 + 3) + 2)
        assert without.cache.state_bytes(layer) == row * (3 * (1 + 4) + 2)
    with pytest.raises(ValueError):
        Recurrent(None, {0: (4,)}, resumes=-1)
