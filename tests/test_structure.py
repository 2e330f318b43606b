"""The imports point one way: benchmarks -> service -> sharding -> model, and inside service
server -> engine (an AST scan of every import statement, so a lazy import inside a function
counts too). The measurement tools have their own entry point (``meshserve-bench``,
benchmarks/cli.py): the serving code imports none of them."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
# package -> the top-level packages of this repository it must not import
FORBIDDEN = {
    "model": {"sharding", "service", "benchmarks"},
    "sharding": {"service", "benchmarks"},
    "service": {"benchmarks"},
    "service/engine": {"benchmarks", "service.server"},
}
# The format readers and the module builder never import the loader that dispatches to them.
READERS = (
    "model/weights/build.py",
    "model/weights/checkpoint.py",
    "model/weights/gguf_weights.py",
    "model/weights/hf_weights.py",
)


def imports(path: Path) -> list[tuple[str, int, bool]]:
    """(imported module, line, at module level) for every absolute import in ``path``."""
    tree = ast.parse(path.read_text(encoding="utf-8"), str(path))
    top_level = {id(node) for node in tree.body}
    # A module-level `if TYPE_CHECKING:` / `try:` block still runs at import: count it as top level.
    for node in tree.body:
        if isinstance(node, ast.If | ast.Try):
            top_level |= {id(n) for n in ast.walk(node)}
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, node.lineno, id(node) in top_level) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.module, node.lineno, id(node) in top_level))
    return found


def sources(package: str) -> list[Path]:
    return sorted((ROOT / package).rglob("*.py"))


def test_the_scan_sees_lazy_and_module_level_imports(tmp_path: Path) -> None:
    probe = tmp_path / "probe.py"
    probe.write_text(
        "import os\nfrom benchmarks import roofline\n\ndef f():\n    from service.server.cli import main\n"
    )
    assert imports(probe) == [("os", 1, True), ("benchmarks", 2, True), ("service.server.cli", 5, False)]


@pytest.mark.parametrize("package", sorted(FORBIDDEN))
def test_a_package_imports_nothing_above_it(package: str) -> None:
    files = sources(package)
    assert len(files) >= 5  # the scan found the package
    wrong = []
    for path in files:
        rel = path.relative_to(ROOT).as_posix()
        for module, line, _ in imports(path):
            if any(module == above or module.startswith(above + ".") for above in FORBIDDEN[package]):
                wrong.append(f"{rel}:{line} imports {module}")
    assert not wrong, "imports against the direction benchmarks -> service -> sharding -> model:\n" + "\n".join(wrong)


def test_the_measurement_tools_have_their_own_entry_point() -> None:
    import tomllib

    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts == {"meshserve": "service.server.cli:main", "meshserve-bench": "benchmarks.cli:main"}
    assert {m for m, _, _ in imports(ROOT / "benchmarks/cli.py")} >= {"benchmarks"}


@pytest.mark.parametrize("reader", READERS)
def test_readers_do_not_import_the_loader(reader: str) -> None:
    assert "model.weights.loader" not in {m for m, _, _ in imports(ROOT / reader)}


def test_the_measurement_tools_live_in_benchmarks() -> None:
    for moved in ("service/bench.py", "service/sweep.py", "sharding/roofline.py"):
        assert not (ROOT / moved).exists()
    for tool in ("__init__.py", "bench.py", "sweep.py", "roofline.py", "peers.py"):
        assert (ROOT / "benchmarks" / tool).is_file()
