"""distinct-n, BLEU / self-BLEU and pairwise cosine distance against hand-computed values."""
import math

import numpy as np
import pytest

from hpc_tba.tasks.diversity import (
    bleu,
    distinct_n,
    diversity_metrics,
    mean_pairwise_cosine_distance,
    ngrams,
    self_bleu,
)


def test_ngrams_and_distinct_n() -> None:
    assert ngrams(["a", "b", "c"], 2) == [("a", "b"), ("b", "c")]
    assert ngrams(["a"], 2) == []
    texts = ["a b a", "a b"]
    assert distinct_n(texts, 1) == pytest.approx(2 / 5)  # a b a a b
    assert distinct_n(texts, 2) == pytest.approx(2 / 3)  # ab ba ab (no n-gram across texts)
    assert distinct_n(["x y", "z w"], 2) == 1.0
    assert distinct_n(["one"], 2) == 0.0
    with pytest.raises(ValueError):
        distinct_n(texts, 0)


def test_bleu_hand_computed() -> None:
    hyp = "the cat sat on the mat".split()
    ref = "the cat is on the mat".split()
    # clipped precisions 5/6, 3/5, 1/4, and 0/3 -> smoothed 0.1/3; equal lengths, no penalty
    assert bleu(hyp, [ref]) == pytest.approx((5 / 6 * 3 / 5 * 1 / 4 * 0.1 / 3) ** 0.25)
    assert bleu(hyp, [ref], max_n=2) == pytest.approx(math.sqrt(5 / 6 * 3 / 5))
    assert bleu(hyp, [ref], smooth=False) == 0.0
    assert bleu(hyp, [hyp]) == pytest.approx(1.0)


def test_bleu_clipping_brevity_and_multiple_references() -> None:
    assert bleu("the the the".split(), ["the cat".split()], max_n=1) == pytest.approx(1 / 3)
    # Shorter than the reference: brevity penalty exp(1 - r/c).
    short = bleu("the cat".split(), ["the cat sat".split()], max_n=1)
    assert short == pytest.approx(math.exp(-0.5))
    # Closest reference length wins (ties: the shorter): 4 vs refs of 3 and 5 -> r = 3, no penalty.
    refs = ["a b c".split(), "a b c d e".split()]
    assert bleu("a b c d".split(), refs, max_n=1) == pytest.approx(1.0)
    # Clipping takes the max count over references: "a a" is matched twice by the second one.
    assert bleu("a a".split(), ["a b".split(), "a a".split()], max_n=1) == pytest.approx(1.0)
    assert bleu([], ["a".split()]) == 0.0


def test_self_bleu() -> None:
    assert self_bleu(["a b c d e"] * 3) == pytest.approx(1.0)
    assert self_bleu(["a b c d", "e f g h", "i j k l"]) == 0.0
    texts = ["the cat sat on the mat", "the cat is on the mat"]
    pair = bleu(texts[0].split(), [texts[1].split()])
    assert self_bleu(texts) == pytest.approx(pair)  # symmetric here: same lengths and overlaps
    assert math.isnan(self_bleu(["alone"]))


def test_mean_pairwise_cosine_distance() -> None:
    e = np.array([[1.0, 0.0], [0.0, 1.0], [1.0, 1.0]])
    expected = (1.0 + 2 * (1 - 1 / math.sqrt(2))) / 3
    assert mean_pairwise_cosine_distance(e) == pytest.approx(expected)
    assert mean_pairwise_cosine_distance(e * [[3.0], [0.5], [10.0]]) == pytest.approx(expected)
    assert mean_pairwise_cosine_distance([[1, 2, 3], [2, 4, 6]]) == pytest.approx(0.0, abs=1e-12)
    assert mean_pairwise_cosine_distance([[1, 0], [-1, 0]]) == pytest.approx(2.0)
    assert math.isnan(mean_pairwise_cosine_distance([[1.0, 2.0]]))
    with pytest.raises(ValueError, match="zero or non-finite"):
        mean_pairwise_cosine_distance([[1.0, 0.0], [0.0, 0.0]])
    with pytest.raises(ValueError, match=r"\[N, D\]"):
        mean_pairwise_cosine_distance([1.0, 2.0])


def test_diversity_metrics_keys() -> None:
    out = diversity_metrics(["a b", "a c"], embeddings=np.eye(2), prefix="eval/diversity")
    assert out == pytest.approx({"eval/diversity/distinct_1": 3 / 4,
                                 "eval/diversity/distinct_2": 1.0,
                                 "eval/diversity/self_bleu": bleu(["a", "b"], [["a", "c"]]),
                                 "eval/diversity/cosine_distance": 1.0})
