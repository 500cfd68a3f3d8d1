"""The vLLM patches (engine_host/vllm_patches.py): version guard, behaviour, and on the
real engine that the n-gram proposer does no work at K = 0."""

from __future__ import annotations

import importlib
import inspect
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
