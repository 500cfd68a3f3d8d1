"""The vLLM patches (engine_host/vllm_patches.py): version guard, behaviour, and on the
real engine that the n-gram proposer does no work at K = 0."""

from __future__ import annotations

import importlib
import inspect
import json
import time
import types

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


def test_installed_vllm_has_the_engine_core_and_runner_shapes_the_k0_patches_were_written_for():
    """Fails when vLLM changes EngineCore.post_step or GPUModelRunner._prepare_inputs, or
    fixes upstream what the runner patch works around: recheck (or remove) the patches."""
    core = importlib.import_module(vllm_patches.ENGINE_CORE_MODULE).EngineCore
    runner = importlib.import_module(vllm_patches.RUNNER_MODULE).GPUModelRunner
    vllm_patches.check_engine_core_shape(core)
    vllm_patches.check_runner_shape(runner)


def test_k0_shape_checks_refuse_other_shapes():
    class Core:
        def post_step(self, model_executed, extra):  # pragma: no cover - never called
            return None

    class Runner:
        def _prepare_inputs(self, scheduler_output, num_scheduled_tokens):  # pragma: no cover
            use_spec_decode = bool(scheduler_output.scheduled_spec_decode_tokens)  # the upstream fix
            return use_spec_decode

    with pytest.raises(vllm_patches.VllmShapeError, match="model_executed"):
        vllm_patches.check_engine_core_shape(Core)
    with pytest.raises(vllm_patches.VllmShapeError, match="config alone"):
        vllm_patches.check_runner_shape(Runner)
    assert vllm_patches.patch_engine_core(Core) is False
    assert vllm_patches.patch_model_runner(Runner) is False
    assert "post_step" in Core.__dict__ and Core.post_step.__name__ == "post_step"  # left alone


def test_engine_core_skips_the_draft_fetch_after_a_k0_step_only():
    from types import SimpleNamespace

    fetched = []

    def original(self, model_executed):
        fetched.append(self.scheduler.specpilot_last_scheduled_k)

    post_step = vllm_patches.skip_draft_fetch_at_k0(original)
    sched = SimpleNamespace(specpilot_last_scheduled_k=0)
    core = SimpleNamespace(check_for_draft_tokens=True, async_scheduling=False, scheduler=sched)
    post_step(core, True)
    assert fetched == []  # K = 0: every draft is empty, nothing to fetch
    sched.specpilot_last_scheduled_k = 3
    post_step(core, True)
    assert fetched == [3]
    sched.specpilot_last_scheduled_k = None  # a scheduler without the hook: vLLM's behaviour
    post_step(core, True)
    assert fetched == [3, None]
    sched.specpilot_last_scheduled_k = 0
    post_step(SimpleNamespace(check_for_draft_tokens=True, async_scheduling=True, scheduler=sched), True)
    assert fetched == [3, None, 0]  # async scheduling: left to vLLM
    post_step(core, False)
    assert len(fetched) == 4  # no model step: left to vLLM


def test_runner_takes_the_plain_sampler_path_when_no_draft_is_scheduled():
    from types import SimpleNamespace

    meta = object()

    def original(self, scheduler_output, num_scheduled_tokens):
        return "logits-indices", meta, 5

    prep = vllm_patches.plain_sampler_without_drafts(original)
    ngram = SimpleNamespace(speculative_config=SimpleNamespace(method="ngram"))
    none_scheduled = SimpleNamespace(scheduled_spec_decode_tokens={})
    some_scheduled = SimpleNamespace(scheduled_spec_decode_tokens={"r1": [4, 5]})
    assert prep(ngram, none_scheduled, None) == ("logits-indices", None, 5)
    assert prep(ngram, some_scheduled, None) == ("logits-indices", meta, 5)
    draft = SimpleNamespace(speculative_config=SimpleNamespace(method="draft_model"))
    assert prep(draft, none_scheduled, None) == ("logits-indices", meta, 5)  # its proposer reads it


def test_scheduler_hook_names_the_attribute_the_engine_core_patch_reads():
    import inspect

    from engine_host import scheduler

    assert f"self.{vllm_patches.LAST_K_ATTR} =" in inspect.getsource(scheduler)


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
    # the runner sampled the steps without drafts with the plain sampler
    assert trace.get("plain_sampler_steps", 0) > 0, trace
    # and the engine core did not ask the worker for the (empty) drafts of the K = 0 steps
    core_path = trace_path.with_name(trace_path.name + ".core")
    assert core_path.exists(), "the engine core wrote no trace: its patch is not installed"
    core = json.loads(core_path.read_text())
    assert core.get("draft_fetch_skipped", 0) > 0, core


def test_patches_off_leave_vllm_alone(monkeypatch):
    """SPECPILOT_VLLM_PATCHES=0 (side-by-side benchmarks): install() adds no import hook and
    patches nothing; by default it adds the hook."""
    import sys

    finders = [f for f in sys.meta_path if not isinstance(f, vllm_patches._PatchOnImport)]
    monkeypatch.setattr(sys, "meta_path", list(finders))
    monkeypatch.setitem(sys.modules, vllm_patches.ENGINE_CORE_MODULE, None)  # nothing loaded to patch at once
    monkeypatch.setitem(sys.modules, vllm_patches.RUNNER_MODULE, None)
    monkeypatch.setitem(sys.modules, vllm_patches.NGRAM_MODULE, None)
    monkeypatch.setitem(sys.modules, vllm_patches.NGRAM_GPU_MODULE, None)
    monkeypatch.setitem(sys.modules, vllm_patches.CUDAGRAPH_MODULE, None)
    monkeypatch.setenv("SPECPILOT_VLLM_PATCHES", "0")
    vllm_patches.install()
    assert not any(isinstance(f, vllm_patches._PatchOnImport) for f in sys.meta_path)
    monkeypatch.delenv("SPECPILOT_VLLM_PATCHES")
    vllm_patches.install()
    assert any(isinstance(f, vllm_patches._PatchOnImport) for f in sys.meta_path)


def _ngram_gpu_class():
    return importlib.import_module(vllm_patches.NGRAM_GPU_MODULE).NgramGPUSpeculator


def test_installed_vllm_has_the_model_runner_v2_ngram_shape_the_patch_was_written_for():
    """Fails when vLLM changes NgramGPUSpeculator.propose, or when the V2 runner no longer
    overwrites the drafts beyond the step's K with -1 (what makes skipping the kernels at
    K = 0 safe): recheck the patch."""
    vllm_patches.check_ngram_gpu_shape(_ngram_gpu_class())
    import importlib.util
    from pathlib import Path

    runner_src = Path(importlib.util.find_spec("vllm.v1.worker.gpu.model_runner").origin).read_text()
    call = runner_src.index("draft_tokens = self.speculator.propose(")
    after = runner_src[call : call + 1500]
    assert "num_speculative_tokens=num_spec_tokens" in after
    assert "draft_tokens[:, num_spec_tokens:] = -1" in after


def test_gpu_ngram_speculator_launches_nothing_at_k0_and_runs_at_k2():
    import torch

    calls = []

    class Spec:  # the shape of NgramGPUSpeculator.propose, with a counting body
        def __init__(self):
            self.drafts = torch.full((8, 4), 7, dtype=torch.int64)

        def propose(
            self,
            input_batch,
            attn_metadata=None,
            dummy_run=False,
            num_speculative_tokens=None,
        ):
            calls.append(num_speculative_tokens)
            num_reqs = input_batch.num_reqs
            _ngram_finalize_kernel = None  # noqa: F841  the source's marker
            return self.drafts[:num_reqs]

    class Batch:
        num_reqs = 3

    assert vllm_patches.patch_ngram_gpu_speculator(Spec)
    assert vllm_patches.patch_ngram_gpu_speculator(Spec)  # idempotent
    s = Spec()
    out = s.propose(Batch(), None, num_speculative_tokens=0)
    assert calls == [] and tuple(out.shape) == (3, 4)  # the buffer the runner then fills with -1
    s.propose(Batch(), None, num_speculative_tokens=2)
    s.propose(Batch(), None, dummy_run=True, num_speculative_tokens=0)  # capture runs stay real
    s.propose(Batch(), None)  # K not given: unchanged behaviour
    assert calls == [2, 0, None]

    class Other:
        def propose(self, batch, k):  # pragma: no cover - never called
            return batch

    with pytest.raises(vllm_patches.VllmShapeError, match="input_batch|dummy_run|num_speculative_tokens"):
        vllm_patches.check_ngram_gpu_shape(Other)
    assert vllm_patches.patch_ngram_gpu_speculator(Other) is False


def _draft_model_class():
    return importlib.import_module(vllm_patches.DRAFT_MODEL_GPU_MODULE).StandaloneARSpeculator


def test_installed_vllm_and_vllm_033_have_the_draft_model_shape_the_patch_was_written_for():
    """Fails when vLLM changes StandaloneARSpeculator (installed 0.32 source, and the 0.33
    GPU wheel's file kept under tests/data) or when it starts honouring K itself: recheck."""
    import gzip
    from pathlib import Path

    vllm_patches.check_draft_model_shape(_draft_model_class())
    src_033 = gzip.open(
        Path(__file__).parent / "data/vllm-0.33.0/v1/worker/gpu/spec_decode/standalone_ar/speculator.py.gz", "rt"
    ).read()
    for line in (*vllm_patches.DRAFT_MODEL_PROPOSE_LINES, vllm_patches.DRAFT_MODEL_DECODE_LINE):
        assert line in src_033
    for src in (inspect.getsource(importlib.import_module(vllm_patches.DRAFT_MODEL_GPU_MODULE)), src_033):
        body = src[src.index("    def propose(") :]
        body = body[: body.index("\n@triton.jit")]
        assert "num_speculative_tokens" not in body.split(") -> torch.Tensor:", 1)[1]  # still ignores K


def test_gpu_draft_model_speculator_runs_decode_passes_up_to_the_step_k():
    import torch

    passes = []

    class Spec:  # the shape of StandaloneARSpeculator.propose, counting its decode passes
        def __init__(self):
            self.num_speculative_steps = 4
            self.draft_tokens = torch.zeros((8, 4), dtype=torch.int64)

        def propose(self, input_batch, attn_metadata=None, dummy_run=False, num_speculative_tokens=None):
            num_reqs = input_batch.num_reqs
            self.draft_tokens[:num_reqs, 0] = 100  # the prefill pass
            if self.num_speculative_steps == 1:
                passes.append(0)
                return self.draft_tokens[:num_reqs, :1]
            self._multi_step_decode(num_reqs)
            return self.draft_tokens[:num_reqs]

        def _multi_step_decode(self, num_reqs):
            n = 0
            for step in range(1, self.num_speculative_steps):
                self.draft_tokens[:num_reqs, step] = 100 + step
                n += 1
            passes.append(n)

    class Batch:
        num_reqs = 3

    assert vllm_patches.patch_draft_model_speculator(Spec)
    assert vllm_patches.patch_draft_model_speculator(Spec)  # idempotent
    s = Spec()
    for k in (0, 1, 2, 4, 6):
        out = s.propose(Batch(), None, num_speculative_tokens=k)
        assert tuple(out.shape) == (3, 4)  # always K_max wide: the runner fills from K on with -1
        assert s.num_speculative_steps == 4  # restored
    s.propose(Batch(), None, dummy_run=True, num_speculative_tokens=1)  # capture/profile runs stay whole
    s.propose(Batch(), None)  # K not given: unchanged
    assert passes == [0, 0, 1, 3, 3, 3, 3]
    assert out[:, :3].tolist() == [[100, 101, 102]] * 3

    class Broken(Spec):  # inherits the patched propose
        def _multi_step_decode(self, num_reqs):
            raise RuntimeError("draft model failed")

    b = Broken()
    with pytest.raises(RuntimeError, match="draft model failed"):
        b.propose(Batch(), None, num_speculative_tokens=2)
    assert b.num_speculative_steps == 4  # restored after an error too

    class Other:  # propose as vLLM's, but no _multi_step_decode to limit
        def propose(self, input_batch, dummy_run=False, num_speculative_tokens=None):  # pragma: no cover
            num_reqs = input_batch.num_reqs
            if self.num_speculative_steps == 1:
                return self.draft_tokens[:num_reqs, :1]
            return self.draft_tokens[:num_reqs]

    with pytest.raises(vllm_patches.VllmShapeError, match="_multi_step_decode is missing"):
        vllm_patches.check_draft_model_shape(Other)
    assert vllm_patches.patch_draft_model_speculator(Other) is False


def test_installed_vllm_has_the_seeded_partial_prefill_shape_the_patch_was_written_for():
    """Fails when vLLM's V1 runner no longer rewinds a discarded row's generator by offset
    (an upstream fix): recheck, and remove the patch."""
    cls = importlib.import_module(vllm_patches.RUNNER_MODULE).GPUModelRunner
    vllm_patches.check_seeded_discard_shape(cls)


def test_discarded_rows_keep_their_cpu_generator_untouched():
    import torch

    cpu_gen = torch.Generator(device="cpu").manual_seed(7)
    with pytest.raises(RuntimeError, match="offset"):  # what vLLM's rewind hits on the CPU
        cpu_gen.set_offset(cpu_gen.get_offset() - 4)
    other = torch.Generator(device="cpu").manual_seed(8)
    state_before = cpu_gen.get_state().clone()

    class Mask:
        np = np.array([1, 0, 0], dtype=bool)

    class Batch:
        num_reqs = 2
        generators = {0: cpu_gen, 1: other}

    class Runner:
        input_batch = Batch()
        discard_request_mask = Mask()

    seen = {}

    def original(self, grammar_output):  # vLLM's sample + bookkeeping, reduced
        seen.update(self.input_batch.generators)
        for i in np.nonzero(self.discard_request_mask.np[: self.input_batch.num_reqs])[0]:
            gen = self.input_batch.generators.get(int(i))
            if gen is not None:
                gen.set_offset(gen.get_offset() - 4)
        for gen in self.input_batch.generators.values():
            torch.rand(2, generator=gen)  # the rows that are sampled draw from their stream
        return "output"

    wrapped = vllm_patches.keep_cpu_generators_of_discarded_rows(original)
    runner = Runner()
    assert wrapped(runner, None) == "output"
    assert seen == {1: other}  # the discarded row's generator was out of the batch
    assert runner.input_batch.generators == {0: cpu_gen, 1: other}  # and is back
    assert torch.equal(cpu_gen.get_state(), state_before)  # untouched: no draw left a trace


def test_seeded_request_in_a_chunked_prefill_does_not_kill_the_engine(engine_host, control, restore_config):
    """A seeded request whose long prompt is prefilled in several chunks (live token cap at
    its floor) is served, and the engine keeps serving; the worker counts the protected rows."""
    import openai

    from engine_host.config import MIN_BATCHED_TOKENS

    r = control.put(
        "/control/config",
        json={
            "speculation": {"mode": "fixed", "k": 0},
            "batch": {"max_num_seqs": 1, "max_num_batched_tokens": MIN_BATCHED_TOKENS},
        },
    )
    assert r.status_code == 200, r.text
    c = openai.OpenAI(base_url=engine_host.url + "/v1", api_key="unused", timeout=180)
    model = control.get("/v1/models").json()["data"][0]["id"]
    prompt = " ".join(f"item {i} is on shelf {i % 7}." for i in range(90))  # several chunks at the cap
    outs = [
        c.completions.create(model=model, prompt=prompt, max_tokens=8, temperature=0.9, seed=11).choices[0].text
        for _ in range(2)
    ]
    assert outs[0] == outs[1]  # the seed still decides the text
    assert c.completions.create(model=model, prompt="ok", max_tokens=2, temperature=0).choices[0].text is not None
    time.sleep(1.1)  # the trace is written at most once a second
    c.completions.create(model=model, prompt="ok", max_tokens=2, temperature=0)
    trace = json.loads(engine_host.ngram_trace.read_text())
    assert trace.get("seeded_discarded_rows", 0) > 0, trace


def test_installed_vllm_and_vllm_033_have_the_draft_model_graph_shape_the_patch_was_written_for():
    """Fails when vLLM's StandaloneARSpeculator starts capturing CUDA graphs itself or changes
    ``_run_model`` (installed 0.32 source and the 0.33 GPU wheel's file): recheck the patch."""
    import gzip
    from pathlib import Path

    vllm_patches.check_draft_model_graphs_shape(_draft_model_class())
    src_033 = gzip.open(
        Path(__file__).parent / "data/vllm-0.33.0/v1/worker/gpu/spec_decode/standalone_ar/speculator.py.gz", "rt"
    ).read()
    assert vllm_patches.DRAFT_MODEL_CAPTURE_LINE in src_033
    run = src_033[src_033.index("    def _run_model(") :]
    run = run[: run.index("\n    def ", 10)]
    assert vllm_patches.DRAFT_MODEL_EAGER_LINE in run
    params = [
        ln.strip().split(":")[0].rstrip(",") for ln in run.split(") -> torch.Tensor:")[0].splitlines()[1:] if ln.strip()
    ]
    assert params == vllm_patches.DRAFT_MODEL_RUN_PARAMS


class _Entry:
    def __init__(self, graph):
        self.cudagraph = graph


class _Wrapper:  # the part of vLLM's CUDAGraphWrapper the patch reads
    def __init__(self):
        self.concrete_cudagraph_entries = {"desc-1": _Entry(object())}


def _draft_stub():
    import torch

    calls = {"original": 0, "model": []}

    class Spec:  # StandaloneARSpeculator's capture and _run_model, as vLLM 0.33 has them
        vllm_config = "config"

        def capture(self):
            pass  # CUDA graph not yet supported for standalone AR speculator.

        def _run_model(self, input_ids, positions, attn_metadata, slot_mappings, num_tokens_across_dp):
            # cudagraph_runtime_mode=CUDAGraphMode.NONE,
            calls["original"] += 1
            return torch.full((input_ids.shape[0], 2), -1.0)

        def model(self, input_ids, positions):
            calls["model"].append((input_ids.clone(), positions.clone()))
            return torch.arange(input_ids.shape[0] * 2, dtype=torch.float32).reshape(-1, 2)

    return Spec, calls


def test_draft_model_passes_replay_piecewise_graphs_padded_to_a_captured_size(monkeypatch):
    import contextlib

    import torch

    Spec, calls = _draft_stub()
    contexts = []

    @contextlib.contextmanager
    def fake_context(attn_metadata, vllm_config, **kw):
        contexts.append({"attn_metadata": attn_metadata, **kw})
        yield

    monkeypatch.setattr(
        vllm_patches, "_forward_context_api", lambda: (fake_context, lambda num_tokens: ("d", num_tokens), "PIECEWISE")
    )
    assert vllm_patches.patch_draft_model_graphs(Spec)
    assert vllm_patches.patch_draft_model_graphs(Spec)  # idempotent: _run_model wrapped once
    s = Spec()
    ids, pos = torch.tensor([7, 8, 9]), torch.tensor([10, 11, 12])
    out = s._run_model(ids, pos, {"layer": "md"}, {"layer": "slots"}, None)  # no graphs yet: eager
    assert calls["original"] == 1 and out.shape == (3, 2)

    wrapper = _Wrapper()
    s._specpilot_draft_graphs = vllm_patches.DraftGraphs(
        (8, 1, 4, 2), torch.zeros(8, dtype=torch.int64), torch.zeros(8, dtype=torch.int64), (wrapper, "desc-1")
    )
    out = s._run_model(ids, pos, {"layer": "md"}, {"layer": "slots"}, None)
    assert calls["original"] == 1  # replayed, not eager
    model_ids, model_pos = calls["model"][-1]
    assert model_ids.shape == (4,) and model_ids[:3].tolist() == [7, 8, 9]  # padded to the captured 4
    assert model_pos[:3].tolist() == [10, 11, 12]
    assert contexts[-1] == {
        "attn_metadata": {"layer": "md"},
        "num_tokens": 4,
        "cudagraph_runtime_mode": "PIECEWISE",
        "num_tokens_across_dp": None,
        "slot_mapping": {"layer": "slots"},
        "batch_descriptor": ("d", 4),
    }
    assert out.shape == (3, 2) and out[0].tolist() == [0.0, 1.0]  # the real rows only

    big = torch.arange(9)
    s._run_model(big, big, {"layer": "md"}, None, None)  # larger than every captured size
    s._run_model(ids, pos, None, None, None)  # dummy run without attention
    s._run_model(ids, pos, {"layer": "md"}, None, torch.tensor([3, 3]))  # data parallel
    assert calls["original"] == 4
    wrapper.concrete_cudagraph_entries["desc-1"].cudagraph = None  # vLLM dropped the graphs
    s._run_model(ids, pos, {"layer": "md"}, None, None)
    assert calls["original"] == 5 and len(calls["model"]) == 1


def test_draft_graph_capture_failure_leaves_the_passes_eager(monkeypatch, caplog):
    Spec, _ = _draft_stub()

    def broken(spec):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(vllm_patches, "capture_draft_graphs", broken)
    assert vllm_patches.patch_draft_model_graphs(Spec)
    s = Spec()
    s._specpilot_draft_graphs = "stale"
    with caplog.at_level("ERROR"):
        s.capture()  # does not raise
    assert s._specpilot_draft_graphs is None
    assert "passes stay eager" in caplog.text

    class Other:  # a speculator that captures graphs itself
        def capture(self):  # pragma: no cover
            self.graphs = {}

        def _run_model(
            self, input_ids, positions, attn_metadata, slot_mappings, num_tokens_across_dp
        ):  # pragma: no cover
            pass

    with pytest.raises(vllm_patches.VllmShapeError, match="captures CUDA graphs itself"):
        vllm_patches.check_draft_model_graphs_shape(Other)
    assert vllm_patches.patch_draft_model_graphs(Other) is False


def test_draft_graphs_pad_to_the_next_captured_size():
    g = vllm_patches.DraftGraphs((16, 1, 2, 4, 8), None, None, (None, None))
    assert [g.padded(n) for n in (1, 2, 3, 5, 8, 9, 16, 17)] == [1, 2, 4, 8, 8, 16, 16, None]
    with pytest.raises(ValueError):
        vllm_patches.DraftGraphs((), None, None, (None, None))


def _gz(rel: str) -> str:
    import gzip
    from pathlib import Path

    return gzip.open(Path(__file__).parent / "data/vllm-0.33.0" / rel, "rt").read()


def test_installed_vllm_and_vllm_033_have_the_draft_decode_graph_shape_the_patch_was_written_for():
    """Fails when vLLM's StandaloneARSpeculator builds a CUDA graph manager itself, changes
    its decode loop, or when the EAGLE graph manager the patch reuses moves (installed 0.32
    source and the 0.33 GPU wheel's files): recheck the patch."""
    vllm_patches.check_draft_decode_graphs_shape(_draft_model_class())
    src = _gz("v1/worker/gpu/spec_decode/standalone_ar/speculator.py.gz")
    init = src[src.index("    def init_cudagraph_manager(") :]
    assert vllm_patches.DRAFT_MODEL_INIT_CG_LINE in init[: init.index("\n    def ", 10)]
    decode = src[src.index("    def _multi_step_decode(") :]
    decode = decode[: decode.index("\n    @torch.inference_mode()")]
    for line in vllm_patches.DRAFT_MODEL_DECODE_LINES:
        assert line in decode, line
    assert "class SpeculatorCudaGraphManager(CudaGraphManager)" in _gz(
        "v1/worker/gpu/spec_decode/target_dependent_ar/cudagraph_utils.py.gz"
    )
    cg = _gz("v1/worker/gpu/cudagraph_utils.py.gz")
    dispatch = cg[cg.index("    def dispatch(") :]
    assert [p.strip().split(":")[0].rstrip(",") for p in dispatch.split(")")[0].splitlines()[1:6]] == [
        "self",
        "num_reqs",
        "num_tokens",
        "uniform_token_count",
        "num_active_loras",
    ]
    assert "    def run_fullgraph(self, desc: BatchExecutionDescriptor):" in cg


def _decode_stub(num_steps: int = 4, max_reqs: int = 8):
    """StandaloneARSpeculator's state for ``_multi_step_decode`` on CPU tensors, with a
    deterministic model (hidden row = f(token, position)) and a recording metadata builder."""
    import types

    import torch

    class Spec:
        max_model_len = 50

        def __init__(self):
            self.num_speculative_steps = num_steps
            self.input_buffers = types.SimpleNamespace(
                input_ids=torch.zeros(max_reqs, dtype=torch.int32),
                positions=torch.zeros(max_reqs, dtype=torch.int64),
                seq_lens=torch.full((max_reqs,), 9, dtype=torch.int32),
                query_start_loc=torch.full((max_reqs + 1,), 77, dtype=torch.int32),
            )
            self.expanded_positions = torch.arange(100, dtype=torch.int64) + 5
            self.last_token_indices = torch.tensor([3, 8, 13] + [0] * (max_reqs - 3), dtype=torch.int64)
            self.draft_tokens = torch.zeros((max_reqs, num_steps), dtype=torch.int64)
            self.draft_tokens[:3, 0] = torch.tensor([11, 22, 33])
            self.arange_gpu = torch.arange(max_reqs + 1, dtype=torch.int32)
            self.current_draft_step = torch.tensor(0, dtype=torch.int64)
            self.idx_mapping = torch.tensor([4, 1, 6] + [-1] * (max_reqs - 3), dtype=torch.int64)
            self.temperature = torch.zeros(max_reqs)
            self.seeds = torch.zeros(max_reqs, dtype=torch.int64)
            self.draft_logits = None
            self.kv_cache_config = {}
            self.metadata = []
            self.slot_calls = []
            self.model_inputs = []
            spec = self

            class BlockTables:
                def compute_slot_mappings(self, idx_mapping, query_start_loc, positions, num_tokens_padded, out=None):
                    spec.slot_calls.append(
                        (idx_mapping.tolist(), query_start_loc.tolist(), positions.tolist(), num_tokens_padded)
                    )
                    return torch.zeros((1, num_tokens_padded), dtype=torch.int64)

            self.block_tables = BlockTables()

        def _build_uniform_attn_metadata(self, batch_desc, num_reqs, num_query_per_req, seq_lens_cpu_upper_bound, step):
            self.metadata.append((batch_desc, num_reqs, step, self.input_buffers.seq_lens[:num_reqs].tolist()))
            return {"layer": step}

        def _run_model(self, input_ids, positions, attn_metadata, slot_mappings, num_tokens_across_dp):
            self.model_inputs.append((input_ids.tolist(), positions.tolist()))
            return torch.stack([input_ids.double() * 3 + positions, positions.double()], dim=1)

        def sample_draft(self, hidden, positions, idx_mapping, temperature, seeds, draft_step, draft_logits):
            return (hidden[:, 0].long() + 1000 * (draft_step + 1)) % 5000

    batch = types.SimpleNamespace(
        seq_lens=torch.tensor([20, 30, 40], dtype=torch.int32),
        idx_mapping=torch.tensor([4, 1, 6], dtype=torch.int64),
        seq_lens_cpu_upper_bound=torch.tensor([20, 30, 40], dtype=torch.int32),
    )
    return Spec, batch


class _Desc:
    def __init__(self, n):
        self.num_tokens = self.num_reqs = n

    def __eq__(self, other):
        return isinstance(other, _Desc) and other.num_tokens == self.num_tokens

    def __hash__(self):
        return self.num_tokens


class _FakeDecodeGraphs:
    """vLLM's SpeculatorCudaGraphManager as the patch uses it; "replay" runs the graph body."""

    def __init__(self, spec, sizes=(1, 2, 4, 8)):
        self.spec = spec
        self.graphs = {_Desc(n): object() for n in sizes}
        self.replays = []

    def dispatch(self, num_reqs, num_tokens, uniform_token_count, num_active_loras):
        assert (uniform_token_count, num_active_loras) == (1, 0)
        fits = sorted(d.num_tokens for d in self.graphs if d.num_tokens >= num_tokens)
        return _Desc(fits[0]) if fits else _Desc(-1)

    def run_fullgraph(self, desc):
        self.replays.append((desc.num_tokens, int(self.spec.current_draft_step)))
        vllm_patches.draft_decode_step(self.spec, desc.num_reqs, desc.num_tokens, {"captured": 1}, {"slots": 1}, None)


def test_draft_decode_graphs_replay_what_vllms_own_loop_computes(monkeypatch):
    """vLLM's own StandaloneARSpeculator._multi_step_decode (installed source) and the patched
    loop replaying the graph body give the same drafts, positions and sequence lengths, with
    the padded rows set as FULL graphs need them."""
    import torch

    module = importlib.import_module(vllm_patches.DRAFT_MODEL_GPU_MODULE)
    monkeypatch.setattr(module, "build_slot_mappings_by_layer", lambda slots, config: {"layer": slots})
    vllm_loop = inspect.unwrap(module.StandaloneARSpeculator._multi_step_decode)
    Spec, batch = _decode_stub()
    num_rejected = torch.tensor([0, 2, 1])

    ref = Spec()
    vllm_loop(ref, batch, num_rejected, 3, False, None)

    patched = vllm_patches.draft_decode_passes_with_graphs(vllm_loop)
    s = Spec()
    graphs = _FakeDecodeGraphs(s)
    setattr(s, vllm_patches.DRAFT_DECODE_GRAPHS_ATTR, graphs)
    patched(s, batch, num_rejected, 3, False, None)

    assert graphs.replays == [(4, 1), (4, 2), (4, 3)]  # padded to the captured 4, one per pass
    assert s.draft_tokens[:3].tolist() == ref.draft_tokens[:3].tolist()
    assert (s.draft_tokens[:3, 1:] != 0).all()
    assert s.input_buffers.positions[:3].tolist() == ref.input_buffers.positions[:3].tolist()
    assert s.input_buffers.seq_lens[:3].tolist() == ref.input_buffers.seq_lens[:3].tolist()
    assert [m[1:] for m in s.metadata] == [m[1:] for m in ref.metadata]  # same steps and seq_lens
    assert all(m[0] == _Desc(4) for m in s.metadata)  # built for the captured descriptor
    assert [ids[:3] for ids, _ in s.model_inputs] == [ids for ids, _ in ref.model_inputs]
    assert [pos[:3] for _, pos in s.model_inputs] == [pos for _, pos in ref.model_inputs]
    assert all(len(ids) == 4 for ids, _ in s.model_inputs)
    # padding: rows 3 (and the query_start_loc entries after the batch) of the captured 4
    assert s.input_buffers.seq_lens[3].item() == 0
    assert s.input_buffers.query_start_loc[:5].tolist() == [0, 1, 2, 3, 3]
    assert all(call[0] == [4, 1, 6] and call[1] == [0, 1, 2, 3] and call[3] == 4 for call in s.slot_calls)
    assert [c[2] for c in s.slot_calls] == [c[2] for c in ref.slot_calls]


def test_draft_decode_passes_run_vllms_loop_where_no_graph_fits():
    import torch

    Spec, batch = _decode_stub()
    calls = []

    def vllm_loop(self, input_batch, num_rejected, num_reqs, skip_attn, num_tokens_across_dp):
        calls.append((num_reqs, skip_attn, num_tokens_across_dp))

    patched = vllm_patches.draft_decode_passes_with_graphs(vllm_loop)
    s = Spec()
    rejected = torch.tensor([0, 0, 0])
    patched(s, batch, rejected, 3, False, None)  # no manager (off, eager mode, dropped by vLLM)
    graphs = _FakeDecodeGraphs(s, sizes=(1, 2))
    setattr(s, vllm_patches.DRAFT_DECODE_GRAPHS_ATTR, graphs)
    patched(s, batch, rejected, 3, False, None)  # larger than every captured size
    patched(s, batch, rejected, 2, True, None)  # dummy run without attention
    patched(s, batch, rejected, 2, False, torch.tensor([2, 2]))  # data parallel
    graphs.graphs.clear()  # vLLM released the graphs
    patched(s, batch, rejected, 2, False, None)
    assert len(calls) == 5 and graphs.replays == []


def test_draft_decode_graph_manager_is_built_for_full_decode_graphs_only(monkeypatch):
    import types

    from vllm.config.compilation import CUDAGraphMode

    built = []
    cg_module = importlib.import_module("vllm.v1.worker.gpu.spec_decode.target_dependent_ar.cudagraph_utils")
    monkeypatch.setattr(
        cg_module,
        "SpeculatorCudaGraphManager",
        lambda config, device, mode, decode_query_len: built.append(mode) or mode,
    )
    spec = types.SimpleNamespace(vllm_config="config", device="cuda", num_speculative_steps=4, dp_size=1)
    assert vllm_patches._decode_graph_manager(spec, CUDAGraphMode.FULL_AND_PIECEWISE) == CUDAGraphMode.FULL_DECODE_ONLY
    assert vllm_patches._decode_graph_manager(spec, CUDAGraphMode.PIECEWISE) is None
    assert vllm_patches._decode_graph_manager(spec, CUDAGraphMode.NONE) is None
    spec.num_speculative_steps = 1
    assert vllm_patches._decode_graph_manager(spec, CUDAGraphMode.FULL_AND_PIECEWISE) is None
    spec.num_speculative_steps, spec.dp_size = 4, 2
    assert vllm_patches._decode_graph_manager(spec, CUDAGraphMode.FULL_AND_PIECEWISE) is None
    assert built == [CUDAGraphMode.FULL_DECODE_ONLY]


def test_draft_decode_graphs_patch_init_capture_and_switch(monkeypatch, caplog):
    class Spec:  # StandaloneARSpeculator's no-op manager and capture, as vLLM 0.33 has them
        def init_cudagraph_manager(self, cudagraph_mode):
            pass  # CUDA graph not yet supported for standalone AR speculator.

        def capture(self):
            pass  # CUDA graph not yet supported for standalone AR speculator.

        def _multi_step_decode(self, input_batch, num_rejected, num_reqs, skip_attn, num_tokens_across_dp):
            pass  # pragma: no cover

    real_check = vllm_patches.check_draft_decode_graphs_shape
    monkeypatch.setattr(vllm_patches, "check_draft_decode_graphs_shape", lambda cls: None)
    monkeypatch.setattr(vllm_patches, "_decode_graph_manager", lambda spec, mode: f"manager:{mode}")
    captured = []
    monkeypatch.setattr(vllm_patches, "capture_draft_decode_graphs", lambda spec, manager: captured.append(manager))
    assert vllm_patches.patch_draft_model_decode_graphs(Spec)
    assert vllm_patches.patch_draft_model_decode_graphs(Spec)  # idempotent
    s = Spec()
    s.init_cudagraph_manager("FULL")
    assert getattr(s, vllm_patches.DRAFT_DECODE_GRAPHS_ATTR) == "manager:FULL"
    s.capture()
    assert captured == ["manager:FULL"]

    monkeypatch.setenv("SPECPILOT_DRAFT_DECODE_GRAPHS", "0")
    s.init_cudagraph_manager("FULL")
    assert getattr(s, vllm_patches.DRAFT_DECODE_GRAPHS_ATTR) is None
    s.capture()
    assert captured == ["manager:FULL"]  # nothing captured when switched off

    monkeypatch.delenv("SPECPILOT_DRAFT_DECODE_GRAPHS")

    def broken(spec, manager):
        raise RuntimeError("capture failed")

    monkeypatch.setattr(vllm_patches, "capture_draft_decode_graphs", broken)
    s.init_cudagraph_manager("FULL")
    with caplog.at_level("ERROR"):
        s.capture()  # does not raise
    assert getattr(s, vllm_patches.DRAFT_DECODE_GRAPHS_ATTR) is None
    assert "not captured in FULL CUDA graphs" in caplog.text

    class Other:  # a speculator that builds its own manager
        def init_cudagraph_manager(self, cudagraph_mode):  # pragma: no cover
            self.manager = cudagraph_mode

        def _multi_step_decode(
            self, input_batch, num_rejected, num_reqs, skip_attn, num_tokens_across_dp
        ):  # pragma: no cover
            pass

    with pytest.raises(vllm_patches.VllmShapeError, match="builds a CUDA graph manager itself"):
        real_check(Other)


# the engine host's batch-size table at K_max 4 and vLLM's capture sizes for it at 64
# requests (as vLLM 0.33.0 logged them on an offline GPU host)
_TABLE_K4 = [[1, 1, 4], [2, 2, 3], [3, 3, 2], [4, 4, 1], [5, 1048576, 0]]
_SIZES_K4 = [1, 2, 3, 4, 5, 6, 8, 9, *range(16, 257, 8), *range(272, 513, 16)]


def _graph_manager(patched: bool):
    """A Model Runner V2 ``CudaGraphManager`` (vLLM's class, or a patched subclass) whose
    candidates vLLM's own ``_init_candidates`` built for the engine host's table at K_max 4
    and 64 requests, every graph counted as captured (no GPU: ``__init__`` is skipped)."""
    import inspect
    from types import SimpleNamespace

    from vllm.config.compilation import CUDAGraphMode

    module = importlib.import_module(vllm_patches.CUDAGRAPH_MODULE)
    base = module.CudaGraphManager
    cls = type("Manager", (base,), {})
    if patched:
        assert vllm_patches.patch_cudagraph_dispatch(cls)
        assert vllm_patches.patch_cudagraph_dispatch(cls)  # idempotent
    else:
        cls.dispatch = inspect.unwrap(base.dispatch)  # vLLM's own, even if install() ran here
    spec = SimpleNamespace(
        uses_dynamic_speculative_decoding=lambda: True, num_speculative_tokens_per_batch_size=_TABLE_K4
    )
    m = object.__new__(cls)
    m.vllm_config = SimpleNamespace(
        speculative_config=spec, num_speculative_tokens=4, cache_config=SimpleNamespace(use_kda_recoverssm=False)
    )
    m.compilation_config = SimpleNamespace(cudagraph_capture_sizes=list(_SIZES_K4), max_cudagraph_capture_size=512)
    m.max_num_reqs, m.decode_query_len = 64, 5
    m.cudagraph_mode = CUDAGraphMode.FULL_AND_PIECEWISE
    m.varlen_decode, m.ubatch_runner, m.lora_capture_cases = False, None, [0]
    m._lora_dispatch_map, m._max_lora_case = {}, 0
    m._candidates, m._capture_descs = {}, {}
    m._init_candidates()
    m.graphs = {d: object() for descs in m._capture_descs.values() for d in descs}
    m._graphs_captured = True
    return m


def test_installed_vllm_has_the_cudagraph_dispatch_shape_the_patch_was_written_for():
    """Fails when vLLM changes CudaGraphManager.dispatch, _is_compatible or the candidate
    grouping that leaves decode batches without their FULL graph: recheck the patch."""
    module = importlib.import_module(vllm_patches.CUDAGRAPH_MODULE)
    vllm_patches.check_cudagraph_dispatch_shape(module.CudaGraphManager)

    class Other:
        def dispatch(self, num_reqs, num_tokens):  # pragma: no cover - never called
            return None

        def _init_candidates(self):  # pragma: no cover - never called
            return None

    with pytest.raises(vllm_patches.VllmShapeError, match="dispatch"):
        vllm_patches.check_cudagraph_dispatch_shape(Other)
    assert vllm_patches.patch_cudagraph_dispatch(Other) is False


def test_vllm_sends_some_k0_decode_batches_to_piecewise_graphs_under_the_batch_size_table():
    """What the patch is for, on vLLM's own code: with the engine host's table, a K = 0
    decode batch of 57-60 requests (or 10-11) finds no FULL graph, though the FULL graph of
    64 (or 16) one-token requests was captured. Fails once vLLM fixes its candidate table:
    then the patch can go."""
    from vllm.config.compilation import CUDAGraphMode

    m = _graph_manager(patched=False)
    for n in (10, 11, 57, 58, 59, 60):
        assert m.dispatch(n, n, 1, 0, max_query_len=1).cg_mode != CUDAGraphMode.FULL, n
    assert m.dispatch(61, 61, 1, 0, max_query_len=1).cg_mode == CUDAGraphMode.FULL


def test_patched_dispatch_gives_every_uniform_decode_batch_a_full_graph_and_leaves_the_rest():
    from vllm.config.compilation import CUDAGraphMode

    plain = _graph_manager(patched=False)
    m = _graph_manager(patched=True)
    for k in range(5):  # every K at every batch size the table's graphs can hold
        q = k + 1
        for n in range(1, 65):
            if n * q > 320:
                continue
            d = m.dispatch(n, n * q, q, 0, max_query_len=q)
            assert d.cg_mode == CUDAGraphMode.FULL, (n, k)
            assert d.uniform_token_count == q and d.num_reqs >= n and d.num_tokens >= n * q, (n, k, d)
            was = plain.dispatch(n, n * q, q, 0, max_query_len=q)
            if was.cg_mode == CUDAGraphMode.FULL:
                assert d == was, (n, k)  # where vLLM found one, the same graph
    # the smallest graph that serves the batch: 58 one-token requests pad to 64, not more
    d = m.dispatch(58, 58, 1, 0, max_query_len=1)
    assert (d.num_tokens, d.num_reqs) == (64, 64)
    # a batch with a prefill (no uniform token count) keeps vLLM's answer
    assert m.dispatch(20, 300, None, 0) == plain.dispatch(20, 300, None, 0)
    # before the graphs are captured nothing changes
    m._graphs_captured = plain._graphs_captured = False
    assert m.dispatch(58, 58, 1, 0, max_query_len=1) == plain.dispatch(58, 58, 1, 0, max_query_len=1)


def test_installed_vllm_and_vllm_033_have_the_v2_runner_shape_the_k0_patch_was_written_for():
    """Fails when Model Runner V2's ``sample_tokens`` or ``DraftTokensHandler.set_draft_tokens``
    change (the installed 0.32 source, and the 0.33 GPU wheel's files kept under tests/data):
    recheck the patch that skips the draft bookkeeping of a step at K = 0."""
    import gzip
    from pathlib import Path

    runner = importlib.import_module(vllm_patches.V2_RUNNER_MODULE).GPUModelRunner
    vllm_patches.check_v2_runner_shape(runner)
    data = Path(__file__).parent / "data/vllm-0.33.0/v1/worker/gpu"
    src = gzip.open(data / "model_runner.py.gz", "rt").read()
    body = src[src.index("    def sample_tokens(") : src.index("    def take_draft_token_ids(")]
    assert body.split(")", 1)[0].split("(", 1)[1].split(",")[:2] == [
        "\n        self",
        " grammar_output: GrammarOutput | None\n    ",
    ]
    for line in vllm_patches.V2_SAMPLE_TOKENS_LINES:
        assert line in body, line
    handler = gzip.open(data / "spec_decode/utils.py.gz", "rt").read()
    setter = handler[handler.index("    def set_draft_tokens(") : handler.index("    def get_draft_tokens(")]
    for line in vllm_patches.DRAFT_HANDLER_LINES:
        assert line in setter, line
    # the next step reads no draft row of a step at K = 0: the async scheduler gives each
    # request as many placeholders as the step's num_spec_tokens_to_schedule
    sched = gzip.open(Path(__file__).parent / "data/vllm-0.33.0/v1/core/sched/async_scheduler.py.gz", "rt").read()
    assert "[-1] * scheduler_output.num_spec_tokens_to_schedule" in sched.replace(
        "[\n            -1\n        ]", "[-1]"
    )


class _DraftTokensHandler:  # the lines of set_draft_tokens the patch repeats
    def set_draft_tokens(self, input_batch, draft_tokens):
        self.req_ids = input_batch.req_ids
        self.num_draft_tokens = draft_tokens.shape[1]
        if not input_batch.has_structured_output_reqs:
            self.draft_tokens_np = None
            return
        self.draft_tokens_np = "copied"  # pragma: no cover


def _v2_runner_class(seen):
    class Runner:  # the shape of Model Runner V2's sample_tokens, recording what it sees
        def __init__(self, speculator):
            self.speculator = speculator
            self.num_speculative_steps = 4
            self.pp_handler = None
            self.adaptive_verification = None
            self.execute_model_state = None
            self.draft_tokens_handler = _DraftTokensHandler()
            self.draft_tokens_handler.__dict__.update(req_ids=["old"], num_draft_tokens=4, draft_tokens_np="stale")
            self.fail = False

        def sample_tokens(self, grammar_output):
            num_spec_tokens = self.execute_model_state.num_spec_tokens_to_schedule
            seen.append((self.speculator, self.num_speculative_steps, num_spec_tokens))
            if self.fail:
                raise RuntimeError("step failed")
            if self.speculator is not None:
                draft_tokens = self.speculator.propose(  # noqa: F841
                    None
                )
            if self.num_speculative_steps > 0:
                self.draft_tokens_handler.set_draft_tokens(
                    self.execute_model_state.input_batch, types.SimpleNamespace(shape=(2, num_spec_tokens))
                )
            return "output"

    return Runner


def test_v2_runner_skips_the_draft_bookkeeping_of_an_ngram_step_at_k0_only(monkeypatch):
    seen: list = []
    Runner = _v2_runner_class(seen)

    class NgramGPUSpeculator:
        def propose(self, *a):
            return None

    class StandaloneARSpeculator(NgramGPUSpeculator):
        pass

    vllm_patches.check_v2_runner_shape(Runner, _DraftTokensHandler)
    monkeypatch.setattr(
        importlib.import_module("vllm.v1.worker.gpu.spec_decode.utils"), "DraftTokensHandler", _DraftTokensHandler
    )
    assert vllm_patches.patch_v2_runner(Runner)
    assert vllm_patches.patch_v2_runner(Runner)  # idempotent

    def state(k, drafts=0, structured=False):
        batch = types.SimpleNamespace(
            req_ids=["a", "b"], num_draft_tokens=drafts, has_structured_output_reqs=structured
        )
        return types.SimpleNamespace(num_spec_tokens_to_schedule=k, input_batch=batch)

    spec = NgramGPUSpeculator()
    r = Runner(spec)
    r.execute_model_state = state(0)
    assert r.sample_tokens(None) == "output"
    assert seen[-1] == (None, 0, 0)  # the step ran as an engine without speculation
    assert r.speculator is spec and r.num_speculative_steps == 4  # put back
    h = r.draft_tokens_handler
    assert (h.req_ids, h.num_draft_tokens, h.draft_tokens_np) == (["a", "b"], 0, None)
    for st in (state(2), state(0, drafts=3), state(0, structured=True)):  # drafts proposed, verified, or a grammar
        r.execute_model_state = st
        r.sample_tokens(None)
        assert seen[-1][:2] == (spec, 4)
    other = Runner(StandaloneARSpeculator())  # a draft model keeps its passes
    other.execute_model_state = state(0)
    other.sample_tokens(None)
    assert seen[-1][1] == 4
    r.execute_model_state = state(0)
    r.fail = True
    with pytest.raises(RuntimeError):
        r.sample_tokens(None)
    assert r.speculator is spec and r.num_speculative_steps == 4  # put back after an error too

    class NoSampleTokens:
        pass

    with pytest.raises(vllm_patches.VllmShapeError, match="sample_tokens"):
        vllm_patches.check_v2_runner_shape(NoSampleTokens, _DraftTokensHandler)
    assert vllm_patches.patch_v2_runner(NoSampleTokens) is False
    monkeypatch.setenv("SPECPILOT_K0_LEAN", "0")
    assert vllm_patches.patch_v2_runner(_v2_runner_class([])) is False  # switched off
