"""The guest side is an island: it runs inside the sandbox with the stdlib only."""

from __future__ import annotations

import sys
from pathlib import Path

from tests._source import imports_of

import codecage.guest

GUEST_DIR = Path(codecage.guest.__file__).parent


def test_guest_modules_import_only_the_standard_library() -> None:
    """...and each other: in the sandbox this directory is the package `codecage`, so
    `codecage.imports` there is guest/imports.py, never a host module."""
    files = sorted(GUEST_DIR.rglob("*.py"))  # the runtime's subpackage too
    assert GUEST_DIR / "runtime" / "bridge.py" in files
    own = {
        ".".join(("codecage", *path.relative_to(GUEST_DIR).with_suffix("").parts)).removesuffix(
            ".__init__"
        )
        for path in files
    }
    # The one exception: our matplotlib backend, which only matplotlib itself imports.
    loaded_by = {GUEST_DIR / "runtime" / "plots.py": "matplotlib"}
    for path in files:
        outside = {
            name
            for name in imports_of(path)
            if name.split(".")[0] not in sys.stdlib_module_names
            and name != "__future__"
            and name not in own
            and name.split(".")[0] != loaded_by.get(path)
        }
        assert not outside, f"{path.name} imports {outside}"


def test_the_guest_runs_the_code_as_main_of_the_named_file(sandbox: object) -> None:
    from codecage import Sandbox

    assert isinstance(sandbox, Sandbox)
    r = sandbox.run("import sys\n(__name__, __file__, sys.argv)", filename="job.py")
    assert r.return_value == ["__main__", "/workspace/job.py", ["job.py"]]


def test_the_runtime_is_compiled_beside_its_source_for_the_read_only_sandbox() -> None:
    """In the sandbox the guest package is read-only: without this bytecode every start
    compiles the contract again, and every `import codecage.runtime` its modules."""
    import importlib.util

    from codecage.isolation import rootfs

    package = rootfs.guest_package_dir()
    sources = [package / "contract.py", package / "imports.py", package / "runtime" / "__init__.py"]
    sources += [package / "runtime" / "bridge.py", package / "runtime" / "search.py"]
    for source in sources:
        Path(importlib.util.cache_from_source(str(source))).unlink(missing_ok=True)
    rootfs.precompile_guest_package.__wrapped__()
    for source in sources:
        cached = Path(importlib.util.cache_from_source(str(source)))
        assert cached.is_file(), source
        assert cached.stat().st_mtime >= source.stat().st_mtime


def test_a_value_without_json_comes_back_as_a_bounded_repr_even_when_its_repr_raises(
    sandbox: object,
) -> None:
    """The return value (the bootstrap) and a display's text/plain (the runtime) both
    fall back to guest/reprs.py, which the sandbox must reach on either path: a repr cut
    to its items (1000 of a return value's, 100 of a display's), an item whose repr
    raises shown by its type and address."""
    from codecage import Sandbox

    assert isinstance(sandbox, Sandbox)
    code = (
        "class Hostile:\n"
        "    def __repr__(self): raise ValueError('no')\n"
        "display([list(range(200)), Hostile()])\n"
        "(list(range(2000)), Hostile())\n"
    )
    r = sandbox.run(code)
    assert r.ok, r.error
    [shown] = [d.data["text/plain"] for d in r.displays]
    assert shown.startswith("[[0, 1, 2,") and ", 99, ...], <Hostile instance at 0x" in shown
    assert isinstance(r.return_value, str)
    assert r.return_value.startswith("([0, 1,") and ", 999, ...], <Hostile instance at 0x" in (
        r.return_value
    )
