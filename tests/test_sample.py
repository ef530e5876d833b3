"""Sampling and logprobs: ports of Ollama's sample/ and runner/common logprob tests, plus statistics."""

import json
import math

import numpy as np
import pytest

from ollama_engine.sample import MAX_TOP_LOGPROBS, Sampler, calculate_logprobs, transforms


def f32(values: list[float]) -> np.ndarray:
    return np.array(values, dtype=np.float32)


def prepared(logits: list[float]) -> np.ndarray:
    """Probabilities after topK (all, sorted) and softmax, the setup of Ollama's topP/minP tests."""
    values = f32(logits)
    return transforms.softmax(values[transforms.top_k(values, 20)])


# --- transforms (sample/transforms_test.go) ---

# The 12-value distribution of Ollama's softmax and topK tests.
TOP_K_INPUT = [0.026986899, 0.043722924, 0.036774673, 0.27755088, 0.0046718004, 0.08582123,
               0.20409796, 0.00412893, 0.15720603, 0.045046154, 0.0030491839, 0.01681367]


def test_temperature_scales_logits():
    np.testing.assert_allclose(transforms.temperature(f32([1, 4, -2, 0]), 0.5), [2, 8, -4, 0])
    np.testing.assert_allclose(transforms.temperature(f32([1, 4, -2, 0]), 1.0), [1, 4, -2, 0])


def test_temperature_zero_divides_by_the_floor():
    scaled = transforms.temperature(f32([1, 4, -2, 0]), 0.0)
    np.testing.assert_allclose(scaled, [1e7, 4e7, -2e7, 0], rtol=1e-6)


def test_softmax_values():
    np.testing.assert_allclose(
        transforms.softmax(f32([1, -2, 3, 0])), [0.113550, 0.005653, 0.839024, 0.041773], atol=1e-6
    )


@pytest.mark.parametrize(
    "logits",
    [
        TOP_K_INPUT,
        [1],
        [0.9, 0.9, 0.9],
        [1000, 2000, 3000],
        [1e-6, 2e-6, 3e-6],
        [-1, -2, -3],
        [-100, 0, 100],
    ],
)
def test_softmax_is_a_distribution(logits):
    probs = transforms.softmax(f32(logits))
    assert np.all((probs >= 0) & (probs <= 1))
    assert abs(float(probs.sum(dtype=np.float64)) - 1) < 1e-6


def test_top_k_keeps_the_largest_in_descending_order():
    values = f32(TOP_K_INPUT)
    expected = f32([0.27755088, 0.20409796, 0.15720603, 0.08582123, 0.045046154])
    np.testing.assert_array_equal(values[transforms.top_k(values, 5)], expected)


@pytest.mark.parametrize("k", [20, 12, 0, -1])
def test_top_k_off_or_too_large_keeps_all_sorted(k):
    values = f32(TOP_K_INPUT)
    ids = transforms.top_k(values, k)
    assert sorted(ids.tolist()) == list(range(12))
    np.testing.assert_array_equal(values[ids], np.sort(values)[::-1])


def test_top_k_of_one_on_huge_negative_logits():
    values = f32([-1e7, -2e7, -3e7, -4e7])
    assert transforms.top_k(values, 1).tolist() == [0]


def test_top_k_orders_ties_by_id():
    kept = transforms.top_k(f32([1, 3, 3, 0, 3]), 2).tolist()
    assert kept == sorted(kept) and set(kept) <= {1, 2, 4}
    assert transforms.top_k(f32([1, 3, 3, 0, 3]), 0).tolist() == [1, 2, 4, 0, 3]


def test_top_p():
    probs = prepared([-3, -2, -1, 0, 1, 2, 4])
    assert len(transforms.top_p(probs, 1.0)) == 7
    assert len(transforms.top_p(probs, 0.95)) <= 3
    tied = prepared([-1e6, -1e6, -1e7])
    assert len(transforms.top_p(tied, 0.0)) == 1
    assert len(transforms.top_p(tied, 1e-10)) >= 1


def test_top_p_keeps_the_token_that_crosses_p():
    probs = f32([0.5, 0.3, 0.15, 0.05])
    assert transforms.top_p(probs, 0.5).tolist() == pytest.approx([0.5, 0.3])
    assert transforms.top_p(probs, 0.7).tolist() == pytest.approx([0.5, 0.3])
    assert transforms.top_p(probs, 0.85).tolist() == pytest.approx([0.5, 0.3, 0.15])


def test_min_p():
    probs = prepared([-2, 0, -1, -3, 2, 1, 4, 3])
    assert len(transforms.min_p(probs, 1.0)) == 1
    assert len(transforms.min_p(probs, 0.2)) <= 3
    assert len(transforms.min_p(probs, 0.0)) == 8
    assert len(transforms.min_p(prepared([1.0]), 0.1)) == 1
    assert len(transforms.min_p(prepared([1e-10, 1e-10, 1e-10]), 1.0)) >= 1


def test_min_p_threshold_is_relative_to_the_top_probability():
    probs = f32([0.5, 0.3, 0.1, 0.1])
    assert len(transforms.min_p(probs, 0.6)) == 2  # threshold 0.3 keeps 0.3 itself
    assert len(transforms.min_p(probs, 0.61)) == 1


# --- the sampler (sample/samplers_test.go) ---


def test_weighted_ports():
    assert Sampler(0, 0, 0, 0, 0).sample(f32([-10, 3, -10, -10])) == 1
    assert Sampler(0, 0, 0, 0, 0).sample(f32([-100, -10, 0, 10])) == 3
    assert Sampler(1.0, 0, 1e-10, 0, 0).sample(f32([1.0, 0.9999999999999999, 0.5, 0.1])) == 0


def test_nan_logits_are_an_error():
    with pytest.raises(ValueError, match="sample: logits sum to NaN, check model output"):
        Sampler(1, 0, 0.95, 0.05, 0).sample(f32([math.nan] * 3))


def test_empty_or_misshapen_logits_are_an_error():
    with pytest.raises(ValueError, match="sample: no logits provided to sample"):
        Sampler(1, 0, 1, 0, 0).sample(f32([]))
    with pytest.raises(ValueError, match="one row"):
        Sampler(1, 0, 1, 0, 0).sample(np.zeros((2, 3), dtype=np.float32))


def test_constructor_clamps_like_ollama():
    s = Sampler(temperature=-1, top_k=-5, top_p=2.0, min_p=-0.5, seed=1)
    assert (s.temperature, s.top_k, s.top_p, s.min_p) == (0.0, -5, 1.0, 0.0)
    s = Sampler(temperature=0.7, top_k=3, top_p=-1, min_p=1.5, seed=1)
    assert (s.temperature, s.top_p, s.min_p) == (0.7, 0.0, 1.0)


@pytest.mark.parametrize(
    "kwargs",
    [{"temperature": "hot"}, {"top_k": 1.5}, {"top_k": True}, {"top_p": None}, {"seed": 1.0}],
)
def test_bad_option_types_are_rejected(kwargs):
    with pytest.raises(TypeError):
        Sampler(**kwargs)


def test_from_options_null_means_ollama_defaults():
    s = Sampler.from_options(None)
    assert (s.temperature, s.top_k, s.top_p, s.min_p) == (0.8, 40, 0.9, 0.0)


def test_from_options_missing_keys_are_zero():
    s = Sampler.from_options({"top_k": 5})
    assert (s.temperature, s.top_k, s.top_p, s.min_p) == (0.0, 5, 0.0, 0.0)
    # An omitted seed is seed 0, which is deterministic.
    logits = np.random.default_rng(3).normal(size=100).astype(np.float32)
    a = Sampler.from_options({"temperature": 1.0, "top_p": 1.0})
    b = Sampler.from_options({"temperature": 1.0, "top_p": 1.0, "seed": 0})
    assert [a.sample(logits) for _ in range(50)] == [b.sample(logits) for _ in range(50)]
    with pytest.raises(TypeError):
        Sampler.from_options([("temperature", 1.0)])


def test_temperature_zero_is_argmax():
    rng = np.random.default_rng(0)
    sampler = Sampler(temperature=0, top_k=40, top_p=0.9, seed=-1)
    for _ in range(20):
        logits = rng.normal(size=1000).astype(np.float32)
        assert sampler.sample(logits) == int(np.argmax(logits))
    assert sampler.sample(f32([1, 5, 5, 2])) == 1  # the first of tied maxima


def test_top_k_one_is_greedy():
    rng = np.random.default_rng(1)
    sampler = Sampler(temperature=1.5, top_k=1, top_p=1.0, seed=-1)
    for _ in range(20):
        logits = rng.normal(size=1000).astype(np.float32)
        assert sampler.sample(logits) == int(np.argmax(logits))


def test_same_seed_same_draws_and_different_seeds_differ():
    logits = np.random.default_rng(2).normal(size=500).astype(np.float32)

    def draws(seed: int) -> list[int]:
        sampler = Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed)
        return [sampler.sample(logits) for _ in range(100)]

    assert draws(42) == draws(42)
    assert draws(-7) == draws(-7)
    assert draws(42) != draws(43)


def test_random_seed_is_not_fixed():
    logits = np.zeros(1000, dtype=np.float32)
    runs = [[Sampler(1.0, 0, 1.0, 0.0, seed).sample(logits) for _ in range(20)] for seed in (-1, None, -1)]
    assert len({tuple(run) for run in runs}) == 3  # the two runs with -1 differ too


def test_a_negative_seed_is_taken_modulo_2_to_the_64():
    """Go converts the seed to uint64: -5 seeds the generator as 2**64 - 5 does."""
    expected = np.random.default_rng(2**64 - 5).random(4)
    np.testing.assert_array_equal(Sampler(seed=-5).rng.random(4), expected)


def test_options_must_be_numbers_not_booleans():
    """JSON true is not a number to Go's decoder."""
    for name in ("temperature", "top_p", "min_p", "top_k", "seed"):
        with pytest.raises(TypeError, match=name):
            Sampler(**{name: True})


def test_present_options_without_a_key_leave_it_at_zero():
    sampler = Sampler.from_options({})
    assert (sampler.temperature, sampler.top_k, sampler.top_p, sampler.min_p) == (0.0, 0, 0.0, 0.0)


def test_sample_leaves_the_logits_alone():
    logits = np.random.default_rng(4).normal(size=64).astype(np.float32)
    before = logits.copy()
    Sampler(0.7, 10, 0.9, 0.05, 1).sample(logits)
    np.testing.assert_array_equal(logits, before)


def draw_frequencies(sampler: Sampler, logits: np.ndarray, n: int = 20_000) -> np.ndarray:
    counts = np.bincount([sampler.sample(logits) for _ in range(n)], minlength=logits.size)
    return counts / n


def test_weighted_draw_follows_the_softmax():
    logits = f32([2.0, 1.0, 0.5, -1.0, 0.0])
    freq = draw_frequencies(Sampler(1.0, 0, 1.0, 0.0, seed=123), logits)
    expected = np.exp(logits - logits.max()) / np.exp(logits - logits.max()).sum()
    np.testing.assert_allclose(freq, expected, atol=0.015)


def test_weighted_draw_with_temperature_and_top_k():
    logits = f32([2.0, 1.0, 0.5, -1.0, 0.0])
    freq = draw_frequencies(Sampler(0.5, 2, 1.0, 0.0, seed=9), logits)
    top2 = np.exp(logits[:2] / 0.5)
    np.testing.assert_allclose(freq[:2], top2 / top2.sum(), atol=0.015)
    assert freq[2:].sum() == 0


def test_weighted_draw_with_top_p_and_min_p():
    logits = np.log(f32([0.4, 0.3, 0.2, 0.1]))
    freq = draw_frequencies(Sampler(1.0, 0, 0.6, 0.0, seed=5), logits)
    np.testing.assert_allclose(freq, [0.4 / 0.7, 0.3 / 0.7, 0, 0], atol=0.015)
    freq = draw_frequencies(Sampler(1.0, 0, 1.0, 0.4, seed=6), logits)  # threshold 0.16
    np.testing.assert_allclose(freq, [0.4 / 0.9, 0.3 / 0.9, 0.2 / 0.9, 0], atol=0.015)


def test_large_vocabulary_draws_stay_in_the_top_k():
    logits = np.random.default_rng(8).normal(size=150_000).astype(np.float32)
    allowed = set(np.argsort(-logits)[:40].tolist())
    sampler = Sampler(seed=11)
    assert all(sampler.sample(logits) in allowed for _ in range(200))


# --- logprobs (runner/common/logprob_test.go) ---

WORDS = {0: "hello", 1: "hi", 2: "hey", 3: "world"}


def decode_word(token: int) -> str:
    return WORDS.get(token, "")


def decode_letter(token: int) -> str:
    return chr(ord("A") + token)


def test_logprobs_empty_logits_are_an_error():
    with pytest.raises(ValueError, match="expected one non-empty row of logits"):
        calculate_logprobs(f32([]), 0, 0, decode_word)
    with pytest.raises(ValueError, match=r"expected one non-empty row of logits, got shape \(2, 2\)"):
        calculate_logprobs(np.zeros((2, 2), np.float32), 0, 0, decode_word)


def test_logprobs_of_a_one_token_vocabulary():
    result = calculate_logprobs(f32([3.0]), 0, 1, decode_letter)
    assert result == {"token": "A", "logprob": 0.0, "top_logprobs": [{"token": "A", "logprob": 0.0}]}


@pytest.mark.parametrize("top", [0, 1, 3])
def test_logprobs_selected_token_and_top_count(top):
    result = calculate_logprobs(f32([1.0, 0.5, 0.3, 0.1]), 0, top, decode_word)
    assert result["token"] == "hello"
    if top == 0:
        assert "top_logprobs" not in result
    else:
        assert [t["token"] for t in result["top_logprobs"]] == ["hello", "hi", "hey"][:top]


def test_logprobs_numerical_stability():
    result = calculate_logprobs(f32([1000.0, 999.0, 998.0]), 0, 3, decode_letter)
    values = [result["logprob"]] + [t["logprob"] for t in result["top_logprobs"]]
    assert all(math.isfinite(v) for v in values)
    tops = [t["logprob"] for t in result["top_logprobs"]]
    assert tops == sorted(tops, reverse=True)


@pytest.mark.parametrize(
    "logits", [[1.0, 1.0, 1.0, 1.0], [2.0, 1.0, 0.5, 0.1], [-1.0, -2.0, -3.0, -4.0], [5.0, -5.0, 0.0, 2.5]]
)
def test_logprobs_probability_correctness(logits):
    result = calculate_logprobs(f32(logits), 0, 4, decode_word)
    tops = result["top_logprobs"]
    assert result["logprob"] <= 0 and all(t["logprob"] <= 0 for t in tops)
    assert sum(math.exp(t["logprob"]) for t in tops) == pytest.approx(1.0, abs=1e-6)
    assert [t["logprob"] for t in tops] == sorted((t["logprob"] for t in tops), reverse=True)
    mine = [t for t in tops if t["token"] == "hello"]
    assert len(mine) == 1 and mine[0]["logprob"] == pytest.approx(result["logprob"], abs=1e-6)
    if len(set(logits)) == 1:
        assert math.exp(result["logprob"]) == pytest.approx(0.25, abs=1e-6)


@pytest.mark.parametrize(
    "logits",
    [[1.0, 2.0, 3.0], [10.0, 0.0, -10.0], [5.0] * 5, [500.0, 499.0, 498.0], [-500.0, -499.0, -498.0]],
)
def test_logprobs_softmax_correctness(logits):
    results = [calculate_logprobs(f32(logits), i, 0, decode_letter) for i in range(len(logits))]
    probs = [math.exp(r["logprob"]) for r in results]
    assert all(0 <= p <= 1 for p in probs)
    assert sum(probs) == pytest.approx(1.0, abs=1e-5)


def test_logprobs_selected_token_correctness():
    logits = f32([3.0, 1.0, 2.0, 0.5])
    results = [calculate_logprobs(logits, i, 0, decode_letter) for i in range(4)]
    assert [r["token"] for r in results] == ["A", "B", "C", "D"]
    assert int(np.argmax([r["logprob"] for r in results])) == int(np.argmax(logits))


def test_logprobs_top_k_ordering():
    names = ["first", "second", "third", "fourth", "fifth"]
    result = calculate_logprobs(f32([2.0, 5.0, 1.0, 4.0, 3.0]), 0, 5, names.__getitem__)
    assert [t["token"] for t in result["top_logprobs"]] == ["second", "fourth", "fifth", "first", "third"]


def test_logprobs_match_a_direct_log_softmax():
    logits = np.random.default_rng(10).normal(scale=4, size=32_000).astype(np.float32)
    wide = logits.astype(np.float64)
    expected = wide - wide.max() - np.log(np.exp(wide - wide.max()).sum())
    result = calculate_logprobs(logits, 1234, MAX_TOP_LOGPROBS, str)
    assert result["token"] == "1234"
    assert result["logprob"] == pytest.approx(expected[1234], abs=1e-4)
    best = np.argsort(-expected)[:MAX_TOP_LOGPROBS]
    assert [t["token"] for t in result["top_logprobs"]] == [str(i) for i in best]
    np.testing.assert_allclose([t["logprob"] for t in result["top_logprobs"]], expected[best], atol=1e-4)


def test_logprobs_of_every_token_are_normalised():
    logits = np.random.default_rng(12).normal(scale=3, size=500).astype(np.float32)
    wide = logits.astype(np.float64)
    expected = wide - wide.max() - np.log(np.exp(wide - wide.max()).sum())
    every = np.array([calculate_logprobs(logits, i, 0, str)["logprob"] for i in range(logits.size)])
    np.testing.assert_allclose(every, expected, atol=1e-5)
    assert np.exp(every).sum() == pytest.approx(1.0, abs=1e-5)


def test_logprobs_use_raw_logits_whatever_the_sampler():
    logits = f32([3.0, 1.0, 2.0])
    token = Sampler(temperature=0.1, top_k=1, seed=0).sample(logits)
    result = calculate_logprobs(logits, token, 0, decode_letter)
    expected = 3.0 - math.log(math.exp(3) + math.exp(1) + math.exp(2))
    assert result["logprob"] == pytest.approx(expected, abs=1e-6)


def test_top_logprobs_never_exceed_the_vocabulary():
    assert len(calculate_logprobs(f32([0.1, 0.2]), 1, 20, decode_letter)["top_logprobs"]) == 2


@pytest.mark.parametrize("top", [-1, MAX_TOP_LOGPROBS + 1])
def test_top_logprobs_out_of_range_is_an_error(top):
    with pytest.raises(ValueError, match="top_logprobs must be between 0 and 20"):
        calculate_logprobs(f32([0.1, 0.2]), 0, top, decode_letter)


def test_logprobs_selected_token_out_of_range_is_an_error():
    with pytest.raises(ValueError, match="outside the vocabulary"):
        calculate_logprobs(f32([0.1, 0.2]), 2, 0, decode_letter)


def test_logprobs_serialise_to_the_completion_wire_format():
    result = calculate_logprobs(f32([0.0, math.log(3.0)]), 1, 2, decode_letter)
    wire = json.loads(json.dumps([result]))
    assert wire == [
        {
            "token": "B",
            "logprob": pytest.approx(math.log(0.75), abs=1e-6),
            "top_logprobs": [
                {"token": "B", "logprob": pytest.approx(math.log(0.75), abs=1e-6)},
                {"token": "A", "logprob": pytest.approx(math.log(0.25), abs=1e-6)},
            ],
        }
    ]
