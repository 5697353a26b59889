"""Issue 36: `pip install /path/to/checkout` leaves the checkout as it was (it wrote
`build/` and `src/codecage.egg-info` there, and failed on a checkout its user could not
write). Built for real with this environment's pip and setuptools (from the lock, no
build isolation: nothing is downloaded), from a copy of the checkout."""

from __future__ import annotations

import shutil
import subprocess
import sys
import warnings
import zipfile
from pathlib import Path

import pytest
from pip._vendor.pyproject_hooks import BuildBackendHookCaller, BuildBackendWarning

pytestmark = pytest.mark.timeout(300)

ROOT = Path(__file__).resolve().parents[2]


def _checkout(tmp_path: Path) -> Path:
    """What a source checkout holds for a build (no caches, no venv)."""
    copy = tmp_path / "checkout"
    copy.mkdir()
    for name in ("pyproject.toml", "README.md", "MANIFEST.in"):
        shutil.copy2(ROOT / name, copy / name)
    ignore = shutil.ignore_patterns("__pycache__", "*.pyc", "*.egg-info")
    for name in ("src", "build_backend"):
        shutil.copytree(ROOT / name, copy / name, ignore=ignore)
    return copy


def _snapshot(tree: Path) -> dict[str, object]:
    """Every file in `tree` with its size and modification time, every directory with its
    entries. Python's own bytecode cache (`__pycache__`, which any import of the in-tree
    build backend writes unless PYTHONDONTWRITEBYTECODE is set, as for any source a
    Python imports) is left out: it is not the build's, and git ignores it."""
    seen: dict[str, object] = {}
    for path in [tree, *tree.rglob("*")]:
        if "__pycache__" in path.relative_to(tree).parts:
            continue
        name = str(path.relative_to(tree))
        if path.is_dir() and not path.is_symlink():
            seen[name] = sorted(e.name for e in path.iterdir() if e.name != "__pycache__")
        else:
            seen[name] = (path.lstat().st_size, path.lstat().st_mtime_ns)
    return seen


def test_pip_install_of_a_checkout_leaves_the_tree_as_it_was(tmp_path: Path) -> None:
    checkout = _checkout(tmp_path)
    before = _snapshot(checkout)
    wheels = tmp_path / "wheels"
    built = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "-q", "--no-build-isolation", "--no-deps",
         "--no-cache-dir", "-w", str(wheels), str(checkout)],
        capture_output=True, text=True, timeout=280, check=False,
    )  # fmt: skip
    assert built.returncode == 0, built.stderr[-3000:]
    after = _snapshot(checkout)
    assert sorted(set(after) - set(before)) == []  # no build/, no src/codecage.egg-info
    assert after == before
    (wheel,) = wheels.glob("codecage-*.whl")
    names = zipfile.ZipFile(wheel).namelist()
    assert "codecage/__init__.py" in names and "codecage/py.typed" in names
    assert "codecage/guest/bootstrap.py" in names
    assert any(n.endswith(".dist-info/entry_points.txt") for n in names)


def test_an_editable_build_still_works_and_leaves_the_tree_as_it_was(tmp_path: Path) -> None:
    """scripts/setup installs with `pip install --no-build-isolation -e .`: the backend's
    editable hook, called as a frontend calls it (pip's own hook caller)."""
    checkout = _checkout(tmp_path)
    before = _snapshot(checkout)
    hooks = BuildBackendHookCaller(
        str(checkout),
        "codecage_build",
        backend_path=["build_backend"],
        python_executable=sys.executable,
    )
    out = tmp_path / "editable"
    out.mkdir()
    with warnings.catch_warnings():  # setuptools' deprecations, passed on by the hook caller
        warnings.simplefilter("ignore", BuildBackendWarning)
        name = hooks.build_editable(str(out))
    assert _snapshot(checkout) == before
    with zipfile.ZipFile(out / name) as wheel:
        pth = [n for n in wheel.namelist() if n.endswith(".pth")]
        assert pth
        assert any(str(checkout / "src") in wheel.read(n).decode() for n in pth)
