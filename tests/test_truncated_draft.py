"""The default model's truncated draft: its first N layers, embeddings, final norm and LM head."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from safetensors import safe_open

from engine_host import model as m
from engine_host import speculation


def test_truncated_draft_keeps_first_layers_and_shares_the_tokenizer(default_model):
    draft = m.prepare_truncated_draft(2, quiet=True)
    assert draft.parent == Path(default_model).parent and draft.name.endswith("-draft-L2")
    cfg = json.loads((draft / "config.json").read_text())
    full = json.loads((Path(default_model) / "config.json").read_text())
    assert cfg["num_hidden_layers"] == 2 and {k: v for k, v in cfg.items() if k != "num_hidden_layers"} == {
        k: v for k, v in full.items() if k != "num_hidden_layers"
    }
    with safe_open(str(draft / "model.safetensors"), framework="pt") as sf:
        names = set(sf.keys())
    layers = {int(n.split(".")[2]) for n in names if n.startswith("model.layers.")}
    assert layers == {0, 1}
    assert "model.embed_tokens.weight" in names and "model.norm.weight" in names
    speculation.check("draft_model", default_model, str(draft), cpu_build=True)  # same tokenizer: accepted
    assert m.prepare_truncated_draft(2, quiet=True) == draft  # once


@pytest.mark.parametrize("layers", [0, 30, 31])
def test_a_cut_outside_the_model_is_refused(default_model, layers):
    with pytest.raises(m.ModelError, match=f"keeps 1..29 of the model's 30 layers, not {layers}"):
        m.prepare_truncated_draft(layers, quiet=True)


def test_draft_default_only_for_the_default_model(default_model, tmp_path):
    with pytest.raises(m.ModelError, match="drafts only for"):
        m.resolve_draft("default", str(tmp_path), "draft_model")
    assert m.resolve_draft(None, default_model, "ngram") is None
    assert m.resolve_draft(None, default_model, "draft_model", prepare=False) == str(m.truncated_draft_dir())
