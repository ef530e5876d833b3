"""Sampled speculative decoding draws from the target's distribution: a statistical check, as the sampler's own.

runner/speculate.py argues that with a point-mass draft (an n-gram lookup, or a greedy draft model) the
rejection-sampling rule is "draw from the target's row as usual, keep the draft iff it was drawn", so a
speculating request draws exactly what plain decoding draws. Two checks on real SmolLM2-135M-Instruct at
temperature 1 (no top-k/top-p/min-p: the target's distribution is the softmax of its logits), many seeds,
four sequences decoding at once, with n-grams and with a draft model (the target requantized to Q4_0):

- each seed's tokens and logprobs equal plain decoding's, bitwise;
- the tokens follow the target's conditional distributions, computed independently by llama.cpp (the
  pinned llama-cpp-python, every position of prompt + output in one evaluation): for each generated token,
  its randomized probability integral transform u = P(tokens ranked above it) + U * p(token) (tokens ranked by
  probability) is uniform on [0, 1) and independent across positions when the token was drawn from that
  distribution; a chi-square test on 10 bins. The same statistic against the distribution at temperature 0.5
  (what a sampler that keeps too many drafts would look like) must fail: the test can tell.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import numpy as np
import pytest
from test_speculative import COPY, Run
from test_speculative_draft import CHAT, draft_path, open_runner  # noqa: F401  (draft_path: a fixture)

from ollama_engine.runner.sequence import DoneReason
from ollama_engine.sample import Sampler

SEEDS = range(32)
TOKENS = 24
BINS = 10
CRITICAL = 27.877
"""The chi-square distribution's 0.999 quantile with BINS - 1 = 9 degrees of freedom."""


@pytest.fixture(scope="module")
def reference(smollm2_path: Path):
    import llama_cpp

    return llama_cpp.Llama(model_path=str(smollm2_path), n_ctx=512, n_batch=512, n_ubatch=512, logits_all=True,
                           verbose=False, n_threads=2, n_threads_batch=2)


@pytest.fixture(scope="module")
def plain(smollm2_path: Path):
    runner, loaded = open_runner(smollm2_path, None, parallel=4)
    yield runner
    runner.close()
    loaded.close()


@pytest.fixture(scope="module")
def drafted(smollm2_path: Path, draft_path: Path):  # noqa: F811
    runner, loaded = open_runner(smollm2_path, draft_path, parallel=4)
    yield runner
    runner.close()
    loaded.close()


def sampled(runner, seed: int, spec: bool, prompts: tuple[str, ...]) -> Run:
    """A temperature-1 completion of one of the prompts."""
    prompt = prompts[seed % len(prompts)]
    return Run(runner, prompt, spec, sampler=Sampler(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, seed=seed),
               num_predict=TOKENS)


def all_seeds(runner, spec: bool, prompts: tuple[str, ...]) -> list[Run]:
    with ThreadPoolExecutor(4) as pool:  # four sequences decoding (and speculating) in the same batches
        return list(pool.map(lambda seed: sampled(runner, seed, spec, prompts), SEEDS))


def pit_values(runs: list[Run], reference, temperature: float = 1.0) -> np.ndarray:
    """Each generated token's randomized probability integral transform under llama.cpp's distribution."""
    rng = np.random.default_rng(0)
    values = []
    for run in runs:
        tokens = run.seq.spec.drafter.tokens  # the prompt's tokens, then every generated one
        prompt = run.seq.num_prompt_inputs
        reference.reset()
        reference.eval(tokens)
        scores = np.array(reference.scores[:len(tokens)], dtype=np.float64) / temperature
        for position in range(prompt, len(tokens)):
            logits = scores[position - 1]
            p = np.exp(logits - logits.max())
            p /= p.sum()
            token = tokens[position]
            above = p[(p > p[token]) | ((p == p[token]) & (np.arange(p.size) < token))].sum()
            values.append(above + rng.random() * p[token])
    return np.asarray(values)


def chi_square(values: np.ndarray) -> float:
    counts = np.bincount(np.minimum((values * BINS).astype(int), BINS - 1), minlength=BINS)
    expected = len(values) / BINS
    return float(((counts - expected) ** 2 / expected).sum())


@pytest.mark.parametrize("drafter", ["ngram", "draft model"])
def test_sampled_tokens_follow_the_targets_distribution(plain, drafted, reference, drafter):
    # n-grams find drafts where the answer copies its prompt; a draft model drafts a story too
    prompts = (COPY,) if drafter == "ngram" else (COPY, CHAT)
    plain_runs = all_seeds(plain, False, prompts)
    runs = all_seeds(plain, True, prompts) if drafter == "ngram" else all_seeds(drafted, False, prompts)
    for a, b in zip(plain_runs, runs, strict=True):
        assert b.logprobs == a.logprobs  # the seed's tokens and logprobs: plain decoding's, bitwise
    generated = sum(len(run.entries) for run in runs)
    accepted = sum(run.seq.spec.accepted for run in runs)
    # how much is drafted depends on which sequences share a batch (they share its row cap): at least a tenth
    assert accepted >= 0.1 * generated, f"{accepted} of {generated} tokens came from drafts: too few to test"
    # an end-of-generation token is not in the drafter's tokens: only sequences cut at TOKENS are tested whole
    runs = [run for run in runs if run.seq.done_reason == DoneReason.LENGTH]
    assert len(runs) >= 0.75 * len(SEEDS)
    statistic = chi_square(pit_values(runs, reference))
    assert statistic < CRITICAL, f"chi-square {statistic:.1f} over {BINS} bins: not the target's distribution"
    sharper = chi_square(pit_values(runs, reference, temperature=0.5))
    print(f"{drafter}: {accepted} of {generated} tokens from drafts, chi-square {statistic:.1f} over {len(runs)} "
          f"sequences (critical {CRITICAL}), {sharper:.1f} against temperature 0.5")
    assert sharper > CRITICAL, f"chi-square {sharper:.1f} against temperature 0.5: the check cannot tell"
