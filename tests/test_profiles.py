"""Capability profiles and the import policy (a policy layer, not the boundary)."""

from __future__ import annotations

import pytest

from codecage import ConfigError, Options, Sandbox
from codecage.guest.imports import allowed as module_allowed
from codecage.policy.profiles import BUILTIN_PROFILES, resolve


@pytest.fixture(scope="module")
def basic() -> Sandbox:
    return Sandbox(profile="basic")


def test_the_basic_profile_allows_the_curated_stdlib(basic: Sandbox) -> None:
    code = (
        "import math, statistics, json, csv, re, datetime, zoneinfo, hashlib, base64, uuid\n"
        "import collections, itertools, functools, decimal, fractions, asyncio\n"
        "import xml.etree.ElementTree as ET, urllib.parse, html.parser\n"
        "round(statistics.mean([1, 2, 4]), 3)"
    )
    r = basic.run(code)
    assert (r.status, r.return_value) == ("ok", 2.333), r.error


@pytest.mark.parametrize("module", ["os", "socket", "subprocess", "ctypes", "sys", "importlib"])
def test_an_import_outside_the_profile_is_refused_with_an_actionable_message(
    basic: Sandbox, module: str
) -> None:
    r = basic.run(f"import {module}")
    assert r.status == "error"
    assert r.error is not None and r.error.type == "ImportError"
    assert repr(module) in r.error.message and "'basic'" in r.error.message
    # The library's own terms (the CLI's and MCP's: tests/issues/test_18_defaults.py).
    assert f"allowed_imports=[{module!r}]" in r.error.message
    assert "profile='standard'" in r.error.message
    assert [e.kind for e in r.events] == ["import_blocked"]


def test_imports_hidden_in_exec_or_functions_are_refused_too(basic: Sandbox) -> None:
    assert basic.run("exec('import os')").status == "error"
    assert basic.run("def f():\n    from os import path\nf()").status == "error"
    assert basic.run("__import__('socket')").status == "error"


def test_allowed_modules_keep_their_own_internal_imports(basic: Sandbox) -> None:
    # asyncio, json, zoneinfo and uuid import os, socket, sys, ... internally.
    code = (
        "import asyncio, zoneinfo, uuid\n"
        "async def main():\n    await asyncio.sleep(0)\n    return str(zoneinfo.ZoneInfo('UTC'))\n"
        "await main()"
    )
    r = basic.run(code)
    assert (r.status, r.return_value) == ("ok", "UTC"), r.error


def test_allowed_imports_extend_and_can_replace_the_profile() -> None:
    r = Sandbox(profile="basic", allowed_imports=["os"]).run("import os, json\nos.getcwd()")
    assert (r.status, r.return_value) == ("ok", "/workspace")
    only = Sandbox(allowed_imports=["json"], options=Options(replace_imports=True))
    assert only.run("import json").status == "ok"
    assert only.run("import math").status == "error"


def test_profiles_combine() -> None:
    r = Sandbox(profile="filesystem,basic").run("import pathlib, shutil, statistics\n1")
    assert r.status == "ok", r.error


def test_unknown_profiles_and_bad_module_names_are_refused_before_anything_runs() -> None:
    with pytest.raises(ConfigError) as info:
        Sandbox(profile="everything")
    assert "basic" in info.value.hint
    with pytest.raises(ConfigError):
        Sandbox(allowed_imports=["os; rm -rf /"])


def test_the_policy_is_not_the_boundary_the_os_still_holds() -> None:
    """With the policy defeated (off), the OS layers still refuse: see tests/containment."""
    r = Sandbox(options=Options(import_policy=False)).run(
        "import socket\ntry:\n    socket.socket()\n    outcome = 'created'\n"
        "except PermissionError:\n    outcome = 'refused'\noutcome"
    )
    assert r.return_value == "refused"


@pytest.mark.parametrize(
    ("dotted", "allowed"),
    [("xml.etree.ElementTree", True), ("xml", True), ("xml.dom", False), ("os.path", False)],
)
def test_dotted_prefixes_allow_submodules_and_parents_only(dotted: str, allowed: bool) -> None:
    assert module_allowed(dotted, BUILTIN_PROFILES["basic"]) is allowed
    assert resolve(["basic"]).allows(dotted) is allowed


def test_info_lists_the_profiles_and_says_what_is_not_importable() -> None:
    report = Sandbox().info()
    assert report.import_policy == "standard"
    by_name = {p.name: p for p in report.profiles}
    assert set(by_name) == {"standard", "basic", "data_science", "filesystem", "network"}
    assert by_name["standard"].default and not by_name["basic"].default
    assert "json" in by_name["basic"].modules
    assert by_name["data_science"].packages_importable["numpy"] is True  # the data extra
    assert by_name["standard"].packages_importable["pandas"] is True
    assert Sandbox(options=Options(import_policy=False)).info().import_policy is None


def test_strict_runs_refuse_before_running_with_status_blocked() -> None:
    sandbox = Sandbox()
    r = sandbox.run("import base64\nexec(base64.b64decode('cHJpbnQoMSk='))", strict=True)
    assert r.status == "blocked" and r.stdout == ""
    assert r.error is not None and "CC107" in r.error.traceback
    assert {e.kind for e in r.events} == {"validation_finding"}
    assert Sandbox(profile="basic").run("import os", strict=True).status == "blocked"
    assert sandbox.run("import os", strict=True).status == "ok"  # the default allows it
    clean = sandbox.run("import statistics\nstatistics.median([3, 1, 2])", strict=True)
    assert (clean.status, clean.return_value) == ("ok", 2)


@pytest.mark.slow
def test_data_science_runs_pandas_numpy_scipy_and_matplotlib_with_internal_imports() -> None:
    code = (
        "import numpy as np, pandas as pd, scipy.stats\n"
        "import matplotlib.pyplot as plt\n"
        "df = pd.DataFrame({'x': np.arange(10), 'y': np.arange(10) ** 2})\n"
        "fig, ax = plt.subplots(); ax.plot(df.x, df.y); fig.savefig('plot.png')\n"
        "float(df.y.mean())"
    )
    sandbox = Sandbox(profile="data_science")
    r = sandbox.run(code, limits={"timeout": 60})
    assert (r.status, r.return_value) == ("ok", 28.5), (r.error, r.stderr[-2000:])
    assert [(f.path, f.mime) for f in r.files] == [("plot.png", "image/png")]
    blocked = sandbox.run("import numpy\nimport os")  # pandas may import os; the code may not
    assert blocked.status == "error" and [e.kind for e in blocked.events] == ["import_blocked"]


def test_third_party_packages_are_mounted_only_for_profiles_that_allow_them() -> None:
    probe = "import os\nos.path.exists('/opt/site-packages')"
    assert Sandbox(profile="basic", allowed_imports=["os"]).run(probe).return_value is False
    assert Sandbox(profile="data_science", allowed_imports=["os"]).run(probe).return_value


def test_the_network_profile_says_clearly_that_there_is_no_network() -> None:
    r = Sandbox(profile="network").run("import socket\n1")
    assert r.status == "ok"
    assert any(e.kind == "network_denied" and "no network" in e.detail for e in r.events)


def test_a_sandbox_validates_against_its_own_profile() -> None:
    assert Sandbox(profile="filesystem").validate("import pathlib").valid
    report = Sandbox(profile="basic").validate("import pathlib")
    assert not report.valid and report.findings[0].rule_id == "CC002"
    assert Sandbox().validate("import pathlib, os, sys, subprocess, pandas").valid


def test_a_refused_import_shows_only_the_users_frame_in_the_traceback(basic: Sandbox) -> None:
    r = basic.run("x = 1\nimport socket", filename="job.py")
    assert r.error is not None
    assert 'File "job.py", line 2' in r.error.traceback
    assert "bootstrap" not in r.error.traceback
