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


@pytest.mark.parametrize(
    "argv",
    [["--acceptance", "1.5"], ["--drafts", "two"], ["--seeds", "0"], ["--k", "0"]],
)
def test_prior_fit_refuses_bad_arguments(argv, capsys):
    assert prior_fit.main(argv) == 2
    assert "error:" in capsys.readouterr().err
