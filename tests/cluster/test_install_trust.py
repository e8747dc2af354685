"""``gpushare install`` makes what the daemon runs or hands out root's and not writable by others.

Run under a umask of 0 (an operator's shell may have any umask): the in-flight library, the config
and the directories must still come out as gpushare.trust requires, and the daemon must then
trust the library it built.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from gpushare import install, native, trust
from gpushare.native import build as native_build


@pytest.mark.skipif(
    shutil.which("groupadd") is None or os.geteuid() != 0,
    reason="groupadd --prefix needs the shadow utilities and root",
)
@pytest.mark.skipif(native_build.compiler() is None, reason="no C compiler (apt-get install gcc)")
def test_install_under_umask_0_leaves_nothing_writable_by_others(
    trusted_tmp: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    lib = trusted_tmp / "site" / native.LIBRARY_NAME
    lib.parent.mkdir(mode=0o755)
    monkeypatch.setattr(native, "library_path", lambda configured=None: configured or lib)
    root = trusted_tmp / "root"
    root.mkdir(mode=0o755)
    old = os.umask(0)
    try:
        report = install.install(install.Options(root=root, systemd=False))
    finally:
        os.umask(old)
    assert report.ok, report
    for path in (lib, root / "etc/gpushare/gpushare.toml", root / "etc/gpushare"):
        st = path.stat()
        assert (st.st_uid, st.st_mode & 0o022) == (0, 0), f"{path}: mode {st.st_mode:o}"
    assert trust.TrustCheck().refusal(lib, what="the in-flight library") is None
    assert native.unusable_reason(lib) is None
