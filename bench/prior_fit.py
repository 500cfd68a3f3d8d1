"""``python -m bench prior-fit``: where the per-request gate puts a new request's acceptance
after a run of finished requests of one class, under each prior, without vLLM.

``--requests`` requests of one class finish one after another; each verifies
``--drafts`` drafts of ``--k`` tokens whose positions are accepted with probability
``--acceptance`` each (a draft stops at its first rejected token, the prefix rule of
``engine_host.request_gate``). Prints the class's prior mean (what a new request of the class
starts at, fraction 0..1) after each of ``--at`` finished requests, under the mixture prior
(the engine host's default) and the pooled one, the mean over ``--seeds`` seeds, and the
gate's own time per request (its verifications and its finish, where the mixture's fit is
paid), the median over the seeds.

Chat at temperature 0.8 on the 1.5B coder is about ``--drafts 2 --acceptance 0.03``: each
request verifies a few drafts, nearly all rejected, so each says little on its own
(docs/gpu.md, host 31).

``--then A``: after the class's requests, a new request of the same class whose positions are
accepted with probability ``A``, e.g. code after requests that quote (``--drafts 30
--acceptance 0.6 --then 0.04``): a second table gives its own estimate after each count in
``--after`` of its verified drafts, the mean over the seeds. A request unlike the window's
requests leaves the class's prior as fast as its verifications tell it apart.
"""

from __future__ import annotations

import argparse
import random
import statistics
import sys
import time
from typing import Any


def run(
    requests: int,
    drafts: int,
    acceptance: float,
    k: int,
    at: list[int],
    seed: int,
    prior: str,
    clock: list[float] | None = None,
) -> list[float]:
    """The class's prior mean (fraction 0..1) after each count in ``at`` of ``requests``
    finished requests, each verifying ``drafts`` ``k``-token drafts accepted per position with
    probability ``acceptance``, under ``prior`` (``mixture`` or ``pooled``). ``clock``: gets
    the gate's time per request (s: its verifications and its finish) appended.

    Raises:
        ValueError: a count below 1, ``acceptance`` outside 0..1, or an unknown ``prior``.
    """
    from engine_host.request_gate import RequestDraftGate

    _check(requests, drafts, acceptance, k, at)
    rng = random.Random(seed)
    gate = RequestDraftGate(prior=prior)
    means = _finish_requests(gate, rng, requests, drafts, acceptance, k, at, clock)
    return [means[n] for n in at if n in means]


def _check(requests: int, drafts: int, acceptance: float, k: int, at: list[int]) -> None:
    if requests < 1 or drafts < 1 or k < 1 or not at or min(at) < 1:
        raise ValueError("--requests, --drafts, --k and --at need values >= 1")
    if not 0.0 <= acceptance <= 1.0:
        raise ValueError(f"--acceptance is a fraction 0..1, got {acceptance}")


def _check_then(then: float, after: list[int]) -> None:
    if not 0.0 <= then <= 1.0 or not after or min(after) < 0:
        raise ValueError("--then is a fraction 0..1 and --after takes counts >= 0")


def _draft(rng: random.Random, k: int, acceptance: float) -> int:
    """Tokens accepted of a k-token draft, each position accepted with probability ``acceptance``."""
    n = 0
    while n < k and rng.random() < acceptance:
        n += 1
    return n


def _finish_requests(
    gate: Any,
    rng: random.Random,
    requests: int,
    drafts: int,
    acceptance: float,
    k: int,
    at: list[int],
    clock: list[float] | None,
) -> dict[int, float]:
    """Run ``requests`` requests of class ``sampled`` through ``gate`` to their finish; the
    class's prior mean after each count in ``at``."""
    means = {}
    spent = 0.0
    for i in range(1, requests + 1):
        rid = f"r{i}"
        accepted = [_draft(rng, k, acceptance) for _ in range(drafts)]
        t = time.perf_counter()
        gate.set_class(rid, "sampled")
        for n in accepted:
            gate.observe(rid, k, n)
        gate.forget(req_id=rid)
        spent += time.perf_counter() - t
        if i in at:
            means[i] = gate.prior_mean("sampled")
    if clock is not None:
        clock.append(spent / requests)
    return means


def escape(
    requests: int, drafts: int, acceptance: float, k: int, then: float, after: list[int], seed: int, prior: str
) -> list[float]:
    """A new request's own acceptance estimate (fraction 0..1) after each count in ``after``
    of its verified ``k``-token drafts, accepted per position with probability ``then``, in a
    class whose ``requests`` finished requests were as in :func:`run`.

    Raises:
        ValueError: as :func:`run`, or ``then`` outside 0..1 or a negative count in ``after``.
    """
    import copy

    from engine_host.request_gate import RequestDraftGate

    _check(requests, drafts, acceptance, k, [requests])
    _check_then(then, after)
    rng = random.Random(seed)
    gate = RequestDraftGate(prior=prior)
    _finish_requests(gate, rng, requests, drafts, acceptance, k, [requests], None)
    out = []
    for v in after:
        g = copy.deepcopy(gate)  # each count from the same class state (the pooled prior learns from every draft)
        g.set_class("new", "sampled")
        for _ in range(v):
            g.observe("new", k, _draft(rng, k, then))
        out.append(g.acceptance("new"))
    return out


def main(argv: list[str] | None = None) -> int:
    """Command line; see the module docstring."""
    ap = argparse.ArgumentParser(
        prog="python -m bench prior-fit", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    ap.add_argument("--requests", type=int, default=200, help="finished requests of the class (default: 200)")
    ap.add_argument("--drafts", default="1,2,4,8", help="drafts each request verifies, one row each (default: 1,2,4,8)")
    ap.add_argument("--acceptance", type=float, default=0.03, help="per-position acceptance, 0..1 (default: 0.03)")
    ap.add_argument("--k", type=int, default=4, help="draft length K, tokens (default: 4)")
    ap.add_argument(
        "--at", default="10,25,50,100,200", help="finished requests to report after (default: 10,25,50,100,200)"
    )
    ap.add_argument("--seeds", type=int, default=5, help="runs averaged per cell (default: 5)")
    ap.add_argument(
        "--then",
        type=float,
        metavar="A",
        help="then a new request of the class at per-position acceptance A (0..1): its own estimate after "
        "each count of --after verified drafts (a second table)",
    )
    ap.add_argument("--after", default="0,1,2,3,5,8", help="the new request's verified drafts (default: 0,1,2,3,5,8)")
    args = ap.parse_args(argv)
    try:
        drafts = [int(v) for v in args.drafts.split(",")]
        at = sorted({int(v) for v in args.at.split(",")})
        after = [int(v) for v in args.after.split(",")]
    except ValueError:
        print("error: --drafts, --at and --after take comma-separated whole numbers", file=sys.stderr)
        return 2
    if args.seeds < 1:
        print("error: --seeds needs a value >= 1", file=sys.stderr)
        return 2
    at = [n for n in at if n <= args.requests]
    try:  # every argument checked before the first table is printed
        for d in drafts:
            _check(args.requests, d, args.acceptance, args.k, at)
        if args.then is not None:
            _check_then(args.then, after)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    print(
        f"class prior mean after {', '.join(map(str, at))} finished requests; drafts of {args.k} tokens, "
        f"per-position acceptance {args.acceptance}, mean of {args.seeds} seeds\n"
    )
    print("| drafts per request | mixture | pooled | gate's time per request, µs: mixture / pooled |")
    print("|---:|---|---|---|")
    for d in drafts:
        cells = []
        clocks: dict[str, list[float]] = {"mixture": [], "pooled": []}
        for prior in ("mixture", "pooled"):
            runs = [
                run(args.requests, d, args.acceptance, args.k, at, s, prior, clocks[prior]) for s in range(args.seeds)
            ]
            cells.append(" / ".join(f"{statistics.mean(col):.3f}" for col in zip(*runs)))
        us = " / ".join(f"{statistics.median(clocks[p]) * 1e6:.1f}" for p in ("mixture", "pooled"))
        print(f"| {d} | {cells[0]} | {cells[1]} | {us} |")
    if args.then is None:
        return 0
    print(
        f"\na new request at per-position acceptance {args.then} after the {args.requests} requests: its own "
        f"estimate after {', '.join(map(str, after))} verified drafts, mean of {args.seeds} seeds\n"
    )
    print("| drafts per request (the class's) | mixture | pooled |")
    print("|---:|---|---|")
    for d in drafts:
        cells = []
        for prior in ("mixture", "pooled"):
            runs = [
                escape(args.requests, d, args.acceptance, args.k, args.then, after, s, prior) for s in range(args.seeds)
            ]
            cells.append(" / ".join(f"{statistics.mean(col):.3f}" for col in zip(*runs)))
        print(f"| {d} | {cells[0]} | {cells[1]} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
