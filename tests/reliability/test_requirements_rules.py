"""Requirements of the host-side rules, stated on their own (issue 25): the import rule,
e-mail detection and tool allow-list patterns. Pure and fast: mutation testing
(scripts/mutate) judges the rule modules by these, without starting a sandbox (the guest
cannot import a mutated module). Values come from the docs and the standards named beside
them, never from the module under test.
"""

from __future__ import annotations

import sys

import pytest
from tests.reliability._requirements import EMAIL_MAX_LOCAL_PART, EMAIL_MAX_TLD, address

from codecage.bridge.tooling import ToolPattern, allow_patterns, name_matches
from codecage.errors import ConfigError
from codecage.guest.imports import allowed, is_module, refused, requested
from codecage.output import CappedBuffer
from codecage.policy.profiles import describe, packages_to_bind, resolve
from codecage.policy.scrub import Scrubber

# --- the import rule: policy/profiles.py's docstring, docs/configuration.md ----------------
# "xml.etree allows xml.etree.ElementTree and the parent package xml as a stepping stone,
# not xml.dom (nor `from xml import dom`)". Break caught: any submodule of an allowed
# package let through.

# (module, allowed by `basic`): basic names xml.etree, urllib.parse and json, not xml or urllib.
BASIC_IMPORTS = [
    ("xml.etree.ElementTree", True),
    ("xml", True),  # the stepping stone
    ("urllib.parse", True),
    ("json.decoder", True),  # under an allowed entry
    ("xml.dom", False),
    ("xml.dom.minidom", False),
    ("xml.sax", False),
    ("urllib.request", False),
    ("urllib.error", False),
    ("email", False),
]


@pytest.mark.parametrize(("module", "allowed"), BASIC_IMPORTS)
def test_the_basic_profile_allows_exactly_the_named_submodules(module: str, allowed: bool) -> None:
    assert resolve(["basic"]).allows(module) is allowed


# `from a import b` asks for the submodule a.b when b is one; for a (b is an attribute)
# when it is not (`from os import getcwd` is allowed wherever `import os` is).
FROM_IMPORTS = [
    ("xml", ["etree"], None),
    ("xml", ["dom"], "xml.dom"),
    ("xml", ["etree", "dom"], "xml.dom"),
    ("urllib", ["parse"], None),
    ("urllib", ["request"], "urllib.request"),
    ("json", ["loads"], None),  # an attribute of an allowed module
    ("email", ["message"], "email"),  # a package the profile does not name at all
]


@pytest.mark.parametrize(("name", "fromlist", "first_refused"), FROM_IMPORTS)
def test_from_imports_of_the_basic_profile_refuse_the_unnamed_submodules(
    name: str, fromlist: list[str], first_refused: str | None
) -> None:
    modules = resolve(["basic"]).modules
    assert refused(name, fromlist, 0, modules) == first_refused


def test_relative_imports_inside_a_package_ask_for_nothing() -> None:
    assert requested("x", ["y"], level=1) == []
    assert refused("x", ["y"], 1, frozenset()) is None


def test_a_from_import_of_a_submodule_not_yet_imported_is_refused_as_one() -> None:
    # `from wsgiref import simple_server` binds a submodule the host has not imported: it is
    # found on disk, without running it, and refused; an attribute that is no module asks
    # for the package only (a stepping stone of wsgiref.util).
    if "wsgiref.simple_server" in sys.modules:
        pytest.skip("wsgiref.simple_server is already imported in this process")
    modules = {"wsgiref.util"}
    assert refused("wsgiref", ["simple_server"], 0, modules) == "wsgiref.simple_server"
    assert refused("wsgiref", ["util", "no_such_name"], 0, modules) is None
    assert is_module("wsgiref.simple_server")
    assert not is_module("wsgiref.no_such_module")
    assert not is_module("json.decoder.no_such")  # json.decoder is a plain module
    assert not is_module("no_such_package_at_all")
    assert "wsgiref.simple_server" not in sys.modules  # found, not run


@pytest.mark.parametrize(
    ("dotted", "entries", "expected"),
    [
        ("a.b", ["a.b"], True),
        ("a.b.c", ["a.b"], True),
        ("a", ["a.b"], True),  # the stepping stone
        ("a.c", ["a.b"], False),
        ("a.bc", ["a.b"], False),  # a prefix of a name is no parent
        ("ab", ["a"], False),
        ("anything.at.all", ["*"], True),
        ("a", [], False),
    ],
)
def test_a_module_set_names_modules_by_dotted_prefix(
    dotted: str, entries: list[str], expected: bool
) -> None:
    assert allowed(dotted, entries) is expected


def test_allowed_imports_extend_a_profile_and_replace_only_when_asked() -> None:
    extended = resolve(["basic"], allowed_imports=["xml.dom"])
    assert extended.allows("xml.dom.minidom") and extended.allows("json")
    replaced = resolve(["basic"], allowed_imports=["xml.dom"], replace=True)
    assert replaced.allows("xml.dom") and not replaced.allows("json")
    assert not resolve(["basic"]).allows_every_module
    assert resolve([]).allows_every_module  # no profile named: `standard`, nothing refused


# --- e-mail addresses: RFC 5321 and the root zone ----------------------------------------
# RFC 5321 4.5.3.1.1: a local part is at most 64 octets; the longest TLD in the root zone is
# 24 characters (XN--VERMGENSBERATUNG-PWB). Every address within both bounds is redacted
# whole. Breaks caught: the TLD bound 24 -> 6, the local-part bound 64 -> 24 (the
# generators of tests/test_scrub.py stop at 22 and 6).

SCRUB = Scrubber()


@pytest.mark.parametrize("local_length", [1, 24, 25, 40, 63, EMAIL_MAX_LOCAL_PART])
@pytest.mark.parametrize("tld_length", [2, 6, 7, 13, 23, EMAIL_MAX_TLD])
def test_an_address_within_the_standard_bounds_is_redacted_whole(
    local_length: int, tld_length: int
) -> None:
    mail = address(local_length, tld_length)
    assert SCRUB.scrub(f"write to {mail}, thanks").text == "write to [EMAIL], thanks"


def test_a_local_part_over_64_keeps_only_what_lies_beyond_64_characters_before_the_at() -> None:
    # Not an address by RFC 5321, but what could be one (the last 64 characters and the
    # domain) is redacted all the same: only the characters past the bound remain.
    mail = address(EMAIL_MAX_LOCAL_PART + 6, 3)
    assert SCRUB.scrub(f"to {mail} now").text == f"to {mail[:6]}[EMAIL] now"


def test_a_tld_longer_than_any_in_the_root_zone_is_no_address() -> None:
    text = f"see {address(10, EMAIL_MAX_TLD + 1)} here"
    assert SCRUB.scrub(text).text == text


@pytest.mark.parametrize("local_length", [1, 24, 25, 50, EMAIL_MAX_LOCAL_PART])
def test_an_address_cut_by_the_output_cap_after_its_at_is_redacted(local_length: int) -> None:
    # scrub/tail.py: a stream cut at its cap may end inside an address; its local part and
    # the @ are redacted (the domain was cut off).
    cut = address(local_length, 3)[: local_length + 4]
    assert SCRUB.scrub(f"mail {cut}", truncated=True).text == "mail [EMAIL]"


def test_a_cut_address_with_a_local_part_over_64_is_redacted_as_a_whole_one_is() -> None:
    # Found when mutation testing scrub/tail.py: at the cap boundary such a local part was
    # not redacted at all, while the whole-text detector redacts its last 64 characters.
    long_local = address(EMAIL_MAX_LOCAL_PART + 6, 3)
    cut = long_local[: EMAIL_MAX_LOCAL_PART + 6 + 4]
    assert SCRUB.scrub(f"mail {cut}", truncated=True).text == f"mail {long_local[:6]}[EMAIL]"
    assert SCRUB.scrub(f"mail {long_local} ok").text == f"mail {long_local[:6]}[EMAIL] ok"


# --- tool allow-list patterns: docs/configuration.md ("An allow-list pattern ...") --------
# "SERVER.TOOL, split at the first dot ..., each half matched on its own. *, ? and [...]
# match only plain names (letters, digits, _, -, .): memory.read_* allows read_graph, not a
# tool named read_/../admin or one with a newline; such a name is allowed only by a
# pattern that spells it out."

PATTERN_CASES = [
    ("memory.read_*", "memory", "read_graph", True),
    ("memory.read_*", "memory", "read_/../admin", False),
    ("memory.read_*", "memory", "read_x\nadmin", False),
    ("memory.read_*", "memory", "read x", False),
    ("memory.read_*", "memory", "write_graph", False),
    ("memory.read_*", "memorys", "read_graph", False),
    ("memory.*", "memory", "a-b.c_9", True),
    ("memory.read_/../admin", "memory", "read_/../admin", True),  # spelled out
    ("*.read_graph", "memory", "read_graph", True),
    ("*.read_graph", "mem/ory", "read_graph", False),
    ("memory.read_?raph", "memory", "read_graph", True),
    ("memory.read_[gh]raph", "memory", "read_hraph", True),
    ("memory.read_[gh]raph", "memory", "read_kraph", False),
    ("memory.READ_GRAPH", "memory", "read_graph", False),  # case matters
    ("memory.tools.x", "memory", "tools.x", True),  # split at the first dot
]


@pytest.mark.parametrize(("pattern", "server", "tool", "expected"), PATTERN_CASES)
def test_an_allow_list_pattern_matches_as_documented(
    pattern: str, server: str, tool: str, expected: bool
) -> None:
    assert ToolPattern.parse(pattern).matches(server, tool) is expected


@pytest.mark.parametrize("pattern", ["memory", ".read", "memory.", ""])
def test_a_pattern_that_does_not_name_a_server_and_a_tool_is_refused(pattern: str) -> None:
    with pytest.raises(ConfigError, match="does not name a server and a tool"):
        ToolPattern.parse(pattern)


def test_no_allow_list_stays_none_and_an_empty_one_allows_nothing() -> None:
    assert allow_patterns(None) is None
    assert allow_patterns([]) == ()
    parsed = allow_patterns(["a.b", "c.*"])
    assert parsed is not None and [str(p) for p in parsed] == ["a.b", "c.*"]


def test_a_name_without_wildcards_matches_only_itself() -> None:
    assert name_matches("read", "read")
    assert not name_matches("read2", "read")
    assert not name_matches("rea", "read")


# --- the output cap's marker: docs/configuration.md, `max_output_bytes` -------------------
# "keeps this many bytes per stream: the first half and the last half (...), each cut at a
# line break, with a line `[... N lines / M MB cut here ...]` between saying how much was
# cut". Sizes are decimal (docs/cli.md: 12.3 KB). Whatever the chunks the pipe delivered,
# the head, the tail and the marker account for every line and byte written.

LINES = 5000
CAP = 8192


def numbered_output() -> bytes:
    return b"".join(f"line {i:05d} ".encode().ljust(99, b".") + b"\n" for i in range(LINES))


@pytest.mark.parametrize("chunk", [1, 7, 100, 333, 4096, 65536, LINES * 100])
def test_the_cut_marker_counts_every_line_and_byte_the_cap_left_out(chunk: int) -> None:
    data = numbered_output()
    buf = CappedBuffer(CAP, tail_bytes=CAP // 2)
    for at in range(0, len(data), chunk):
        buf.append(data[at : at + chunk])
    kept = buf.data
    assert len(kept) <= CAP and buf.truncated and buf.total_bytes == len(data)
    head, found, rest = kept.decode().partition("[... ")
    assert found, kept[-300:]
    marker, _, tail = rest.partition("\n")
    first, last = head.splitlines(), tail.splitlines()
    # The head's lines from the first on, the tail's up to the last, none in part.
    assert [int(line[5:10]) for line in first] == list(range(len(first)))
    assert [int(line[5:10]) for line in last] == list(range(LINES - len(last), LINES))
    cut = LINES - len(first) - len(last)
    assert marker.startswith(f"{cut:,} lines / {cut * 100 / 1000:.1f} KB cut here")


# output.py's CappedBuffer docstring, docs/security-model.md (scrubbing, "the tail that could be
# the start of a value ... is redacted too"): a private key cut by the cap never shows its body
# in the tail without the BEGIN line the scrubber recognises it by.


@pytest.mark.parametrize("body_lines", [40, 80, 200])
def test_a_private_key_cut_by_the_cap_shows_no_body_without_its_begin_line(
    body_lines: int,
) -> None:
    body = b"".join(b"KEYBODY%04d" % i + b"A" * 53 + b"\n" for i in range(body_lines))
    pem = b"-----BEGIN PRIVATE KEY-----\n" + body + b"-----END PRIVATE KEY-----\n"
    data = b"x" * 99 + b"\n" + b"filler line\n" * 300 + pem + b"done\n" * 10
    buf = CappedBuffer(4096, tail_bytes=2048)
    for at in range(0, len(data), 512):
        buf.append(data[at : at + 512])
    kept = buf.data
    head, _, tail = kept.partition(b"[... ")
    for part in (head, tail):
        if b"KEYBODY" in part:
            assert part.index(b"-----BEGIN PRIVATE KEY-----") < part.index(b"KEYBODY"), part
    assert tail.endswith(b"done\n")


# --- profiles: docs/configuration.md (profiles), policy/profiles.py ------------------------
# Only third-party packages a profile names (or every data package, for `standard`) are bound
# into its sandbox; operator-defined profiles are listed by `info` as defined in the config.

DOCUMENTED_DATA = {"numpy", "pandas", "scipy", "matplotlib"}


def test_only_the_third_party_packages_a_profile_names_are_bound() -> None:
    for stdlib_only in ("basic", "filesystem"):
        assert packages_to_bind(resolve([stdlib_only])) == frozenset(), stdlib_only
    assert packages_to_bind(resolve(["network"])) == {"httpx", "requests"}
    for profile in ("data_science", "standard"):
        bound = packages_to_bind(resolve([profile]))
        assert bound >= DOCUMENTED_DATA, profile
        assert not bound & (sys.stdlib_module_names | {"codecage", "servers", "skills", "*"})


def test_info_lists_operator_profiles_and_only_the_enabled_ones() -> None:
    custom = {"mine": frozenset({"json"})}
    listed = {p.name: p for p in describe(custom=custom)}
    assert listed["mine"].description == "defined in the config file"
    assert listed["mine"].modules == ["json"]
    assert set(listed) >= {"standard", "basic", "mine"}
    assert [p.name for p in describe(custom=custom, enabled=["basic"])] == ["basic"]
    defaults = {p.name for p in describe(default="basic,network") if p.default}
    assert defaults == {"basic", "network"}
