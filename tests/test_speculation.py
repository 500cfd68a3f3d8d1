"""Speculation methods: the vllm serve command per method and the refusals before start (no engine)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from engine_host import launcher, speculation
from engine_host.speculation import SpeculationError

VLLM_METHODS = set(speculation.METHODS) | {"medusa", "suffix"}


def model_folder(root: Path, name: str, vocab: dict[str, int], vocab_size: int | None = None, **cfg) -> Path:
    """A fabricated model folder: config.json and a tokenizer.json with ``vocab``."""
    d = root / name
    d.mkdir()
    (d / "config.json").write_text(
        json.dumps({"architectures": ["LlamaForCausalLM"], "vocab_size": vocab_size or len(vocab), **cfg})
    )
    (d / "tokenizer.json").write_text(
        json.dumps(
            {"model": {"type": "BPE", "vocab": vocab, "merges": []}, "added_tokens": [{"id": 0, "content": "<s>"}]}
        )
    )
    return d


VOCAB = {"<s>": 0, "a": 1, "b": 2, "ab": 3}


def test_the_installed_vllm_knows_every_method_the_host_offers():
    known = speculation.installed_vllm_methods()
    assert set(speculation.METHODS) <= known  # fails when vLLM renames or drops a method


def test_methods_read_from_vllms_source_are_the_ones_its_import_gives():
    """The launcher reads ``SpeculativeMethod`` from vLLM's source instead of importing it (the
    import costs seconds before vLLM starts). Fails when vLLM's literal changes shape so that the
    source read misses it (the import fallback would then cost those seconds again)."""
    import typing

    from vllm.config.speculative import SpeculativeMethod

    imported: set[str] = set()

    def walk(t):
        for a in typing.get_args(t):
            imported.add(a) if isinstance(a, str) else walk(a)

    walk(SpeculativeMethod)
    assert speculation._methods_from_source() == imported


@pytest.mark.parametrize(
    "source,expect",
    [
        ('A = Literal["x", "y"]\nSpeculativeMethod = Literal["ngram", A] | Literal["z"]\n', {"ngram", "x", "y", "z"}),
        ('SpeculativeMethod = Literal["ngram", make_more()]\n', set()),  # an element of another shape: cannot tell
        ('Other = Literal["ngram"]\n', set()),  # no SpeculativeMethod
    ],
)
def test_source_read_of_the_methods_takes_literals_and_names_and_nothing_else(tmp_path, monkeypatch, source, expect):
    import importlib.util
    import types

    (tmp_path / "config").mkdir()
    (tmp_path / "config" / "speculative.py").write_text(source)
    fake = types.SimpleNamespace(submodule_search_locations=[str(tmp_path)])
    monkeypatch.setattr(importlib.util, "find_spec", lambda name: fake)
    assert speculation._methods_from_source() == expect


def test_draft_model_command_names_the_draft_and_its_settings():
    args = launcher.build_parser().parse_args(
        [
            "--speculative-method",
            "draft_model",
            "--k-max",
            "5",
            "--draft-tensor-parallel-size",
            "2",
            "--draft-quantization",
            "fp8",
        ]
    )
    cmd = launcher.vllm_command(args, "/m/target", [], draft="/m/draft")
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec == {
        "method": "draft_model",
        "num_speculative_tokens": 5,
        "model": "/m/draft",
        "draft_tensor_parallel_size": 2,
        "quantization": "fp8",
    }


def test_ngram_gpu_command_keeps_the_lookup_lengths():
    args = launcher.build_parser().parse_args(["--speculative-method", "ngram_gpu", "--k-max", "3"])
    cmd = launcher.vllm_command(args, "/m/t", [])
    spec = json.loads(cmd[cmd.index("--speculative-config") + 1])
    assert spec["method"] == "ngram_gpu" and spec["prompt_lookup_min"] == 2 and spec["prompt_lookup_max"] == 4


def test_same_tokenizer_draft_passes(tmp_path):
    t = model_folder(tmp_path, "target", VOCAB)
    d = model_folder(tmp_path, "draft", VOCAB, num_hidden_layers=2)
    speculation.check("draft_model", str(t), str(d), cpu_build=True, vllm_methods=VLLM_METHODS)


def test_draft_with_another_vocabulary_size_is_refused(tmp_path):
    t = model_folder(tmp_path, "target", VOCAB)
    d = model_folder(tmp_path, "draft", {"<s>": 0, "x": 1}, vocab_size=2)
    with pytest.raises(SpeculationError, match="vocabulary of 2 tokens, the target .* 4"):
        speculation.check("draft_model", str(t), str(d), cpu_build=True, vllm_methods=VLLM_METHODS)


def test_draft_with_same_size_but_another_tokenizer_is_refused(tmp_path):
    t = model_folder(tmp_path, "target", VOCAB)
    d = model_folder(tmp_path, "draft", {"<s>": 0, "b": 1, "a": 2, "ab": 3})  # ids swapped
    with pytest.raises(SpeculationError, match="another tokenizer"):
        speculation.check("draft_model", str(t), str(d), cpu_build=True, vllm_methods=VLLM_METHODS)


def test_launcher_refuses_another_vocabulary_with_a_message_and_no_traceback(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("SPECPILOT_HOME", str(tmp_path / "home"))
    t = model_folder(tmp_path, "target", VOCAB)
    d = model_folder(tmp_path, "draft", {"<s>": 0, "x": 1}, vocab_size=2)
    rc = launcher.main(["--model", str(t), "--speculative-method", "draft_model", "--draft-model", str(d)])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: draft ") and "Traceback" not in err
    assert not (tmp_path / "home" / "run").exists()  # nothing started, no channel written


@pytest.mark.parametrize(
    "method,draft,cpu,match",
    [
        ("eagle3", None, True, "needs a trained EAGLE3 head"),
        ("eagle", None, False, "needs a trained EAGLE head"),
        ("ngram_gpu", None, True, "needs a GPU"),
        ("mtp", None, False, "multi-token-prediction layers"),
        ("draft_model", None, True, "needs --draft-model"),
        ("ngram", "draft", True, "takes no --draft-model"),
    ],
)
def test_methods_that_cannot_run_are_refused(tmp_path, method, draft, cpu, match):
    t = model_folder(tmp_path, "target", VOCAB)
    d = str(model_folder(tmp_path, "draft", VOCAB)) if draft else None
    with pytest.raises(SpeculationError, match=match):
        speculation.check(method, str(t), d, cpu_build=cpu, vllm_methods=VLLM_METHODS)


def test_eagle3_with_a_plain_model_instead_of_a_head_is_refused(tmp_path):
    t = model_folder(tmp_path, "target", VOCAB)
    d = model_folder(tmp_path, "notahead", VOCAB)
    with pytest.raises(SpeculationError, match="not an EAGLE head"):
        speculation.check("eagle3", str(t), str(d), cpu_build=False, vllm_methods=VLLM_METHODS)
    head = tmp_path / "head"
    head.mkdir()
    (head / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLMEagle3"]}))
    speculation.check("eagle3", str(t), str(head), cpu_build=False, vllm_methods=VLLM_METHODS)


def test_a_method_the_installed_vllm_lacks_is_refused(tmp_path):
    t = model_folder(tmp_path, "target", VOCAB)
    with pytest.raises(SpeculationError, match="installed vLLM does not know"):
        speculation.check("ngram_gpu", str(t), None, cpu_build=False, vllm_methods={"ngram", "eagle"})


def test_mtp_target_with_mtp_layers_passes(tmp_path):
    t = model_folder(tmp_path, "target", VOCAB, num_nextn_predict_layers=1)
    speculation.check("mtp", str(t), None, cpu_build=True, vllm_methods=VLLM_METHODS)


def test_spec_travels_to_vllm_processes_through_the_environment():
    spec = speculation.SpeculationSpec("draft_model", "/m/d-L8", "d-L8", 6)
    env = {speculation.ENV_SPECULATION: json.dumps(spec.as_dict())}
    assert speculation.from_env(env) == spec
    assert speculation.from_env({}) is None
