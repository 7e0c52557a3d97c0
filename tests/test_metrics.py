"""The built-in job's validation metrics that are not plain averages: ROC AUC from score histograms
summed over ranks (pipeline.job.evaluate.binned_auc), checked against the exact pairwise definition."""

from __future__ import annotations

import numpy as np
import pytest

from pipeline.job.evaluate import AUC_BINS, binned_auc


def exact_auc(scores: np.ndarray, labels: np.ndarray) -> float:
    """P(a random positive outscores a random negative), ties counting half: every pair compared."""
    pos, neg = scores[labels == 1], scores[labels == 0]
    gt = (pos[:, None] > neg[None, :]).sum()
    eq = (pos[:, None] == neg[None, :]).sum()
    return (gt + 0.5 * eq) / (len(pos) * len(neg))


def histogram(scores: np.ndarray, labels: np.ndarray, ranks: int = 1) -> tuple[np.ndarray, np.ndarray]:
    """The positives' and negatives' bin counts, as the job builds them rank by rank and sums them."""
    pos, neg = np.zeros(AUC_BINS), np.zeros(AUC_BINS)
    for part in np.array_split(np.arange(len(scores)), ranks):
        bins = np.clip((scores[part] * AUC_BINS).astype(np.int64), 0, AUC_BINS - 1)
        pos += np.bincount(bins[labels[part] == 1], minlength=AUC_BINS)
        neg += np.bincount(bins[labels[part] == 0], minlength=AUC_BINS)
    return pos, neg


@pytest.mark.parametrize("seed", range(5))
def test_binned_auc_matches_the_exact_auc(seed):
    rng = np.random.default_rng(seed)
    n = 3000
    labels = (rng.random(n) < rng.uniform(0.05, 0.5)).astype(np.int64)
    logits = rng.normal(labels * rng.uniform(0.0, 3.0), 1.0)
    scores = 1.0 / (1.0 + np.exp(-logits))
    binned = binned_auc(*histogram(scores, labels, ranks=1 + seed % 3))
    assert abs(binned - exact_auc(scores, labels)) < 2e-3
    # scores that already lie on bin boundaries: the histogram is exact, ties included
    coarse = np.floor(scores * 8) / 8
    assert binned_auc(*histogram(coarse, labels)) == pytest.approx(exact_auc(coarse, labels), abs=1e-12)


def test_auc_extremes():
    labels = np.array([0, 0, 1, 1])
    assert binned_auc(*histogram(np.array([0.1, 0.2, 0.8, 0.9]), labels)) == 1.0
    assert binned_auc(*histogram(np.array([0.9, 0.8, 0.2, 0.1]), labels)) == 0.0
    assert binned_auc(*histogram(np.full(4, 0.5), labels)) == 0.5
    assert np.isnan(binned_auc(*histogram(np.array([0.1, 0.2]), np.array([1, 1]))))
