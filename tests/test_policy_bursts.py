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


def test_with_step_times_a_lone_rejected_request_stops_drafting(capsys):
    """At one request with a K > 0 step 28 % dearer than a step at K = 0 (an offline GPU
    host's figures), the requests whose drafts are rejected draft in a minority of their
    steps once the bursts before them have set the prior; each quoting burst in all of them."""
    res = policy_bursts.run(
        batch=1, steps=43, pattern="qr", repeat=12, accepted=2, async_scheduling=True, step_ms=(2.58, 3.30)
    )
    assert min(res["q"][2:]) == 43
    assert max(res["r"][-4:]) < 21
    assert policy_bursts.main(["--batch", "1", "--steps", "20", "--repeat", "1", "--step-ms", "2.5,3.3"]) == 0
    assert "steps of 2.5 / 3.3 ms at K = 0 / K > 0" in capsys.readouterr().out


@pytest.mark.parametrize(
    "argv",
    [["--pattern", "qx"], ["--pattern", ""], ["--batch", "0"], ["--step-ms", "2.5"], ["--step-ms", "0,3"]],
)
def test_bad_arguments_are_refused_with_the_reason(argv, capsys):
    assert policy_bursts.main(argv) == 2
    assert "error:" in capsys.readouterr().err
