"""Draft length per request (engine_host/request_gate.py), from constructed statistics."""

from __future__ import annotations

import pytest

from control.views import common
from control.views import live as live_views
from engine_host.config import LiveConfig
from engine_host.request_gate import RequestDraftGate, draft_token_cost

COST = draft_token_cost(t_plain_s=0.020, t_spec_s=0.026, k=4)  # 6 ms for 4 tokens -> 0.075 per token


def _feed(gate: RequestDraftGate, rid: str, acceptance: float, steps: int = 20, k: int = 4) -> None:
    for _ in range(steps):
        gate.observe(rid, k, round(acceptance * k))


def test_cost_is_the_extra_step_time_per_draft_token_over_the_plain_step():
    assert COST == pytest.approx(0.075)
    assert draft_token_cost(0.02, 0.019, 4) == 0.0  # never negative
    assert draft_token_cost(0.02, 0.03, 0) == 0.0


def test_zero_acceptance_request_drafts_nothing_while_a_request_at_08_drafts_k():
    g = RequestDraftGate(pool_decay=0.0)  # each request on its own (the pooled prior: below)
    _feed(g, "copy", 0.8, k=5)  # 4 of 5 accepted: 0.8
    _feed(g, "chat", 0.0)
    g.begin_step()
    assert g.allows("copy", 4, COST) is True
    assert g.allows("chat", 4, COST) is False
    assert (g.last_total, g.last_verified) == (2, 1)
    assert g.acceptance("chat") < 0.1 < 0.7 < g.acceptance("copy") <= 1.0


def test_bounds_and_expected_gain():
    assert RequestDraftGate.expected_gain(0.0, 4) == 0.0
    assert RequestDraftGate.expected_gain(1.0, 4) == 4.0
    assert RequestDraftGate.expected_gain(0.5, 2) == pytest.approx(0.75)
    g = RequestDraftGate()
    assert g.pays("new", 0, COST) is False  # no draft: nothing to verify
    assert g.acceptance("new") == 0.5  # the prior's mean before any draft
    assert g.pays("new", 4, COST) is True  # a new request is judged on its own drafts first
    with pytest.raises(ValueError):
        RequestDraftGate(decay=0.0)
    with pytest.raises(ValueError):
        RequestDraftGate(probe_every=0)


def test_a_dropped_request_is_probed_and_drafted_again_once_it_accepts():
    g = RequestDraftGate(probe_every=4)
    _feed(g, "r", 0.0)
    decisions = [g.allows("r", 4, COST) for _ in range(8)]
    assert decisions == [False, False, False, True, False, False, False, True]
    _feed(g, "r", 1.0, steps=10)  # the probes' drafts are now accepted
    assert all(g.allows("r", 4, COST) for _ in range(5))


def test_summary_reports_drafted_counts_and_acceptance_distribution_and_forgets_finished():
    g = RequestDraftGate()
    _feed(g, "a", 0.0)
    _feed(g, "b", 1.0)
    _feed(g, "c", 0.5)
    g.begin_step()
    for rid in "abc":
        g.allows(rid, 4, COST)
    s = g.summary()
    assert s["requests_with_drafts"] == 3 and s["requests_verified"] == 2
    assert sum(s["acceptance_hist"]) == 3
    assert s["acceptance_hist"][0] == 1 and s["acceptance_hist"][-1] == 1
    g.forget(live_ids={"a"})
    assert sum(g.summary()["acceptance_hist"]) == 1


def test_live_page_line_says_how_many_requests_drafted():
    st = common.HostStatus(
        name="h",
        url="u",
        up=True,
        k_max_engine=8,
        per_request={
            "enabled": True,
            "requests_with_drafts": 5,
            "requests_verified": 2,
            "acceptance_bins": [0.0, 0.2, 0.4, 0.6, 0.8],
            "acceptance_hist": [3, 0, 0, 0, 2],
        },
    )
    line = live_views.per_request_line(st)
    assert "2 of 5" in line and "3 at 0%-20%" in line and "2 at 80%-100%" in line
    st.per_request = dict(
        st.per_request, prior_acceptance=0.3, prior_acceptance_by_class={"sampled": 0.04, "greedy": 0.62}
    )
    assert "a new request starts at 62% (greedy), 4% (sampled)" in live_views.per_request_line(st)
    st.per_request = dict(st.per_request, prior="mixture")
    assert "4% (sampled), from the finished requests of its class" in live_views.per_request_line(st)
    assert "probes every" not in live_views.per_request_line(st)  # synchronous scheduling: per request
    st.per_request = dict(st.per_request, probe_every_steps=16, probe_interval_steps=64)
    assert "probes every 64 steps (backed off from 16" in live_views.per_request_line(st)
    st.per_request = dict(st.per_request, probe_interval_steps=16)
    line = live_views.per_request_line(st)
    assert "probes every 16 steps" in line and "backed off" not in line
    st.per_request = dict(st.per_request, gain="calibrated")
    assert "drafts priced by what drafts at a like acceptance yielded · probes" in live_views.per_request_line(st)
    st.per_request = {"enabled": False}
    assert "off" in live_views.per_request_line(st)
    st.k_max_engine = 0
    assert live_views.per_request_line(st) is None


def test_acceptance_is_per_token_under_the_prefix_rule_not_the_accepted_fraction():
    """A request that accepts about 0.84 of each next token drafts 8 and keeps on average
    half of them (the tokens after the first rejection are never judged). Its drafts pay
    at a cost of 0.25 plain request-steps per token (gain 3.9 tokens >= 8 * 0.25); the
    accepted fraction (0.5) taken for the per-token acceptance would give 1.0 and drop them."""
    g = RequestDraftGate()
    for _ in range(10):
        for n in (8, 3, 1, 4):  # 16 accepted, 3 verifications ended at a rejection
            g.observe("quote", 8, n)
    assert g.acceptance("quote") == pytest.approx(16 / 19, abs=0.04)  # recent verifications weigh more
    assert g.allows("quote", 8, 0.25) is True
    assert RequestDraftGate.expected_gain(0.5, 8) < 8 * 0.25  # what the fraction would decide


def test_a_draft_accepted_whole_counts_no_rejection():
    g = RequestDraftGate(prior_accepted=0.0, prior_rejected=1.0, decay=1.0, pool_decay=0.0)
    g.observe("r", 4, 4)
    g.observe("r", 4, 4)
    assert g.acceptance("r") == pytest.approx(8 / 9)  # only the prior's failure
    g.observe("r", 4, 0)
    assert g.acceptance("r") < 8 / 9


def test_plan_keeps_a_request_whose_drafts_do_not_pay_from_drafting_and_probes_it():
    """The step's K follows the plans: a request planned out gets no draft at all (the
    hook runs the step at K = 0 when no request is planned in), every probe_every-th plan
    is a probe whose draft is then verified once, and a request that starts accepting is
    planned in again."""
    g = RequestDraftGate(probe_every=4)
    _feed(g, "chat", 0.0)
    _feed(g, "copy", 0.8, k=5)
    assert g.plan("copy", 4, COST) is True
    plans = [g.plan("chat", 4, COST) for _ in range(8)]
    assert plans == [False, False, False, True, False, False, False, True]
    g.begin_step()
    assert g.allows("chat", 4, COST) is True  # the planned probe's draft is verified
    assert g.allows("chat", 4, COST) is False  # once
    assert g.plan("new", 4, COST) is True  # a new request is drafted on the prior
    _feed(g, "chat", 1.0, steps=10)
    assert g.plan("chat", 4, COST) is True


def _step_time(idle_step_cost: bool = False):
    """A fitted step-time model at batch 1: a step verifying 8 drafts costs 30 % more than
    a plain one; with ``idle_step_cost`` a step at K > 0 verifying none costs 7.5 % more
    (the proposer and the draft fetch)."""
    from engine_host.controller import StepTimeModel

    step_time = StepTimeModel()
    for _ in range(50):
        step_time.observe(1, 1, 0.020, k=0)
        step_time.observe(1, 9, 0.026, k=8)
        if idle_step_cost:
            step_time.observe(1, 1, 0.0215, k=1)
    return step_time


def _hook(
    step_time, controller_k: int, probe_every: int, request_ids, gate_drafts: bool = True, pool_decay: float = 0.0
):
    """The scheduler hook's K decision (``_decide_k``) without vLLM: an adaptive policy
    that answers ``controller_k`` (bound 8), the per-request gate on, these requests running
    (each request's prior fixed at 0.5 unless ``pool_decay`` > 0)."""
    import types

    from engine_host.scheduler import _SpecPilotHook

    h = object.__new__(_SpecPilotHook)
    h.GATE_DRAFTS = gate_drafts
    h.controller = types.SimpleNamespace(
        step_time=step_time,
        k_for_batch=lambda b: controller_k,
        policy=types.SimpleNamespace(k_hi=8),
        record_scheduled=lambda k_policy, k: None,
        exploring=lambda: False,
    )
    h._k_engine = 8
    h._gate = RequestDraftGate(probe_every=probe_every, pool_decay=pool_decay)
    h._gate_on = True
    h._warmup_k = None
    h._k_first_use_step = 0
    h._step_index = 0
    h._overhead_s = 0.0
    h._overhead_cpu_s = 0.0
    h._steps_planned_out = 0
    h._probe_interval = probe_every
    h._probe_newest = None
    h._probe_by_prior = True
    h._new_request_share = None
    h._batch_k_memo = (0, -(1 << 62))
    h._wants_memo = h._WANTS_STALE
    h._config = LiveConfig()
    h._gate_cost_memo = {}
    h.running = [_req(r) for r in request_ids]
    return h


def _req(request_id: str):
    import types

    return types.SimpleNamespace(request_id=request_id)


def test_hook_runs_the_next_step_at_k0_when_no_running_request_would_draft():
    """The scheduler hook's K for the next step (``_decide_k``): the controller's K while a
    running request's drafts pay, 0 when the gate plans every running request out (at
    batch 1 on chat this spares the proposer and the draft fetch), the probe's K again
    after probe_every steps; the gate off (or fixed modes) leaves the controller's K."""
    hook = _hook(_step_time(), 8, 4, ["chat"])
    _feed(hook._gate, "chat", 0.0, k=8)
    assert [hook._decide_k(1) for _ in range(8)] == [0, 0, 0, 8, 0, 0, 0, 8]
    hook.running.append(_req("copy"))
    _feed(hook._gate, "copy", 0.9, k=8)
    assert hook._decide_k(2) == 8  # one request's drafts pay: the step drafts
    hook._gate_on = False  # fixed K, or adaptive without the per-request gate
    hook.running = hook.running[:1]
    assert [hook._decide_k(1) for _ in range(3)] == [8, 8, 8]


def test_on_the_synchronous_path_four_chat_requests_probes_share_their_steps_at_k():
    """The scheduler hook's K on the synchronous path (``_decide_k`` through
    ``RequestDraftGate.plan_batch``): four requests whose drafts never pay, joined at different
    steps, run one step in ten or more at K > 0 when each is probed every probe_every steps on
    its own (``probe_backoff`` 1, ``$SPECPILOT_PROBE_BACKOFF=0``), and under a quarter of that
    when their probes back off and are taken together (the engine host's default). The
    controller's K is 8 throughout: at K = 0 the gate does not probe a batch (it is explored)."""

    def steps_at_k(backoff: int) -> int:
        hook = _hook(_step_time(idle_step_cost=True), 8, 8, [])
        hook._gate = RequestDraftGate(probe_every=8, pool_decay=0.0, probe_backoff=backoff)
        at_k = 0
        for i in range(240):
            if i < 12 and i % 3 == 0:
                hook.running.append(_req(f"chat-{i}"))
                _feed(hook._gate, f"chat-{i}", 0.0)
            k = hook._decide_k(len(hook.running))
            if k > 0:  # the next step's offers and verifications (_gate_drafts): every draft rejected
                at_k += 1
                for req in hook.running:
                    hook._gate.observe_offer(req.request_id, True)
                    if hook._gate.allows(req.request_id, k, COST):
                        hook._gate.observe(req.request_id, k, 0)
        return at_k

    alone, shared = steps_at_k(1), steps_at_k(4)
    assert alone >= 24
    assert shared * 4 <= alone


def test_a_burst_after_a_drain_may_pay_unless_every_class_among_its_requests_seldom_pays():
    """``_burst_may_pay``: under the mixture prior a burst of sampled chat requests, whose class's
    finished requests' drafts were all rejected, is answered False (and counted); one greedy
    request among them, of a class where one request in five quotes, makes it True; under the
    pooled prior, or with the gate off, always True."""
    hook = _hook(_step_time(idle_step_cost=True), 0, 16, [f"chat-{i}" for i in range(4)])
    gate = hook._gate = RequestDraftGate(prior="mixture")
    hook._drain_explores_skipped = 0
    for i in range(20):
        _finish(gate, f"old-chat-{i}", "sampled", 0, steps=3)
        _finish(gate, f"old-code-{i}", "greedy", 4 if i % 5 == 0 else 0, steps=6)
    for i in range(4):
        gate.set_class(f"chat-{i}", "sampled")
    assert hook._burst_may_pay() is False
    assert hook._drain_explores_skipped == 1
    hook.running.append(_req("code"))
    gate.set_class("code", "greedy")
    assert hook._burst_may_pay() is True
    hook.running.pop()
    gate.prior = "pooled"
    assert hook._burst_may_pay() is True
    gate.prior = "mixture"
    hook._gate_on = False
    assert hook._burst_may_pay() is True


@pytest.mark.parametrize("gate_drafts", [True, False])
def test_an_exploration_runs_past_the_gate_only_where_a_running_requests_class_may_pay(gate_drafts):
    """``_decide_k`` at an exploration of the adaptive policy with four requests running
    (``EXPLORE_PAST_GATE_MIN_BATCH``), on both scheduling paths: four sampled chat requests of a
    class whose finished requests' drafts were all rejected are left to the gate, which holds the
    step at K = 0 (the step counted as held, its rule ``gate``); with a greedy request among them,
    of a class where one request in five quotes, the exploration runs at its K past the gate
    (rule ``explore``); with ``$SPECPILOT_EXPLORE_BY_CLASS=0`` every exploration runs past it. A
    held exploration is ended at that step (the policy's ``end_exploration``), and drafts where the
    gate's own answer does (rule ``held``)."""
    hook = _hook(_step_time(idle_step_cost=True), 3, 16, [f"chat-{i}" for i in range(4)], gate_drafts=gate_drafts)
    hook.controller.exploring = lambda: True
    ended: list[int] = []
    hook.controller.end_exploration = lambda: ended.append(hook._step_index)
    gate = hook._gate = RequestDraftGate(prior="mixture", probe_every=16)
    for i in range(20):
        _finish(gate, f"old-chat-{i}", "sampled", 0, steps=3)
        _finish(gate, f"old-code-{i}", "greedy", 4 if i % 5 == 0 else 0, steps=6)
    for i in range(4):
        gate.set_class(f"chat-{i}", "sampled")
        _feed(gate, f"chat-{i}", 0.0, k=3)
    hook._explorations_held = 0
    assert hook._decide_k(4) == 0
    assert (hook._explorations_held, hook._k_rule, len(ended)) == (1, "gate", 1)
    hook.running.append(_req("code"))
    gate.set_class("code", "greedy")
    _feed(gate, "code", 0.0, k=3)
    assert hook._decide_k(5) == 3
    assert (hook._explorations_held, hook._k_rule, hook._k_explored, len(ended)) == (1, "explore", True, 1)
    hook.running.pop()
    hook._explore_by_class = False
    assert hook._decide_k(4) == 3
    assert (hook._explorations_held, hook._k_rule, len(ended)) == (1, "explore", 1)
    # held, and the gate's own answer drafts: the chat requests' own drafts now pay (rule ``held``)
    hook._explore_by_class = True
    for i in range(4):
        _feed(gate, f"chat-{i}", 1.0, k=3)
    hook._wants_dirty = True
    assert hook._decide_k(4) == 3
    assert (hook._explorations_held, hook._k_rule, hook._k_explored, len(ended)) == (2, "held", False, 2)


def test_under_async_scheduling_the_gate_sets_the_step_k_and_probes_every_request_at_once():
    """With async scheduling (``GATE_DRAFTS`` False) drafts cannot be dropped per request,
    so one request's probe would make the whole step draft. The hook then plans without
    per-request probes and runs one step at the controller's K for all after probe_every
    steps at K = 0: requests that joined at different steps do not probe in turn (with
    per-request probes, two requests two steps apart make every other step draft)."""
    from engine_host.scheduler import SpecPilotAsyncScheduler, _SpecPilotHook

    assert SpecPilotAsyncScheduler.GATE_DRAFTS is False and _SpecPilotHook.GATE_DRAFTS is True
    step_time = _step_time()

    def hook(gate_drafts: bool):
        h = _hook(step_time, 8, 4, ["chat-1"], gate_drafts=gate_drafts)
        _feed(h._gate, "chat-1", 0.0, k=8)
        return h

    ks = {}
    for gate_drafts in (True, False):
        h = hook(gate_drafts)
        seq = [h._decide_k(1) for _ in range(2)]
        h.running.append(_req("chat-2"))  # joins two steps later
        _feed(h._gate, "chat-2", 0.0, k=8)
        seq += [h._decide_k(2) for _ in range(10)]
        ks[gate_drafts] = seq
    assert ks[True] == [0, 0, 0, 8, 0, 8, 0, 8, 0, 8, 0, 8]  # each request's own probe
    # one probe step for both (counted afresh from chat-2's join), and the next one after
    # twice as many steps, since that probe's result still paid for nobody
    assert ks[False] == [0, 0, 0, 8, 0, 0, 0, 0, 0, 0, 0, 8]
    h = hook(False)
    h.running.append(_req("copy"))
    _feed(h._gate, "copy", 0.9, k=8)
    assert [h._decide_k(2) for _ in range(3)] == [8, 8, 8]  # one request's drafts pay
    h._gate_on = False
    h.running = h.running[:1]
    assert [h._decide_k(1) for _ in range(3)] == [8, 8, 8]


def test_depth_adds_draft_positions_while_their_acceptance_beats_their_cost():
    gate = RequestDraftGate(pool_decay=0.0)
    assert gate.depth("new", 0.0375, 8) == 4  # prior 0.5: 0.5^4 = 0.0625 >= 0.0375 > 0.5^5
    _feed(gate, "copy", 0.95, k=8)
    assert gate.depth("copy", 0.0375, 8) == 8
    assert gate.depth("copy", 0.0375, 3) == 3  # never past k_max
    _feed(gate, "chat", 0.0, k=8)  # a = 1 / 12 under the prior and decay 0.9
    assert gate.depth("chat", 0.0375, 8) == 1  # its first token still beats its verification;
    assert gate.depth("chat", 0.1, 8) == 0  # whether that pays for a step at K > 0: plan()
    assert gate.depth("copy", 0.0375, 0) == 0


def test_at_batch_1_a_request_runs_at_its_own_depth_when_the_controller_says_less():
    """After chat the controller's per-position estimates say K = 0, where nothing is
    learned; a new request alone in the batch is drafted at its own depth (the prior's
    first, then what its drafts show), a request whose drafts are rejected stays at K = 0,
    and with two requests (synchronous scheduling) the step's K is the controller's (the
    gate may only lower it; the batch's own K, ``_batch_k``, is used under async scheduling)."""
    hook = _hook(_step_time(idle_step_cost=True), 0, 16, ["docs"])
    k_new = hook._decide_k(1)
    assert 1 <= k_new < 8  # judged at the prior (0.5)
    _feed(hook._gate, "docs", 0.95, k=k_new)
    assert hook._decide_k(1) == 8  # its drafts are accepted: its own depth
    hook.running = [_req("chat")]
    _feed(hook._gate, "chat", 0.0, k=8)
    assert [hook._decide_k(1) for _ in range(3)] == [0, 0, 0]
    hook.running = [_req("docs"), _req("chat")]
    assert hook._decide_k(2) == 0  # several requests: the controller's K
    hook._gate_on = False
    hook.running = hook.running[:1]
    assert hook._decide_k(1) == 0


def test_a_request_that_never_has_a_draft_is_planned_out_when_a_step_at_k_costs_something():
    """An n-gram proposer finds no draft where the text does not repeat, so such a request
    teaches the acceptance estimate nothing; the share of steps in which it had a draft
    does: with the 2-core CPU's costs at batch 1 (a verified draft token 5.7 % of a plain
    step, a step at K > 0 6 % even with nothing verified), it is planned out at K = 4, though
    its drafts, when it has one, would pay their verification; a new request, and one that
    drafts every step, are planned in."""
    g = RequestDraftGate(probe_every=100, pool_decay=0.0)
    for i in range(20):
        g.observe_offer("chat", i == 19)  # one draft in 20 steps, rejected
        g.observe_offer("copy", True)
    _feed(g, "chat", 0.0, steps=1, k=8)
    assert g.draft_rate("new") == 1.0 and g.draft_rate("chat") < 0.25 < 0.9 < g.draft_rate("copy")
    assert 0.25 < g.acceptance("chat") < 0.5  # one verified draft says little
    assert g.pays("chat", 4, 0.057) is True  # a draft it has pays its verification
    assert g.plan("chat", 4, 0.057, step_cost=0.06) is False  # but it seldom has one
    assert g.plan("chat", 4, 0.057, step_cost=0.0) is True  # a free step at K > 0: let it draft
    assert g.plan("new", 4, 0.057, step_cost=0.06) is True
    assert g.plan("copy", 4, 0.057, step_cost=0.06) is True


def test_a_new_request_starts_at_the_acceptance_of_the_traffic_before_it():
    """A new request's prior is the per-token acceptance pooled over the requests before
    it: after chat (drafts rejected) it starts low and is not drafted at the prior's depth,
    after docs (drafts accepted) it starts high and is drafted at once; with nothing seen
    yet, and with pooling off, it starts at the configured prior's mean."""
    g = RequestDraftGate()
    assert g.prior_mean() == g.acceptance("new") == 0.5
    for i in range(6):
        _feed(g, f"chat-{i}", 0.0, steps=10)
    assert g.acceptance("new-chat") < 0.05
    assert g.depth("new-chat", 0.0375, 8) == 0  # with the prior fixed at 0.5: 4 (above)
    assert g.summary()["prior_acceptance"] < 0.05
    for i in range(6):
        _feed(g, f"docs-{i}", 0.8, steps=10, k=5)
    assert g.acceptance("new-docs") > 0.6
    assert g.depth("new-docs", 0.0375, 8) >= 6
    fixed = RequestDraftGate(pool_decay=0.0)
    _feed(fixed, "chat", 0.0, steps=30)
    assert fixed.acceptance("new") == 0.5
    with pytest.raises(ValueError):
        RequestDraftGate(pool_decay=1.5)


def test_the_pooled_prior_follows_a_change_from_copy_to_chat_within_tens_of_rejections():
    """The pool fades once per token judged: after copy traffic (whole 8-token drafts
    accepted), 40 rejected chat drafts bring a new request's prior below 0.5. Faded once per
    verification, the copy traffic's 8 tokens a verification outweighed the rejections for
    about three times as long (0.82 after 40; an engine test saw 0.83 after chat followed
    copy traffic, and every new chat request was drafted at depth for its first steps)."""
    g = RequestDraftGate()
    for _ in range(60):
        g.observe("copy", 8, 8)
    assert g.prior_mean() > 0.95
    for n in range(40):
        g.observe(f"chat-{n // 10}", 4, 0)
    assert g.prior_mean() < 0.5
    assert g.depth("new-chat", 0.0375, 8) <= 4  # 8 when faded once per verification
    # and a few verifications of copy traffic do not swamp a long chat history either
    for n in range(200):
        g.observe(f"chat-{n // 10}", 4, 0)
    g.observe("copy-2", 8, 8)
    assert g.prior_mean() < 0.25


def test_at_batch_1_a_chat_request_after_chat_runs_at_k0_from_its_first_step():
    """After chat traffic the controller says K = 0, and a new chat request alone in the
    batch is not drafted at the prior's depth for its first steps either: its estimate
    starts at the traffic's pooled acceptance (on the GPU each such request had run its
    first steps at K > 0: docs/gpu.md)."""
    hook = _hook(_step_time(idle_step_cost=True), 0, 16, ["chat-0"], pool_decay=0.98)
    assert hook._decide_k(1) >= 1  # nothing seen yet: the prior's 0.5
    for i in range(4):
        _feed(hook._gate, f"chat-{i}", 0.0, steps=10, k=8)
    hook.running = [_req("chat-new")]
    assert [hook._decide_k(1) for _ in range(3)] == [0, 0, 0]
    # a docs request after the chat: probed at shallow depth, then drafted at its own depth
    hook.running = [_req("docs-new")]
    ks = [hook._decide_k(1) for _ in range(16)]
    assert ks[:15] == [0] * 15 and 1 <= ks[15] <= hook.PROBE_DEPTH
    _feed(hook._gate, "docs-new", 1.0, steps=3, k=ks[15])
    assert hook._decide_k(1) >= 4


def test_at_batch_1_a_request_whose_own_depth_is_0_is_still_probed_at_shallow_depth():
    """Where neither the controller nor the request's own estimate drafts, the lone request
    is probed at PROBE_DEPTH every probe_every steps (K = 0 in between), so that a request
    that starts to quote is found without waiting for the controller's exploration."""
    hook = _hook(_step_time(idle_step_cost=True), 0, 16, ["chat"], pool_decay=0.98)
    _feed(hook._gate, "chat", 0.0, steps=30, k=8)
    assert hook._gate.depth("chat", hook._draft_token_cost(1, 8), 8) == 0
    ks = [hook._decide_k(1) for _ in range(32)]
    assert ks == ([0] * 15 + [hook.PROBE_DEPTH]) * 2


def test_steps_are_counted_and_k_reported_as_scheduled_not_as_the_policy_chose():
    """The controller's steps_at_k (the specpilot:steps counter, the benchmarks' mean K) and
    k_current (the live K) follow the K the hook scheduled: on chat the policy may answer
    K = 4 while the gate runs the step at K = 0 (a probe every probe_every steps)."""
    from engine_host.config import SpeculationConfig
    from engine_host.controller import SpeculationController

    hook = _hook(_step_time(), 4, 4, ["chat"])
    ctl = SpeculationController(8, SpeculationConfig(mode="adaptive"))
    ctl.policy.k_for_batch = lambda b: 4  # the policy insists on K = 4
    ctl.step_time = hook.controller.step_time
    hook.controller = ctl
    _feed(hook._gate, "chat", 0.0, k=4)
    ks = [hook._decide_k(1) for _ in range(8)]
    assert ks == [0, 0, 0, 4, 0, 0, 0, 4]
    assert ctl.steps_at_k[0] == 6 and ctl.steps_at_k[4] == 2 and sum(ctl.steps_at_k) == 8
    assert ctl.k_current == 4
    hook._decide_k(1)
    assert ctl.k_current == 0
    assert ctl.snapshot(1)["steps_at_k"][0] == 7


def test_gate_costs_are_kept_for_a_few_steps_then_priced_again():
    """The gate's step-time inputs (``_SpecPilotHook._gate_costs``) come from the step-time
    model at most every ``GATE_COST_EVERY`` steps per (batch size, K): a model that moved is
    seen once that many steps have passed, and at once for another (batch size, K)."""
    h = _hook(_step_time(), controller_k=8, probe_every=16, request_ids=["a"])
    first = h._gate_costs(1, 8)
    h.controller.step_time = _step_time(idle_step_cost=True)  # a step at K > 0 now costs more
    for _ in range(h.GATE_COST_EVERY - 1):
        h._step_index += 1
        assert h._gate_costs(1, 8) == first
    assert h._gate_costs(1, 4) != h._gate_costs(1, 8)  # another depth is priced on its own
    h._step_index += 1
    again = h._gate_costs(1, 8)
    assert again != first
    assert again[1] > first[1]  # the idle speculative step's cost is now seen


def test_quiet_steps_are_folded_in_a_few_at_a_time_in_order_and_before_a_publish(tmp_path, monkeypatch):
    """A decode step that verified no draft is kept and given to the controller with the
    next ones (``QUIET_STEPS`` at a time), oldest first; a step with drafts, a state publish
    and a config change fold in what is kept first, so nothing is lost or reordered. (The
    full per-step path: at fixed K = 0 the hook otherwise takes its lean path, tested in
    tests/test_lean_path.py.)"""
    import types

    from bench.hook_cost import standin_hook

    monkeypatch.setenv("SPECPILOT_K0_LEAN", "0")

    hook, channel = standin_hook("fixed:0", 1, str(tmp_path))
    try:
        seen: list[tuple[int, float]] = []
        hook.controller.observe = lambda obs: seen.append((obs.k_drafted, obs.step_time_s))
        hook.controller.observe_quiet = lambda steps: seen.extend((0, st) for _b, _kp, st, _p, _now in steps)
        hook._last_publish = 1e18  # no publish from the step loop in this test
        times = iter([0.010 + i / 1000 for i in range(100)])
        hook._clock = types.SimpleNamespace(
            scheduled=lambda *a: None,
            output=lambda t, key=None: (next(times), types.SimpleNamespace(k_drafted=0, k_proposed=0, t_scheduled=t)),
        )

        def step():
            out = hook.schedule()
            hook.update_from_output(out, None)

        for _ in range(hook.QUIET_STEPS - 1):
            step()
        assert seen == []  # kept
        step()
        assert [t for _, t in seen] == [0.010 + i / 1000 for i in range(hook.QUIET_STEPS)]  # all, in order
        step()
        step()
        assert len(seen) == hook.QUIET_STEPS
        hook._publish(0.0)  # the state published says what the controller has seen
        assert len(seen) == hook.QUIET_STEPS + 2
        step()
        hook._drafted, hook._accepted = 2, 1  # a step that verified drafts: kept ones first
        hook._hist[0] = 1
        hook._dhist[0] = hook._dhist[1] = 1
        step()
        assert [t for _, t in seen[-2:]] == [
            0.010 + (hook.QUIET_STEPS + 2) / 1000,
            0.010 + (hook.QUIET_STEPS + 3) / 1000,
        ]
        assert hook._quiet == []
        step()
        step()
        _, payload = channel.read_config()
        channel.write_config(2, payload["config"])  # a config change: kept steps first
        n = len(seen)
        hook.schedule()
        assert len(seen) == n + 2 and hook._quiet == []
    finally:
        channel.close()


def test_a_new_request_starts_at_the_acceptance_of_its_own_class():
    """Interleaved traffic (sampled chat between greedy requests that quote): with classes
    named, a new sampled request starts at what sampled requests were accepted at and a new
    greedy one at the greedy requests' rate; without them both start at the mix."""
    g, mixed = RequestDraftGate(), RequestDraftGate()
    for i in range(6):
        for gate in (g, mixed):
            gate.set_class(f"chat-{i}", "sampled")
            gate.set_class(f"docs-{i}", "greedy")
        for gate, (chat, docs) in ((g, (f"chat-{i}", f"docs-{i}")), (mixed, (f"c{i}", f"d{i}"))):
            _feed(gate, chat, 0.0, steps=10)
            _feed(gate, docs, 0.8, steps=10, k=5)
    g.set_class("new-chat", "sampled")
    g.set_class("new-docs", "greedy")
    assert g.acceptance("new-chat") < 0.05 < 0.4 < mixed.acceptance("new-chat")
    assert g.depth("new-chat", 0.0375, 8) == 0 < mixed.depth("new-chat", 0.0375, 8)
    assert g.acceptance("new-docs") > mixed.acceptance("new-docs") > 0.4
    by_class = g.summary()["prior_acceptance_by_class"]
    assert by_class["sampled"] < 0.05 and by_class["greedy"] > 0.6
    assert abs(g.summary()["prior_acceptance"] - mixed.summary()["prior_acceptance"]) < 1e-9
    g.set_class("other", "sampled")
    g.forget(live_ids={"new-docs"})
    assert g.acceptance("other") == pytest.approx(g.prior_mean())  # its class went with it


def test_async_probes_back_off_while_they_find_nothing_and_a_request_that_joins_resets_them():
    """Under async scheduling the all-request probe after which still nothing pays doubles
    the steps at K = 0 before the next, up to ``PROBE_BACKOFF`` times probe_every; a request
    that joins is probed after probe_every steps again, and one whose drafts pay drafts at
    once and brings the interval back."""
    h = _hook(_step_time(), 8, 4, ["chat-1"], gate_drafts=False)
    _feed(h._gate, "chat-1", 0.0, k=8)
    ks = [h._decide_k(1) for _ in range(60)]
    probes = [i for i, k in enumerate(ks) if k]
    assert probes == [3, 11, 27, 43, 59]  # after 4, 8, 16 and then 16 (= 4 x 4) steps at K = 0
    h.running = [_req("chat-2")]
    _feed(h._gate, "chat-2", 0.0, k=8)
    ks = [h._decide_k(1) for _ in range(8)]
    assert [i for i, k in enumerate(ks) if k] == [3]  # the new request: after probe_every again
    h.running = [_req("copy")]
    _feed(h._gate, "copy", 0.9, k=8)
    assert [h._decide_k(1) for _ in range(3)] == [8, 8, 8]
    assert h._probe_interval == 4


def test_under_async_scheduling_a_batch_drafts_when_its_requests_own_estimates_pay():
    """At batch > 1 under async scheduling the step's K is the deeper of the controller's and
    the one the requests' own estimates make best for the batch (``_batch_k``): after chat
    the controller sits at K = 0, and a batch of requests that quote is drafted from their
    estimates; a batch of chat requests is not, and one request that quotes among chat
    requests gets a K no deeper than among others that quote (every request verifies it).
    With synchronous scheduling the hook keeps the controller's K."""
    h = _hook(_step_time(), 0, 16, ["copy-1", "copy-2", "copy-3"], gate_drafts=False)
    for rid in ("copy-1", "copy-2", "copy-3"):
        _feed(h._gate, rid, 0.9, k=8)
    assert h._batch_k(3) == 8
    assert h._decide_k(3) == 8
    h = _hook(_step_time(), 0, 16, ["chat-1", "chat-2", "chat-3"], gate_drafts=False)
    for rid in ("chat-1", "chat-2", "chat-3"):
        _feed(h._gate, rid, 0.0, k=8)
    assert h._batch_k(3) == 0
    assert [h._decide_k(3) for _ in range(5)] == [0] * 5
    h = _hook(_step_time(), 0, 16, ["copy", "chat-1", "chat-2", "chat-3", "chat-4"], gate_drafts=False)
    _feed(h._gate, "copy", 0.9, k=8)
    for rid in ("chat-1", "chat-2", "chat-3", "chat-4"):
        _feed(h._gate, rid, 0.0, k=8)
    k_mixed = h._batch_k(5)
    h1 = _hook(_step_time(), 0, 16, ["copy", "other"], gate_drafts=False)
    for rid in ("copy", "other"):
        _feed(h1._gate, rid, 0.9, k=8)
    assert 0 < k_mixed <= h1._batch_k(2)
    h = _hook(_step_time(), 0, 16, ["copy-1", "copy-2"], gate_drafts=True)
    for rid in ("copy-1", "copy-2"):
        _feed(h._gate, rid, 0.9, k=8)
    assert h._decide_k(2) == 0  # synchronous scheduling: the controller's K


def test_under_async_scheduling_whether_drafts_pay_is_kept_a_few_steps_and_asked_again_after_a_verification(
    tmp_path,
):
    """Under async scheduling the first running request whose drafts pay answers whether the
    step drafts, and the answer is kept for ``GATE_COST_EVERY`` steps at the same K and batch:
    an estimate that changed is seen after that many steps, or at the next step once drafts
    were verified (``make_spec_decoding_stats`` drops the kept answer)."""
    from bench.hook_cost import standin_hook

    def two_chat_requests():
        h = _hook(_step_time(), 8, 1 << 20, ["chat-1", "chat-2"], gate_drafts=False)
        for rid in ("chat-1", "chat-2"):
            _feed(h._gate, rid, 0.0, k=8)
        h._batch_k_memo = (0, 1 << 62)  # the batch's own K out of the way: the controller's K is asked about
        assert h._decide_k(2) == 0
        _feed(h._gate, "chat-2", 1.0, k=8)  # its drafts now pay
        assert h._decide_k(2) == 0  # the kept answer
        return h

    h = two_chat_requests()
    h._wants_dirty = True  # what a verification does (below)
    assert h._decide_k(2) == 8
    h = two_chat_requests()
    for _ in range(h.GATE_COST_EVERY - 1):
        h._step_index += 1
        assert h._decide_k(2) == 0
    h._step_index += 1
    assert h._decide_k(2) == 8  # asked again after GATE_COST_EVERY steps
    hook, channel = standin_hook("adaptive", 2, str(tmp_path), async_scheduling=True)
    try:
        kept = hook._wants_memo = (4, hook.running[-1], 2, hook._step_index, False)
        hook.make_spec_decoding_stats(None, 0, 0, request_id=hook.running[0].request_id)
        assert hook._wants_memo == kept and not hook._wants_dirty  # nothing verified
        hook.make_spec_decoding_stats(None, 4, 0, request_id=hook.running[0].request_id)
        assert hook._wants_dirty  # asked again at the next step (2 requests: below 2 * BATCH_PAYS_REQUESTS)
        hook._step_index += 1
        hook._any_request_wants_drafts(4)
        assert hook._wants_memo[3] == hook._step_index and not hook._wants_dirty
    finally:
        channel.close()


def test_at_64_requests_the_batch_is_priced_again_every_few_steps_after_verifications(tmp_path):
    """The async gate's answer is a sum over every running request: after drafts were
    verified it is priced again at once below 2 * BATCH_PAYS_REQUESTS requests, and after
    B // BATCH_PAYS_REQUESTS steps above (a new answer, not a kept one, when K changes)."""
    from bench.hook_cost import standin_hook

    hook, channel = standin_hook("adaptive", 64, str(tmp_path), async_scheduling=True)
    try:
        every = 64 // hook.BATCH_PAYS_REQUESTS
        assert every == 4
        hook._any_request_wants_drafts(4)
        priced_at = hook._wants_memo[3]
        for _ in range(1, every):
            hook._step_index += 1
            hook.make_spec_decoding_stats(None, 4, 0, request_id=hook.running[0].request_id)
            hook._any_request_wants_drafts(4)
            assert hook._wants_memo[3] == priced_at  # kept
        hook._step_index += 1
        hook._any_request_wants_drafts(4)
        assert hook._wants_memo[3] == hook._step_index  # priced again
        hook._any_request_wants_drafts(2)
        assert hook._wants_memo[0] == 2  # another K: priced at once
    finally:
        channel.close()


def test_a_steps_verifications_folded_together_equal_one_observation_each(tmp_path):
    """The hook keeps each verification vLLM reports (``make_spec_decoding_stats``, once per
    request with drafts) and folds a step's together after vLLM's ``update_from_output``: the
    gate's estimates, the pooled priors, the step's token counts and the per-position
    histograms come out as one observation per verification gives them."""
    from bench.hook_cost import standin_hook

    judged = [("a", 4, 0), ("b", 4, 4), ("a", 3, 2), ("c", 2, 1), (None, 4, 1), ("b", 0, 0), ("d", 8, 8)]
    one_by_one = RequestDraftGate()
    one_by_one.set_class("b", "greedy")
    for rid, d, a in judged:
        if rid is not None:
            one_by_one.observe(rid, d, a)
    hook, channel = standin_hook("fixed:4", 2, str(tmp_path), async_scheduling=True)
    try:
        hook._gate.set_class("b", "greedy")
        for rid, d, a in judged:
            hook.make_spec_decoding_stats(None, d, a, request_id=rid)
        assert hook._drafted == 0  # kept until vLLM's update_from_output has returned
        hook._fold_verified()
        assert (hook._drafted, hook._accepted) == (25, 16)
        top = len(hook._hist)  # K_max = 4: a verification of 8 counts at every position
        assert hook._hist == [sum(1 for _, d, a in judged if d and a > i) for i in range(top)] == [5, 3, 2, 2]
        assert hook._dhist == [sum(1 for _, d, a in judged if d > i) for i in range(top)] == [6, 6, 5, 4]
        for rid in "abcd":
            assert hook._gate.acceptance(rid) == pytest.approx(one_by_one.acceptance(rid))
        for cls in (None, "greedy"):
            assert hook._gate.prior_mean(cls) == pytest.approx(one_by_one.prior_mean(cls))
        assert hook._verified == []
    finally:
        channel.close()


def _finish(gate: RequestDraftGate, rid: str, cls: str, accepted: int, steps: int, k: int = 4) -> None:
    gate.set_class(rid, cls)
    for _ in range(steps):
        gate.observe(rid, k, accepted)
    gate.forget(req_id=rid)


def test_the_mixture_prior_follows_the_finished_requests_of_a_class():
    """Greedy code requests that reject every draft between greedy docs requests that quote:
    the pooled prior's mean is set by the quoting requests' many judged tokens, the mixture's
    by requests, and after one rejected draft a new request under the mixture moves to the
    rejecting requests while the pooled one stays near the quoting ones' mean."""
    pooled, mix = RequestDraftGate(), RequestDraftGate(prior="mixture")
    for i in range(12):
        for gate in (pooled, mix):
            _finish(gate, f"code-{i}", "greedy", 0, steps=8)
            _finish(gate, f"docs-{i}", "greedy", 4, steps=40, k=5)  # 0.8 per token
            _finish(gate, f"chat-{i}", "sampled", 0, steps=20)
    assert mix.prior_mean("greedy") < 0.5 < pooled.prior_mean("greedy")
    assert mix.prior_mean("sampled") < 0.15
    for gate in (pooled, mix):
        gate.set_class("new-code", "greedy")
        gate.observe("new-code", 4, 0)
    assert mix.acceptance("new-code") < 0.25 < 0.45 < pooled.acceptance("new-code")
    # where a K = 4 step costs 29 % over a plain one, its drafts stop paying after that rejection
    assert not mix.plan("new-code", 4, 0.02, 0.29, probe=False)
    assert pooled.plan("new-code", 4, 0.02, 0.29, probe=False)
    # a new docs request whose first draft is accepted whole moves to the quoting requests
    mix.set_class("new-docs", "greedy")
    mix.observe("new-docs", 4, 4)
    assert mix.acceptance("new-docs") > 0.7
    assert mix.summary()["prior"] == "mixture" and set(mix.summary()["prior_acceptance_by_class"]) == {
        "greedy",
        "sampled",
    }


def test_the_mixture_estimate_is_recomputed_when_the_class_or_the_request_changes():
    g = RequestDraftGate(prior="mixture")
    g.set_class("a", "greedy")
    g.observe("a", 4, 2)
    first = g.acceptance("a")
    assert g.acceptance("a") == first  # cached
    _finish(g, "done", "greedy", 0, steps=10)  # the class's distribution moves down
    assert g.acceptance("a") < first
    before = g.acceptance("a")
    g.observe("a", 4, 4)  # its own accepted draft moves it up
    assert g.acceptance("a") > before
    with pytest.raises(ValueError):
        RequestDraftGate(prior="beta")
    with pytest.raises(ValueError):
        RequestDraftGate(prior="mixture", mixture_requests=0)


def test_a_batch_drafts_only_when_its_requests_gains_together_pay_for_every_verification():
    """Async scheduling: every request verifies the step's drafts. One request whose drafts
    pay for itself does not make a step at K > 0 pay for a batch of requests that reject."""
    g = RequestDraftGate(pool_decay=0.0)
    _feed(g, "quotes", 0.75)
    for i in range(15):
        _feed(g, f"chat-{i}", 0.0)
    c, step = 0.14, 0.05  # one verified draft token, a step at K > 0: fractions of a plain step
    assert g.plan("quotes", 4, c, step, probe=False)  # alone, its drafts pay
    assert not g.batch_pays(["quotes"] + [f"chat-{i}" for i in range(15)], 4, c, step)
    assert g.batch_pays(["quotes"], 4, c, step)  # the same request alone: as plan
    for i in range(3):
        _feed(g, f"docs-{i}", 0.75)
    assert g.batch_pays(["quotes", "docs-0", "docs-1", "docs-2", "chat-0"], 4, c, step)  # most quote
    assert not g.batch_pays(["quotes"], 0, c, step) and not g.batch_pays([], 4, c, step)
    # the price of a step at K > 0 is the batch's: four quoting requests at a steep step price
    assert not g.batch_pays(["quotes", "docs-0", "docs-1", "docs-2"], 4, c, 3.0)


def test_a_fit_of_one_class_leaves_the_cached_estimates_of_another_class_standing():
    """A fit moves one class's distribution: only that class's running requests compute
    their estimates again (the cache is checked against the class's own version)."""
    from engine_host.request_gate import MIXTURE_REFIT_EVERY

    g = RequestDraftGate(prior="mixture")
    for i in range(MIXTURE_REFIT_EVERY):  # both classes fitted at least once
        _finish(g, f"s{i}", "sampled", 0, steps=3)
        _finish(g, f"g{i}", "greedy", 2, steps=3)
    g.set_class("chat", "sampled")
    g.set_class("code", "greedy")
    g.observe("chat", 4, 0)
    g.observe("code", 4, 2)
    g.acceptance("chat"), g.acceptance("code")  # computed and cached
    g._reqs["chat"].est = g._reqs["code"].est = 0.123  # marks: a cached estimate is returned as is
    for i in range(MIXTURE_REFIT_EVERY):  # a fit of the greedy class (and of every request's)
        _finish(g, f"g-next{i}", "greedy", 4, steps=3)
    assert g.acceptance("chat") == 0.123  # the sampled class did not move: its cache stands
    assert g.acceptance("code") != 0.123  # the greedy class moved: computed again
    for i in range(MIXTURE_REFIT_EVERY):
        _finish(g, f"s-next{i}", "sampled", 4, steps=3)
    assert g.acceptance("chat") != 0.123


def test_the_pooled_prior_does_not_learn_from_finished_requests():
    g = RequestDraftGate()
    _finish(g, "done", "greedy", 0, steps=10)
    assert g._mix_n[None] == 0 and "greedy" not in g._mix


def test_the_mixture_prior_waits_for_finished_requests_and_uses_the_pooled_one_before():
    """Before a class has MIXTURE_MIN_REQUESTS finished requests, its requests are estimated
    under the pooled prior: a lone endless request whose drafts are all rejected goes as low
    as under the pooled prior, and greedy requests after chat do not start at chat's
    distribution."""
    from engine_host.request_gate import MIXTURE_MIN_REQUESTS

    mix, pooled = RequestDraftGate(prior="mixture"), RequestDraftGate()
    for gate in (mix, pooled):
        gate.set_class("lone", "greedy")
        for _ in range(30):
            gate.observe("lone", 4, 0)  # one endless request whose drafts are all rejected
    assert mix.acceptance("lone") == pooled.acceptance("lone") < 0.05
    mix, pooled = RequestDraftGate(prior="mixture"), RequestDraftGate()
    for gate in (mix, pooled):
        for i in range(MIXTURE_MIN_REQUESTS):
            _finish(gate, f"chat-{i}", "sampled", 0, steps=10)
    assert mix.prior_mean("sampled") < 0.25  # the class's own distribution, down from 0.5
    assert mix.prior_mean("greedy") == pooled.prior_mean("greedy") == 0.5  # no greedy request finished yet


def test_the_mixture_estimate_holds_where_the_likelihood_underflows():
    """Counts that never fade (decay 1): thousands of judged tokens make every grid point's
    likelihood underflow in double precision; the estimate is still the posterior mean, at the
    grid point next to the request's own acceptance (0.75 or 0.85 for 0.8), never a fallback to
    the prior's mean."""
    g = RequestDraftGate(prior="mixture", decay=1.0)
    for i in range(4):
        _finish(g, f"done-{i}", "greedy", 1, steps=3)
    g.set_class("long", "greedy")
    for _ in range(2000):
        g.observe("long", 8, 4)  # 4 accepted and one rejection per verification: a = 0.8
    assert g.acceptance("long") == pytest.approx(0.8, abs=0.051)
    assert g.acceptance("long") != pytest.approx(g.prior_mean("greedy"), abs=0.05)


def test_a_class_of_requests_with_few_rejected_drafts_each_reaches_a_low_prior_within_a_few_dozen():
    """Chat: each request verifies two drafts, both rejected, so each says little on its own.
    The mixture is fitted to the class's window of finished requests at once, so after 25 of
    them a new request starts near the lowest grid point, as under the pooled prior; a
    recursion that mixed in one request's posterior at a time was still near 0.17 there."""
    mix, pooled = RequestDraftGate(prior="mixture"), RequestDraftGate()
    for i in range(25):
        for gate in (mix, pooled):
            _finish(gate, f"chat-{i}", "sampled", 0, steps=2)
    assert mix.prior_mean("sampled") < 0.08
    assert pooled.prior_mean("sampled") < 0.08


def test_a_request_that_accepts_leaves_a_class_of_rejecting_requests_within_two_verifications():
    """A window of requests that all reject puts nearly all the class's mass on the lowest
    grid point; the share of the starting shape kept in every fit lets a request whose drafts
    are accepted whole leave it after two verifications."""
    g = RequestDraftGate(prior="mixture")
    for i in range(40):
        _finish(g, f"code-{i}", "greedy", 0, steps=10)
    g.set_class("quote", "greedy")
    assert g.acceptance("quote") < 0.1
    g.observe("quote", 4, 4)
    g.observe("quote", 4, 4)
    assert g.acceptance("quote") > 0.6


def test_the_mixture_is_fitted_to_the_last_mixture_requests_finished_requests_only():
    g = RequestDraftGate(prior="mixture", mixture_requests=8)
    for i in range(8):
        _finish(g, f"docs-{i}", "greedy", 4, steps=20, k=5)  # 0.8 per token
    assert g.prior_mean("greedy") > 0.6
    for i in range(8):
        _finish(g, f"code-{i}", "greedy", 0, steps=10)
    assert g.prior_mean("greedy") < 0.1  # the quoting requests have left the window


@pytest.mark.parametrize("prior", ["mixture", "pooled"])
def test_a_batch_of_estimates_at_once_equals_them_one_at_a_time(prior, monkeypatch):
    """``acceptance_many`` / ``batch_terms`` (pricing a batch) give each request the estimate
    ``acceptance`` and the draft rate ``draft_rate`` give it: requests of two fitted classes, of a class not fitted yet, with no verified
    drafts, with cached estimates; under the mixture those due are computed as one array,
    and their cache then holds what one at a time would have computed (also where the
    likelihoods of long runs underflow)."""
    import engine_host.request_gate as rg

    monkeypatch.setattr(rg, "MIXTURE_ARRAY_FROM", 1)  # every batch through the array path
    g, one = RequestDraftGate(prior=prior, decay=1.0), RequestDraftGate(prior=prior, decay=1.0)
    for gate in (g, one):
        for i in range(rg.MIXTURE_REFIT_EVERY):
            _finish(gate, f"s{i}", "sampled", 0, steps=3)
            _finish(gate, f"q{i}", "greedy", 3, steps=4)
        for i, (cls, acc, steps) in enumerate(
            [("greedy", 4, 3), ("greedy", 0, 2), ("sampled", 1, 5), ("rare", 2, 3), ("greedy", 3, 1500)]
        ):
            gate.set_class(f"r{i}", cls)
            for _ in range(steps):
                gate.observe(f"r{i}", 4, acc)
        gate.set_class("new", "greedy")  # no verified drafts yet
        for found in (False, False, True):  # offers: r1 had a draft in one of three, r2 in all
            gate.observe_offer("r1", found)
            gate.observe_offer("r2", True)
    ids = ["r0", "r1", "new", "r2", "r3", "r4", "unknown"]
    rates = g.batch_terms(ids)[1]  # and each request's draft rate with its estimate
    assert rates == [one.draft_rate(rid) for rid in ids] and rates[1] < rates[0] == 1.0 and rates[3] > rates[1]
    expected = [one.acceptance(rid) for rid in ids]
    assert g.acceptance_many(ids) == pytest.approx(expected, rel=1e-12)
    assert g.acceptance_many([]) == []
    g.observe("r0", 4, 0)  # moves: due again; the rest are cached
    one.observe("r0", 4, 0)
    assert g.acceptance_many(ids) == pytest.approx([one.acceptance(rid) for rid in ids], rel=1e-12)
    assert [g.acceptance(rid) for rid in ids] == pytest.approx([one.acceptance(rid) for rid in ids], rel=1e-12)
    if prior == "mixture":
        assert 0.7 < g.acceptance_many(["r4"])[0] < 0.8  # 3 of 4 accepted for 1500 steps: underflow handled


def test_the_share_of_a_classs_finished_requests_whose_drafts_would_pay():
    """``paying_share``: the mass of a class's distribution of per-request acceptance (the
    mixture prior) where a k-token draft pays by the batch rule: near 0 for sampled chat whose
    drafts were all rejected, about the quoting share of a greedy class where one request in
    five quotes; 1.0 before the class has a distribution and under the pooled prior; 0.0 at
    K = 0 and where a step at K > 0 costs more than any draft can return."""
    g = RequestDraftGate(prior="mixture")
    assert g.paying_share("sampled", 4, 0.01, 0.25) == 1.0  # no finished request of the class yet
    for i in range(20):
        _finish(g, f"chat-{i}", "sampled", 0, steps=3)
        _finish(g, f"code-{i}", "greedy", 4 if i % 5 == 0 else 0, steps=6)  # one in five quotes
    chat = g.paying_share("sampled", 4, 0.01, 0.25)
    code = g.paying_share("greedy", 4, 0.01, 0.25)
    assert chat < 0.1 < 0.15 < code < 0.35
    assert g.paying_share("greedy", 0, 0.01, 0.25) == 0.0
    assert g.paying_share("greedy", 4, 0.01, 5.0) == 0.0  # a step that costs five plain ones
    assert RequestDraftGate().paying_share("sampled", 4, 0.01, 0.25) == 1.0  # the pooled prior


def test_a_new_request_restarts_the_async_probes_wait_only_where_its_class_may_pay():
    """Under async scheduling a request that joins restarts the probes' wait at probe_every
    when at least ``PROBE_NEW_SHARE`` of its class's finished requests had drafts that pay: a
    new sampled chat request after chat whose drafts were all rejected waits out the backed-off
    wait, a greedy request of a class where one request in six quotes is probed after
    probe_every steps. Under the pooled prior (or with ``SPECPILOT_PROBE_PRIOR=0``) every new
    request restarts it, as before. A lone request counts its wait from its own first step."""
    for by_prior in (True, False):
        h = _hook(_step_time(idle_step_cost=True), 8, 4, ["chat-1"], gate_drafts=False)
        h._probe_by_prior = by_prior
        g = h._gate
        g.prior = "mixture"
        for i in range(24):
            _finish(g, f"chat-{i}", "sampled", 0, steps=3)
            _finish(g, f"code-{i}", "greedy", 4 if i % 6 == 0 else 0, steps=6)  # one in six quotes
        g.set_class("chat-1", "sampled")
        _feed(g, "chat-1", 0.0, k=8)
        ks = [h._decide_k(1) for _ in range(66)]
        assert [i for i, k in enumerate(ks) if k] == [3, 11, 27, 43, 59]  # backed off to 16
        h.running = [_req("chat-2")]
        g.set_class("chat-2", "sampled")
        ks = [h._decide_k(1) for _ in range(20)]
        # by its class: the wait stays backed off and counts from the new request's first step; before,
        # it restarted at 4 with chat-1's last 6 steps counted, so chat-2 was drafted at once
        assert [i for i, k in enumerate(ks) if k] == ([15] if by_prior else [0, 8])
        if by_prior:  # what the state publishes (per_request.new_request_paying_share)
            assert h._new_request_share is not None and h._new_request_share[0] == "sampled"
            assert h._new_request_share[1] < h.PROBE_NEW_SHARE
        h.running = [_req("code-new")]
        g.set_class("code-new", "greedy")
        assert not g.batch_pays(["code-new"], 8, *h._gate_costs(1, 8))  # its prior alone does not draft
        ks = [h._decide_k(1) for _ in range(8)]
        assert [i for i, k in enumerate(ks) if k][0] < 4  # probed within probe_every steps


def _bursty_class(gate: RequestDraftGate, requests: int, pattern: tuple[int, ...], k: int = 8, cls: str = "greedy"):
    """Requests of class ``cls`` whose drafts of ``k`` tokens are accepted by ``pattern``, one
    verification each, every draft priced first as the scheduler hook prices it (its estimate
    read, then the verification folded in): copied text, accepted a long way or not at all."""
    for i in range(requests):
        rid = f"{cls}-{i}"
        gate.set_class(rid, cls)
        for accepted in pattern:
            gate.acceptance(rid)
            gate.observe(rid, k, accepted)
        gate.forget(req_id=rid)


def test_the_calibrated_gain_reads_what_drafts_at_a_like_estimate_yielded():
    """Drafts of copied text are accepted to their end or not at all: here each request's
    first draft is rejected at its first token (priced at the prior's 0.5) and its second one
    is accepted whole (priced at 0.33 after that rejection). The geometric law reads 0.33 as
    0.5 tokens from a draft of 8; the calibrated gain reads what drafts at that estimate
    yielded, nearly 8, and at 0.5, where they yielded nothing, keeps the geometric law."""
    geo = RequestDraftGate(pool_decay=0.0)
    cal = RequestDraftGate(pool_decay=0.0, gain="calibrated")
    for g in (geo, cal):
        _bursty_class(g, 40, (0, 8))
        g.set_class("new", "greedy")
        g.observe("new", 8, 0)
    a = cal.acceptance("new")
    assert a == pytest.approx(1 / 3) and geo.acceptance("new") == pytest.approx(a)
    assert geo.gain("greedy", a, 8) == pytest.approx(RequestDraftGate.expected_gain(a, 8))
    assert RequestDraftGate.expected_gain(a, 8) < 0.6
    assert cal.gain("greedy", a, 8) > 5.0  # ten times that: what the class's drafts at 0.2..0.4 yielded
    # at 0.5 those drafts were rejected: the geometric law stands (never lowered, or the bin would not
    # be drafted again to learn otherwise)
    assert cal.gain("greedy", 0.5, 8) == pytest.approx(RequestDraftGate.expected_gain(0.5, 8))
    assert cal.gain("other", a, 8) == pytest.approx(RequestDraftGate.expected_gain(a, 8))  # a class not seen
    curve = [cal.gain("greedy", a, j) for j in range(9)]
    assert curve[0] == 0.0 and all(x1 >= x0 for x0, x1 in zip(curve, curve[1:]))
    # at 0.1 of a plain step per verified draft token a draft of 8 costs 0.8 tokens' time
    assert geo.pays("new", 8, 0.1) is False and cal.pays("new", 8, 0.1) is True
    assert geo.depth("new", 0.1, 8) == 2 and cal.depth("new", 0.1, 8) == 8  # (1/3)^3 < 0.1
    gains, rate = cal.batch_gains(["new"], 8)
    assert rate == pytest.approx(1.0) and sum(gains) == pytest.approx(cal.gain("greedy", a, 8))
    gains, _ = geo.batch_gains(["new"], 8)
    assert sum(gains) == pytest.approx(RequestDraftGate.expected_gain(a, 8))


def test_the_calibrated_gain_counts_short_drafts_only_as_far_as_they_reach():
    """A draft of 3 tokens accepted whole says nothing about a 4th position: past what the
    class's drafts reached, each position is accepted half the time after the one before, not
    every time."""
    cal = RequestDraftGate(pool_decay=0.0, gain="calibrated")
    _bursty_class(cal, 60, (0, 3), k=3)
    x = [cal.gain("greedy", 1 / 3, j) for j in range(9)]
    assert x[3] > 2.0
    assert x[8] - x[3] < 1.0  # positions 4..8 at 0.5 each after the one before: under 1 token together
    with pytest.raises(ValueError):
        RequestDraftGate(gain="measured")


def test_drafts_rejected_at_every_estimate_keep_the_calibrated_gain_low():
    """Sampled chat: drafts rejected whatever the estimate; the calibrated gain stays the
    geometric one, and such a request's drafts do not pay."""
    cal = RequestDraftGate(pool_decay=0.0, gain="calibrated")
    _bursty_class(cal, 40, (0, 0, 0, 0), cls="sampled")
    cal.set_class("chat", "sampled")
    cal.observe("chat", 8, 0)
    a = cal.acceptance("chat")
    assert cal.gain("sampled", a, 8) == pytest.approx(RequestDraftGate.expected_gain(a, 8))
    assert cal.pays("chat", 8, 0.1) is False


def test_at_batch_1_the_calibrated_gain_drafts_a_request_whose_drafts_pay_after_rejections():
    """The scheduler hook at one request: after four rejected drafts a request of a class
    whose drafts at that estimate were then copied whole is drafted at K = 8 under the
    calibrated gain, and planned out at K = 0 under the geometric one; the config's
    ``speculation.adaptive.gain`` picks the gate's."""
    ks = {}
    for gain in ("geometric", "calibrated"):
        hook = _hook(_step_time(), 8, 16, ["r"])
        hook._gate.gain_model = gain
        _bursty_class(hook._gate, 30, (0, 0, 0, 0, 8))
        hook._gate.set_class("r", "greedy")
        for _ in range(4):
            hook._gate.observe("r", 8, 0)
        ks[gain] = [hook._decide_k(1) for _ in range(3)]
    assert ks == {"geometric": [0, 0, 0], "calibrated": [8, 8, 8]}
    assert LiveConfig().speculation.adaptive.gain == "calibrated"


def _probe_steps(gate: RequestDraftGate, rid: str, steps: int, found: bool = True, accepted: int = 0) -> list[int]:
    """Run ``steps`` synchronous steps of one request whose drafts do not pay: the plan, and
    after a planned probe the next step's offer, the gate's verify-or-drop and the
    verification (4 drafted, ``accepted`` accepted; no draft at all unless ``found``).
    Returns the steps (0-based) at which a probe was planned."""
    probes = []
    for i in range(steps):
        if gate.plan(rid, 4, COST, 0.1):
            probes.append(i)
            gate.observe_offer(rid, found)
            if found and gate.allows(rid, 4, COST):
                gate.observe(rid, 4, accepted)
    return probes


def test_a_requests_probes_back_off_while_they_find_nothing_and_come_back_when_it_accepts():
    """``probe_backoff``: each probe whose draft is rejected, or that finds no draft, doubles
    the request's wait before the next one, up to probe_backoff x probe_every steps; a
    verification that accepts half its draft or more brings the wait back to probe_every.
    At probe_backoff 1 every request is probed every probe_every steps, as before."""
    g = RequestDraftGate(probe_every=4, probe_backoff=4, pool_decay=0.0)
    _feed(g, "chat", 0.0)
    assert _probe_steps(g, "chat", 60) == [3, 11, 27, 43, 59]  # waits of 4, 8, 16, 16, 16 steps
    _feed(g, "empty", 0.0)
    assert _probe_steps(g, "empty", 60, found=False) == [3, 11, 27, 43, 59]  # a probe that finds nothing too
    assert _probe_steps(g, "chat", 16, accepted=3) == [15]  # its next probe accepts 3 of 4
    assert _probe_steps(g, "chat", 12) == [3, 11]  # probed at probe_every again, then backing off
    flat = RequestDraftGate(probe_every=4, pool_decay=0.0)
    _feed(flat, "chat", 0.0)
    assert _probe_steps(flat, "chat", 20) == [3, 7, 11, 15, 19]
    with pytest.raises(ValueError, match="probe_backoff"):
        RequestDraftGate(probe_backoff=0)


def test_a_new_request_of_a_class_whose_drafts_seldom_pay_starts_at_the_longest_wait():
    """Under the mixture prior a sampled chat request, whose class's finished requests' drafts
    were all rejected, is first probed after probe_backoff x probe_every steps; a greedy request
    of a class where one request in five quotes is probed after probe_every."""
    g = RequestDraftGate(prior="mixture", probe_every=4, probe_backoff=4)
    for i in range(20):
        _finish(g, f"chat-{i}", "sampled", 0, steps=3)
        _finish(g, f"code-{i}", "greedy", 4 if i % 5 == 0 else 0, steps=6)
    g.set_class("chat-new", "sampled")
    g.set_class("code-new", "greedy")
    assert not g.plan("code-new", 4, COST, 0.1)  # neither is drafted on its class's prior
    assert not g.plan("chat-new", 4, COST, 0.1)
    assert _probe_steps(g, "chat-new", 20) == [14]  # 16 steps in all
    assert _probe_steps(g, "code-new", 3) == [2]  # 4 steps in all


def test_the_probes_of_a_batch_share_their_steps_at_k_above_0():
    """``plan_batch``: when only probes want drafts, every request at least half way through
    its wait is probed at the same step, so four requests that started at different steps and
    whose drafts never pay run far fewer steps at K > 0 than when each is probed on its own."""

    def steps_at_k(backoff: int) -> int:
        g = RequestDraftGate(probe_every=8, probe_backoff=backoff, pool_decay=0.0)
        at_k, ids = 0, []
        for i in range(200):
            if i < 4 * 3:  # a request joins every third step
                if i % 3 == 0:
                    ids.append(f"r{i}")
                    _feed(g, f"r{i}", 0.0)
            if g.plan_batch(ids, 4, COST, 0.1):
                at_k += 1
                for rid in ids:
                    g.observe_offer(rid, True)
                    if g.allows(rid, 4, COST):
                        g.observe(rid, 4, 0)
        return at_k

    alone, shared = steps_at_k(1), steps_at_k(4)
    assert alone >= 80  # four requests, each probed every 8 steps at its own step
    assert shared <= alone // 4
    g = RequestDraftGate(probe_every=8, probe_backoff=4, pool_decay=0.0)
    _feed(g, "a", 0.0)
    _feed(g, "b", 0.0)
    _feed(g, "copy", 0.9)
    for _ in range(3):
        g.plan_batch(["b"], 4, COST, 0.1)
    assert g.plan_batch(["a", "b", "copy"], 4, COST, 0.1)  # the copying request's drafts pay
    assert not g._reqs["a"].probe_pending and not g._reqs["b"].probe_pending  # no probe taken along
