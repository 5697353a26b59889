"""Issue 18, item 4: packages an operator can add.

Before, nothing said how an operator adds scikit-learn or openpyxl, and a missing package
was a bare `ModuleNotFoundError`. Now `codecage packages add | list | remove` installs into
a directory codecage owns (trusted as the config file is), pinned and recorded, bound
read-only at /opt/packages into the sandboxes whose profile allows the packages; and a
missing module says it is not installed and how the operator adds it.

The install test reaches the host's package registry (through pip and its configuration);
it skips, saying so, when the registry cannot be reached. The others build a packages
directory by hand, as `add` would leave it, and need no network.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from tests._cli import codecage

from codecage import ConfigError, Options, Sandbox
from codecage import packages as added
from codecage.guest import bootstrap

CODECAGE = [sys.executable, "-m", "codecage.cli"]
TREE_ID = "0123456789abcdef0123456789abcdef"


def cli(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    clean = {k: v for k, v in os.environ.items() if not k.startswith("CODECAGE_")}
    return codecage(*args, env={**clean, **(env or {})}, timeout=600, command=CODECAGE)


@pytest.fixture
def private_tmp(tmp_path: Path) -> Path:
    """tmp_path, with the modes a trusted directory needs (pytest's may be 0700: fine)."""
    tmp_path.chmod(0o755)
    return tmp_path


def handmade_dir(root: Path, module: str = "cc_added_pkg", version: str = "1.2.3") -> Path:
    """A packages directory as `add` leaves it, with one pure-Python module in its tree."""
    directory = root / "packages"
    tree = directory / "trees" / TREE_ID
    (tree / module).mkdir(parents=True)
    (tree / module / "__init__.py").write_text(f"__version__ = {version!r}\n")
    record = added.Record(
        python=f"{sys.version_info.major}.{sys.version_info.minor}",
        tree=TREE_ID,
        packages=[
            added.Entry(
                name=module.replace("_", "-"),
                version=version,
                requested=True,
                requirement=f"{module}=={version}",
                top_level=[module],
            )
        ],
    )
    (directory / added.RECORD_NAME).write_text(json.dumps(record.model_dump(mode="json")))
    for path in (directory, directory / "trees", tree, tree / module):
        path.chmod(0o755)
    return directory


# --- the sandbox side: no network needed ------------------------------------------------


def test_an_added_package_is_importable_and_read_only_in_the_sandbox(private_tmp: Path) -> None:
    directory = handmade_dir(private_tmp)
    code = (
        "import cc_added_pkg, os\n"
        "print(cc_added_pkg.__version__, cc_added_pkg.__file__)\n"
        "try:\n"
        "    open('/opt/packages/cc_added_pkg/planted.py', 'w')\n"
        "except OSError as exc:\n"
        "    print('write refused', exc.errno)\n"
        "try:\n"
        "    os.mkdir('/opt/packages/new')\n"
        "except OSError as exc:\n"
        "    print('mkdir refused', exc.errno)\n"
    )
    r = Sandbox(options=Options(packages_dir=directory, import_policy=False, scrub=False)).run(code)
    assert r.status == "ok", r.error
    assert "1.2.3 /opt/packages/cc_added_pkg/__init__.py" in r.stdout
    assert "write refused 30" in r.stdout  # EROFS
    assert "mkdir refused 30" in r.stdout
    assert not (directory / "trees" / TREE_ID / "cc_added_pkg" / "planted.py").exists()


def test_the_profile_decides_whether_an_added_package_may_be_imported(private_tmp: Path) -> None:
    directory = handmade_dir(private_tmp)
    allowed = Sandbox(allowed_imports=["cc_added_pkg"], options=Options(packages_dir=directory))
    r = allowed.run("import cc_added_pkg\ncc_added_pkg.__version__")
    assert r.status == "ok", r.error
    assert r.return_value == "1.2.3"

    refused = Sandbox(profile="basic", options=Options(packages_dir=directory)).run(
        "import cc_added_pkg"
    )
    assert refused.error is not None
    # The import policy's refusal, not "not installed": it is installed, just not allowed.
    assert refused.error.type == "ImportError"
    assert "not allowed by the profile" in refused.error.message
    # And a profile that allows none of the packages does not even get them bound.
    probe = Sandbox(profile="basic", options=Options(packages_dir=directory)).run(
        "try:\n    open('/opt/packages/cc_added_pkg/__init__.py')\n    seen = 'bound'\n"
        "except OSError:\n    seen = 'absent'\nseen"
    )
    assert probe.return_value == "absent"


def test_a_missing_module_says_it_is_not_installed_and_how_the_operator_adds_it() -> None:
    sandbox = Sandbox(options=Options(import_policy=False, scrub=False))
    r = sandbox.run("import sklearn.linear_model")
    assert r.error is not None and r.error.type == "ModuleNotFoundError"
    message = r.error.message
    assert message.startswith("No module named 'sklearn'. It is not installed on this host")
    assert "the operator can add it with `codecage packages add scikit-learn`" in message
    assert "cannot install" in message  # so the agent does not try pip itself
    # Under a curated profile that names it (data_science), the same explanation.
    r = Sandbox(profile="data_science", options=Options(scrub=False)).run("import sklearn")
    assert r.error is not None and "codecage packages add scikit-learn" in r.error.message
    # Unknown names are suggested as themselves; `e.name` stays the module's name.
    r = sandbox.run(
        "try:\n    import cc_nowhere_module\nexcept ModuleNotFoundError as e:\n"
        "    print(e.name)\n    print(e)\n"
    )
    assert r.stdout.splitlines()[0] == "cc_nowhere_module"
    assert "`codecage packages add cc_nowhere_module`" in r.stdout
    # Library code's own lookups are untouched: optional dependencies still probe quietly.
    r = sandbox.run("import importlib.util\nimportlib.util.find_spec('cc_nowhere_module')")
    assert r.status == "ok" and r.return_value is None


def test_a_group_writable_packages_dir_is_refused(private_tmp: Path) -> None:
    directory = handmade_dir(private_tmp)
    directory.chmod(0o775)
    with pytest.raises(ConfigError, match=r"not trusted: .*writable by group"):
        Sandbox(options=Options(packages_dir=directory, import_policy=False)).run("1")
    p = cli("packages", "list", "--packages-dir", str(directory), "--json")
    assert p.returncode == 2
    assert "writable by group" in json.loads(p.stdout)["error"]["message"]
    # `add` is refused before pip runs: nothing is installed into a directory others change.
    p = cli("packages", "add", "tabulate", "--packages-dir", str(directory), "--json")
    assert p.returncode == 2, p.stderr
    assert "not trusted" in json.loads(p.stdout)["error"]["message"]
    # A directory above it that others may write is as bad.
    directory.chmod(0o755)
    private_tmp.chmod(0o777)
    with pytest.raises(ConfigError, match="not trusted"):
        Sandbox(options=Options(packages_dir=directory, import_policy=False)).run("1")
    private_tmp.chmod(0o755)


def test_a_record_others_may_write_or_pointing_elsewhere_is_refused(private_tmp: Path) -> None:
    directory = handmade_dir(private_tmp)
    record = directory / added.RECORD_NAME
    record.chmod(0o666)
    with pytest.raises(ConfigError, match="record is not trusted"):
        added.installed(directory)
    record.chmod(0o644)
    data = json.loads(record.read_text())
    data["tree"] = "../../etc"
    record.write_text(json.dumps(data))
    with pytest.raises(ConfigError, match="bad tree id"):
        Sandbox(options=Options(packages_dir=directory, import_policy=False)).run("1")


def test_info_lists_the_added_packages(private_tmp: Path) -> None:
    directory = handmade_dir(private_tmp)
    report = Sandbox(options=Options(packages_dir=directory)).info()
    assert [(p.name, p.version) for p in report.packages] == [("cc-added-pkg", "1.2.3")]
    p = cli("info", env={added.ENV_DIR: str(directory)})
    assert p.returncode == 0, p.stderr
    assert "added packages: cc-added-pkg==1.2.3" in p.stdout


def test_the_directory_has_one_name_in_four_spellings(private_tmp: Path) -> None:
    config_file = private_tmp / "config.toml"
    config_file.write_text('[packages]\ndir = "from-file"\n')
    from codecage.config import load

    settings = load(config_file, environ={})
    assert added.location(None, settings, {})[0] == private_tmp / "from-file"
    env = {added.ENV_DIR: str(private_tmp / "from-env")}
    assert added.location(None, settings, env)[0] == private_tmp / "from-env"
    assert added.location(private_tmp / "arg", settings, env)[0] == private_tmp / "arg"
    sandbox = Sandbox(options=Options(packages_dir=private_tmp / "lib", config=settings))
    assert sandbox.host.packages_dir == private_tmp / "lib"


def test_import_names_are_mapped_to_their_distributions() -> None:
    wanted, notes = added._parse(["sklearn==1.5.2", "PIL", "tabulate"])
    assert wanted == {
        "scikit-learn": "scikit-learn==1.5.2",
        "pillow": "pillow",
        "tabulate": "tabulate",
    }
    assert notes == ["sklearn is an import name: adding scikit-learn", "PIL is an import name: "
                     "adding pillow"]  # fmt: skip
    assert added.DISTRIBUTIONS is bootstrap.DISTRIBUTIONS  # one table, host and guest
    with pytest.raises(ConfigError, match="only a name"):
        added._parse(["tabulate @ https://example.invalid/t.whl"])


# --- a real install from the registry -------------------------------------------------------


@pytest.fixture(scope="module")
def registry(tmp_path_factory: pytest.TempPathFactory) -> Iterator[None]:
    """Skip (saying why) when pip cannot fetch from the host's registry."""
    scratch = tmp_path_factory.mktemp("registry")
    try:
        probe = subprocess.run(
            [sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary", ":all:",
             "--disable-pip-version-check", "-d", str(scratch), "tabulate==0.9.0"],
            capture_output=True, text=True, timeout=180, check=False,
        )  # fmt: skip
    except subprocess.TimeoutExpired:
        pytest.skip("the package registry did not answer pip within 180 s")
    if probe.returncode != 0:
        tail = (probe.stderr.strip().splitlines() or ["?"])[-1]
        pytest.skip(f"the package registry cannot be reached with pip here: {tail}")
    yield


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_add_list_replace_remove_from_the_registry(registry: None, private_tmp: Path) -> None:
    directory = private_tmp / "var" / "packages"  # created by `add`, parents too
    where = ["--packages-dir", str(directory)]

    p = cli("packages", "add", "tabulate==0.9.0", *where, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["installed"] == ["tabulate==0.9.0"]
    assert oct(directory.stat().st_mode & 0o777) == "0o755"

    listing = json.loads(cli("packages", "list", *where, "--json").stdout)
    (entry,) = listing["packages"]
    assert (entry["name"], entry["version"], entry["requested"]) == ("tabulate", "0.9.0", True)
    assert entry["requirement"] == "tabulate==0.9.0"
    assert entry["top_level"] == ["tabulate"]
    assert len(entry["hashes"].get("sha256", "")) == 64
    human = cli("packages", "list", *where)
    assert "tabulate==0.9.0" in human.stdout

    code = (
        "import tabulate\nprint(tabulate.tabulate([[1, 2]]))\n"
        "(tabulate.__version__, tabulate.__file__)"
    )
    r = Sandbox(
        allowed_imports=["tabulate"], options=Options(packages_dir=directory, scrub=False)
    ).run(code)
    assert r.status == "ok", r.error
    version, path = r.return_value
    assert version == "0.9.0" and path.startswith("/opt/packages/tabulate")

    # A new version replaces the old one: one entry, and new sandboxes import it.
    p = cli("packages", "add", "tabulate==0.10.0", *where, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["changed"] == ["tabulate==0.9.0 -> 0.10.0"]
    record = added.installed(directory)
    assert [(e.name, e.version) for e in record.packages] == [("tabulate", "0.10.0")]
    r = Sandbox(options=Options(packages_dir=directory, import_policy=False)).run(
        "import tabulate\ntabulate.__version__"
    )
    assert r.return_value == "0.10.0"

    p = cli("packages", "remove", "numpy", *where, "--json")
    assert p.returncode == 2
    assert "not among the added packages" in json.loads(p.stdout)["error"]["message"]

    p = cli("packages", "remove", "tabulate", *where, "--json")
    assert p.returncode == 0, p.stderr
    assert json.loads(p.stdout)["removed"] == ["tabulate==0.10.0"]
    assert added.installed(directory).packages == []
    r = Sandbox(options=Options(packages_dir=directory, import_policy=False)).run("import tabulate")
    assert r.error is not None
    assert "`codecage packages add tabulate`" in r.error.message


def test_a_workspace_overlapping_the_packages_dir_is_refused(private_tmp: Path) -> None:
    """Code writes its workspace as this user, so a module it planted in the packages tree
    would pass the trust check and run in every later sandbox that imports it."""
    directory = handmade_dir(private_tmp)
    sandbox = Sandbox(options=Options(packages_dir=directory, import_policy=False))
    plant = f"open('trees/{TREE_ID}/cc_added_pkg/__init__.py', 'w').write('planted = 1')"
    with pytest.raises(ConfigError, match="overlap"):
        sandbox.run(plant, workspace=directory)
    with pytest.raises(ConfigError, match="overlap"):
        sandbox.run("1", workspace=private_tmp)  # holds it
    with pytest.raises(ConfigError, match="overlap"):
        sandbox.run("1", workspace=directory / "trees" / TREE_ID)  # inside it
    assert (
        "planted"
        not in (directory / "trees" / TREE_ID / "cc_added_pkg" / "__init__.py").read_text()
    )
    elsewhere = private_tmp / "work"
    elsewhere.mkdir()
    assert sandbox.run("1", workspace=elsewhere).return_value == 1
