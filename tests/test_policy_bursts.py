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


@pytest.mark.parametrize("argv", [["--pattern", "qx"], ["--pattern", ""], ["--batch", "0"]])
def test_bad_arguments_are_refused_with_the_reason(argv, capsys):
    assert policy_bursts.main(argv) == 2
    assert "error:" in capsys.readouterr().err
