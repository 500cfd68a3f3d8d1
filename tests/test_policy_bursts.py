"""``python -m bench policy-bursts``: the adaptive policy's drafting, burst by burst, on the stand-in."""

from __future__ import annotations

import pytest

from bench import policy_bursts


def test_bursts_that_quote_are_drafted_and_the_others_hardly(capsys):
    res = policy_bursts.run(batch=16, steps=200, pattern="qrr", repeat=3, accepted=2, async_scheduling=True)
    assert len(res["q"]) == 3 and len(res["r"]) == 6
    assert min(res["q"][1:]) >= 120  # after the first pattern, every quoting burst drafts most steps
    assert max(res["r"][2:]) < 60  # a rejected burst drafts in few
    assert (
        policy_bursts.main(["--batch", "8", "--steps", "80", "--repeat", "2", "--pattern", "qr", "--settle", "0"]) == 0
    )
    out = capsys.readouterr().out
    assert "| 2 | drafts accepted (quotes) |" in out and "| 2 | drafts rejected |" in out


def test_a_lone_rejecting_request_after_quoting_ones_stops_sooner_under_the_mixture_prior(capsys):
    """One request at a time, priced as on an H200 at 1 request: a request whose drafts are
    rejected after one whose drafts are accepted whole drafts fewer steps under the mixture
    prior (the default) than under the pooled one; the quoting ones draft in every step."""
    runs = {
        mode: policy_bursts.run(1, 20, "qr", 6, 4, True, mode, price=(0.02, 0.29))
        for mode in ("adaptive_pooled", "adaptive")
    }
    assert min(runs["adaptive"]["q"][2:]) == 20 and min(runs["adaptive_pooled"]["q"][2:]) == 20
    assert sum(runs["adaptive"]["r"][2:]) < 0.75 * sum(runs["adaptive_pooled"]["r"][2:])
    argv = ["--batch", "1", "--steps", "20", "--pattern", "qr", "--repeat", "2", "--price", "0.02,0.29"]
    assert policy_bursts.main([*argv, "--mode", "adaptive_pooled"]) == 0
    assert "adaptive_pooled, 1 requests" in capsys.readouterr().out


def test_closed_loop_requests_after_quoting_ones_do_not_keep_a_whole_batch_drafting(capsys):
    """Async scheduling, 8 requests, each replaced after 20 steps (closed-loop clients),
    priced as at 64 requests on an H200: in a burst whose drafts are rejected after a burst
    that quoted, each new request starts at a prior the quoting requests left high, and its
    drafts alone would pay for it. Every request verifies the step's drafts, so the batch
    decides (``RequestDraftGate.batch_pays``): it drafts in a few steps, not in every step
    that has a new request (34 of 60 when one request's drafts decided). The quoting bursts
    still draft in nearly every step."""
    res = policy_bursts.run(8, 60, "qr", 2, 2, True, "adaptive", price=(0.14, 0.05), turnover=20)
    assert res["r"][1] < 20
    assert res["q"][1] >= 50
    argv = ["--batch", "4", "--steps", "30", "--pattern", "qr", "--repeat", "1", "--turnover", "10", "--settle", "0"]
    assert policy_bursts.main(argv) == 0
    assert "each request replaced after 10 steps" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [
        ["--turnover", "-1"],
        ["--pattern", "qx"],
        ["--pattern", ""],
        ["--batch", "0"],
        ["--price", "0.1"],
        ["--price=-1,0.2"],
        ["--mode", "fixed:4"],
        ["--mode", "adaptive_turbo"],
        ["--step-ms", "-1"],
    ],
)
def test_bad_arguments_are_refused_with_the_reason(argv, capsys):
    assert policy_bursts.main(argv) == 2
    assert "error:" in capsys.readouterr().err
