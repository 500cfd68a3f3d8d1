"""The vLLM patches (engine_host/vllm_patches.py): version guard, behaviour, and on the
real engine that the n-gram proposer does no work at K = 0."""

from __future__ import annotations

import importlib
import json
import time

import numpy as np
import pytest

from engine_host import vllm_patches


def _proposer_class():
    # Importing the module here is fine: this test process starts no CPU worker.
    return importlib.import_module(vllm_patches.NGRAM_MODULE).NgramProposer


def test_installed_vllm_has_the_shape_the_ngram_patch_was_written_for():
    """Fails when vLLM changes NgramProposer.propose / batch_propose: recheck the patch."""
    vllm_patches.check_shape(_proposer_class())


def test_shape_check_refuses_another_signature():
    class Other:
        def propose(self, sampled_token_ids, k):  # pragma: no cover - never called
            return []

        def batch_propose(self):  # pragma: no cover
            return []

    with pytest.raises(vllm_patches.VllmShapeError, match="num_speculative_tokens"):
        vllm_patches.check_shape(Other)
    assert vllm_patches.patch_ngram_proposer(Other) is False


def test_patched_proposer_skips_numba_at_k0_and_drafts_at_k2():
    real = _proposer_class()

    class Counting(real):  # a subclass, so vLLM's own class is left alone in this process
        def __init__(self):  # no vLLM config needed: set what propose/batch_propose use
            self.min_n, self.max_n, self.k, self.max_model_len = 2, 4, 4, 64
            self.valid_ngram_draft = np.zeros((4, 4), dtype=np.int32)
            self.valid_ngram_num_drafts = np.zeros(4, dtype=np.int32)
            self.num_tokens_threshold = 8192
            self.num_numba_thread_available = 1
            self.batch_calls = 0

        def batch_propose(self, *args, **kwargs):
            self.batch_calls += 1
            return super().batch_propose(*args, **kwargs)

    assert vllm_patches.patch_ngram_proposer(Counting)
    p = Counting()
    tokens = np.zeros((2, 64), dtype=np.int32)
    tokens[0, :8] = [5, 6, 7, 8, 5, 6, 7, 8]
    n = np.array([8, 3], dtype=np.int32)
    assert p.propose(0, [[8], [1]], n, tokens) == [[], []]
    assert p.batch_calls == 0
    drafts = p.propose(2, [[8], [1]], n, tokens)
    assert p.batch_calls == 1
    assert drafts[0] == [7, 8] or drafts[0] == [5, 6]  # a real n-gram draft from the copy
    assert vllm_patches.patch_ngram_proposer(Counting)  # idempotent


@pytest.mark.engine
def test_ngram_proposer_does_no_work_at_k0_on_the_real_engine(engine_host, control, restore_config):
    """The session engine host runs fixed K = 0 with an n-gram config: its worker writes
    the proposer's counters (SPECPILOT_NGRAM_TRACE). Calls at K = 0 happen; numba runs at
    K = 0 must not."""
    import openai

    r = control.put("/control/config", json={"speculation": {"mode": "fixed", "k": 0}})
    assert r.status_code == 200, r.text
    c = openai.OpenAI(base_url=engine_host.url + "/v1", api_key="unused", timeout=120)
    for _ in range(2):
        c.completions.create(
            model=control.get("/v1/models").json()["data"][0]["id"],
            prompt="1, 2, 3, 4, 5, 6, 7, 8, 1, 2, 3, 4,",
            max_tokens=24,
            temperature=0,
        )
        time.sleep(1.1)  # the trace is written at most once a second
    c.completions.create(
        model=control.get("/v1/models").json()["data"][0]["id"], prompt="a b a b a b", max_tokens=8, temperature=0
    )
    trace_path = engine_host.ngram_trace
    assert trace_path.exists(), "the worker wrote no n-gram trace: patch not installed"
    trace = json.loads(trace_path.read_text())
    assert trace["calls_k0"] > 0, trace
    assert trace["batch_propose_k0"] == 0, trace
