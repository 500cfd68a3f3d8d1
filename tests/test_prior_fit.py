"""``python -m bench prior-fit``: a class's prior mean after its finished requests, per prior."""

from __future__ import annotations

import pytest

from bench import prior_fit


def test_prior_fit_reports_both_priors_and_the_mixture_comes_down_for_rejecting_requests(capsys):
    mix = prior_fit.run(50, 2, 0.0, 4, [10, 50], 0, "mixture")
    pooled = prior_fit.run(50, 2, 0.0, 4, [10, 50], 0, "pooled")
    assert len(mix) == len(pooled) == 2
    assert max(mix) < 0.1 and max(pooled) < 0.15
    assert prior_fit.main(["--requests", "20", "--drafts", "2", "--at", "10,20", "--seeds", "1"]) == 0
    out = capsys.readouterr().out
    assert "| 2 | " in out and "mixture" in out


def test_a_rejecting_request_leaves_a_class_of_quoting_requests_within_a_few_drafts(capsys):
    """After 128 requests that quote (per-position acceptance 0.6), a new request whose drafts
    are rejected: a rejected draft weighs little against a high acceptance, and the mixture
    keeps a share of its mass at the lowest grid point so that such a request leaves the
    class's prior within a few drafts (with the 2 % floor alone: 0.53 after 5)."""
    mix = prior_fit.escape(128, 30, 0.6, 4, 0.04, [0, 5], 0, "mixture")
    assert mix[0] > 0.5 and mix[1] < 0.3
    docs = prior_fit.escape(128, 30, 0.04, 4, 0.9, [0, 2], 0, "mixture")  # and the other way round
    assert docs[0] < 0.1 and docs[1] > 0.5
    argv = ["--requests", "20", "--drafts", "4", "--at", "20", "--seeds", "1", "--then", "0.05", "--after", "0,2"]
    assert prior_fit.main(argv) == 0
    assert "a new request at per-position acceptance 0.05" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["--acceptance", "1.5"],
        ["--drafts", "two"],
        ["--seeds", "0"],
        ["--k", "0"],
        ["--then", "2"],
        ["--then", "0.1", "--after", "x"],
        ["--then", "0.1", "--after", "-1"],
    ],
)
def test_prior_fit_refuses_bad_arguments(argv, capsys):
    assert prior_fit.main(argv) == 2
    captured = capsys.readouterr()
    assert "error:" in captured.err and captured.out == ""  # refused before any table
