"""gpushare.trust: the rule for files root loads, runs or hands to another user's process.

Real files with real ownership, made in a root-only directory (bench/support/trusted.py) and then
given to an unprivileged uid, a 0777 directory or a sticky one, as an attacker would find them.
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from gpushare import native, trust
from gpushare.metrics import Exporter
from gpushare.trust import TrustCheck

NOBODY = 65534  # an unprivileged uid: ownership alone matters, no account is needed


def _file(directory: Path, name: str = "lib.so", mode: int = 0o755) -> Path:
    directory.mkdir(parents=True, exist_ok=True, mode=0o755)
    path = directory / name
    path.write_bytes(b"\x7fELF")
    path.chmod(mode)
    return path


def test_a_root_only_chain_is_trusted(trusted_tmp: Path) -> None:
    path = _file(trusted_tmp / "lib")
    assert TrustCheck().refusal(path, what="the file") is None


@pytest.mark.parametrize(
    ("spoil", "culprit", "says"),
    [
        # The file itself belongs to a user: they rewrite it at will.
        (lambda f: os.chown(f, NOBODY, NOBODY), "file", f"is owned by uid {NOBODY}, not root"),
        # Root's file, but its group may write it.
        (lambda f: f.chmod(0o775), "file", "is writable by group or others (mode 0775)"),
        # Root's file in a directory anyone may write: it can be renamed away and replaced.
        (lambda f: f.parent.chmod(0o777), "dir", "is writable by group or others (mode 0777)"),
        # A directory above that belongs to a user: they can swap the whole subtree.
        (lambda f: os.chown(f.parent, NOBODY, NOBODY), "dir", f"is owned by uid {NOBODY}"),
        # Sticky like /tmp: still refused (the name can be taken before root makes it).
        (lambda f: f.parent.chmod(0o1777), "dir", "is a shared sticky directory (mode 1777)"),
    ],
)
def test_each_way_another_user_could_change_the_file_is_refused(
    trusted_tmp: Path, spoil, culprit: str, says: str
) -> None:
    path = _file(trusted_tmp / "lib")
    check = TrustCheck()
    assert check.refusal(path, what="the file") is None
    spoil(path)
    why = check.refusal(path, what="the file")
    named = path if culprit == "file" else path.parent
    assert why is not None
    assert why.startswith(f"the file {path} is not trusted: {named} {says}")
    if "sticky" in says:
        assert "move it out of" in why
    else:
        assert why.endswith(f"(fix: chown root:root {named} && chmod go-w {named})")
    assert check.refusals() == {"the file": 1}


def test_a_link_to_a_file_another_user_controls_is_refused(trusted_tmp: Path) -> None:
    # The link sits in a root-only directory; its target does not.
    target = _file(trusted_tmp / "user")
    os.chown(target.parent, NOBODY, NOBODY)
    link = trusted_tmp / "lib" / "lib.so"
    link.parent.mkdir(mode=0o755)
    link.symlink_to(target)
    why = trust.TrustCheck().refusal(link, what="the file")
    assert why is not None and f"{target.parent} is owned by uid {NOBODY}" in why


def test_a_swap_after_a_good_check_is_seen_by_the_next(trusted_tmp: Path) -> None:
    # Cached by each component's identity: a new inode, or a chmod (ctime only), is a new state.
    path = _file(trusted_tmp / "lib")
    check = TrustCheck()
    assert check.refusal(path, what="the file") is None
    assert check.refusal(path, what="the file") is None
    spare = _file(trusted_tmp / "lib", "incoming")
    os.chown(spare, NOBODY, NOBODY)
    os.replace(spare, path)
    assert check.refusal(path, what="the file") is not None
    os.chown(path, 0, 0)
    assert check.refusal(path, what="the file") is None
    path.chmod(0o757)
    assert check.refusal(path, what="the file") is not None
    assert check.refusals() == {"the file": 2}


def test_a_missing_file_is_refused_with_the_reason(trusted_tmp: Path) -> None:
    why = TrustCheck().refusal(trusted_tmp / "absent.so", what="the file")
    assert why == f"the file {trusted_tmp / 'absent.so'}: No such file or directory"


def test_the_in_flight_library_must_be_trusted_too(trusted_tmp: Path) -> None:
    # Readable by all, as before, and now also root's all the way up.
    lib = _file(trusted_tmp / "pkg", native.LIBRARY_NAME, 0o644)
    assert native.unusable_reason(lib) is None
    os.chown(lib, NOBODY, NOBODY)
    why = native.unusable_reason(lib) or ""
    assert why.startswith(f"the in-flight library {lib} is not trusted: {lib} is owned by uid")
    assert f"chown root:root {lib} && chmod go-w {lib}" in why


def test_refusals_are_exported_as_a_counter(tmp_path: Path) -> None:
    before = trust.refusals().get("the MPS server binary", 0)
    assert trust.refusal(tmp_path, what="the MPS server binary") is not None  # under /tmp
    text = generate_latest(Exporter().registry).decode()
    line = f'gpushare_untrusted_file_refusals_total{{file="the MPS server binary"}} {before + 1}.0'
    assert line in text.splitlines()


def test_a_tree_is_trusted_only_when_every_file_in_it_is_roots(trusted_tmp: Path) -> None:
    # What doctor asks of gpushare's own package: a user's .pyc in __pycache__ would run as root.
    pkg = trusted_tmp / "gpushare"
    module = _file(pkg / "__pycache__", "core.cpython-311.pyc", 0o644)
    assert trust.tree_refusal(pkg, what="the gpushare package") is None
    os.chown(module, NOBODY, NOBODY)
    why = trust.tree_refusal(pkg, what="the gpushare package") or ""
    assert why.startswith(
        f"the gpushare package {pkg} is not trusted: {module} is owned by uid {NOBODY}, not root"
    )
    assert why.endswith(f"(fix: chown root:root {module} && chmod go-w {module})")
