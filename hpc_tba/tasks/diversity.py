"""Diversity of a set of generations: distinct-n, self-BLEU, mean pairwise cosine distance.

Red-teaming rewards finding *many different* attacks, and A-LoL reports diversity, so these are
logged during training and in evaluation. Pure functions of texts (or of embedding vectors, which
the caller computes with whatever sentence encoder it has); no nltk.

- distinct-n (Li et al., 2016): distinct n-grams / all n-grams over the whole set. Higher = more
  diverse. Whitespace tokens unless a tokenizer is given.
- self-BLEU (Zhu et al., 2018, Texygen): mean over i of BLEU(text_i, references = all others).
  Lower = more diverse. BLEU here is sentence BLEU with uniform weights over 1..max_n-grams,
  clipped counts against the per-n-gram maximum over references, brevity penalty against the
  closest reference length (ties: the shorter), and nltk's smoothing "method1" (a zero n-gram
  match count becomes epsilon = 0.1) so one missing 4-gram does not zero the score; with no
  unigram match at all BLEU is 0.
- mean pairwise cosine distance: mean over pairs i < j of 1 − cos(e_i, e_j) (TBA's red-teaming
  diversity, on sentence embeddings). Higher = more diverse.

Sets with fewer than two items have no pairs: self-BLEU and cosine distance return NaN rather than
a number that would look like a measurement.
"""
from __future__ import annotations

import math
from collections import Counter
from collections.abc import Callable, Sequence

import numpy as np

Tokenizer = Callable[[str], list[str]]
SMOOTHING_EPSILON = 0.1
"""nltk SmoothingFunction().method1's epsilon, for comparability with published self-BLEU."""


def _whitespace(text: str) -> list[str]:
    return text.split()


def ngrams(tokens: Sequence[str], n: int) -> list[tuple[str, ...]]:
    """All contiguous n-grams of `tokens` (none if it is shorter than n)."""
    return [tuple(tokens[i:i + n]) for i in range(len(tokens) - n + 1)]


def distinct_n(texts: Sequence[str], n: int, tokenize: Tokenizer = _whitespace) -> float:
    """Distinct n-grams / total n-grams over all texts; 0.0 when there are no n-grams."""
    if n < 1:
        raise ValueError(f"distinct-n needs n >= 1, got {n}")
    grams = [g for t in texts for g in ngrams(tokenize(t), n)]
    return len(set(grams)) / len(grams) if grams else 0.0


def bleu(hypothesis: Sequence[str], references: Sequence[Sequence[str]], max_n: int = 4,
         *, smooth: bool = True) -> float:
    """Sentence BLEU of a tokenised hypothesis against tokenised references (see module doc)."""
    if max_n < 1:
        raise ValueError(f"BLEU needs max_n >= 1, got {max_n}")
    if not hypothesis or not references:
        return 0.0
    log_precision = 0.0
    for n in range(1, max_n + 1):
        hyp = Counter(ngrams(hypothesis, n))
        best: Counter[tuple[str, ...]] = Counter()
        for ref in references:
            best |= Counter(ngrams(ref, n))  # per-n-gram max over references
        matched = sum(min(c, best[g]) for g, c in hyp.items())
        total = max(sum(hyp.values()), 1)
        if matched == 0:
            if n == 1 or not smooth:
                return 0.0
            log_precision += math.log(SMOOTHING_EPSILON / total) / max_n
        else:
            log_precision += math.log(matched / total) / max_n
    c = len(hypothesis)
    r = min((abs(len(ref) - c), len(ref)) for ref in references)[1]
    brevity = 1.0 if c > r else math.exp(1.0 - r / c)
    return brevity * math.exp(log_precision)


def self_bleu(texts: Sequence[str], max_n: int = 4, tokenize: Tokenizer = _whitespace) -> float:
    """Mean BLEU of each text against all the others; NaN for fewer than two texts."""
    if len(texts) < 2:
        return float("nan")
    toks = [tokenize(t) for t in texts]
    scores = [bleu(toks[i], toks[:i] + toks[i + 1:], max_n) for i in range(len(toks))]
    return float(np.mean(scores))


def mean_pairwise_cosine_distance(embeddings: np.ndarray | Sequence[Sequence[float]]) -> float:
    """Mean of 1 − cos(e_i, e_j) over pairs i < j of the rows of an [N, D] array; NaN if N < 2."""
    e = np.asarray(embeddings, dtype=np.float64)
    if e.ndim != 2:
        raise ValueError(f"embeddings must be a [N, D] array, got shape {e.shape}")
    if len(e) < 2:
        return float("nan")
    norms = np.linalg.norm(e, axis=1)
    if np.any(norms == 0) or not np.all(np.isfinite(norms)):
        raise ValueError("embeddings contain a zero or non-finite vector: cosine is undefined")
    unit = e / norms[:, None]
    cos = unit @ unit.T  # [N, N]
    iu = np.triu_indices(len(e), k=1)
    return float(np.mean(1.0 - cos[iu]))


def diversity_metrics(texts: Sequence[str], embeddings: np.ndarray | None = None,
                      prefix: str = "diversity") -> dict[str, float]:
    """distinct-1/2, self-BLEU and (given embeddings) cosine distance, namespaced for logging."""
    out = {f"{prefix}/distinct_1": distinct_n(texts, 1),
           f"{prefix}/distinct_2": distinct_n(texts, 2),
           f"{prefix}/self_bleu": self_bleu(texts)}
    if embeddings is not None:
        out[f"{prefix}/cosine_distance"] = mean_pairwise_cosine_distance(embeddings)
    return out
