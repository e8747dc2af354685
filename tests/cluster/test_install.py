"""``gpushare install`` / ``uninstall`` against a temporary root, with the real groupadd/systemctl."""

import ctypes
import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpushare import install, native, shipped
from gpushare.cli.app import app
from gpushare.native import build as native_build

runner = CliRunner()
needs_systemctl = pytest.mark.skipif(
    shutil.which("systemctl") is None, reason="systemctl is not installed (apt-get install systemd)"
)
needs_groupadd = pytest.mark.skipif(
    shutil.which("groupadd") is None or os.geteuid() != 0,
    reason="groupadd --prefix needs the shadow utilities and root",
)


@pytest.fixture(autouse=True)
def library(tmp_path_factory: pytest.TempPathFactory, monkeypatch: pytest.MonkeyPatch) -> Path:
    """Where install builds the in-flight bound: a directory of the test's, not the package's."""
    lib = tmp_path_factory.mktemp("site") / native.LIBRARY_NAME
    monkeypatch.setattr(native, "library_path", lambda configured=None: configured or lib)
    return lib


def _snapshot(root: Path) -> dict[str, tuple[int, int, str]]:
    out = {}
    for p in sorted(root.rglob("*")):
        st = p.lstat()
        target = os.readlink(p) if p.is_symlink() else ""
        out[str(p.relative_to(root))] = (st.st_mode, st.st_mtime_ns, target)
    return out


def _cli(*args: str) -> tuple[int, str, str]:
    result = runner.invoke(app, list(args))
    return result.exit_code, result.stdout, result.stderr


def _steps(out: str) -> dict[str, tuple[str, str]]:
    data = json.loads(out)
    return {s["what"]: (s["result"], s["detail"]) for s in data["steps"]}


@needs_groupadd
@needs_systemctl
def test_install_writes_everything_once_and_a_second_run_changes_nothing(
    tmp_path: Path, library: Path
):
    code, out, err = _cli("install", "--root", str(tmp_path), "--json")
    assert code == 0, err
    steps = _steps(out)
    built = steps.pop(str(library))
    assert {r for r, _d in steps.values()} == {"created", "updated"}
    if native_build.compiler() is not None:
        assert built == ("created", "the in-flight bound for shallow offline queues")
        ctypes.CDLL(str(library))  # a shared object the loader takes
    else:
        assert built[0] == "skipped"
    cfg = tmp_path / "etc/gpushare/gpushare.toml"
    assert cfg.read_text() == shipped.text(shipped.CONFIG)
    assert cfg.stat().st_mode & 0o777 == 0o644
    unit = tmp_path / "etc/systemd/system/gpushare.service"
    assert unit.read_text() == shipped.text(shipped.UNIT)
    # Closed to listing: the registry and the client logs (issue 27).
    assert (tmp_path / "var/lib/gpushare").stat().st_mode & 0o777 == 0o711
    link = tmp_path / "usr/bin/gpushare"
    assert link.is_symlink() and Path(os.readlink(link)) == install.console_script()
    assert any(
        line.startswith("gpushare:") for line in (tmp_path / "etc/group").read_text().splitlines()
    )
    wants = tmp_path / "etc/systemd/system/multi-user.target.wants/gpushare.service"
    assert os.readlink(wants) == "/etc/systemd/system/gpushare.service"
    for name, dest, _what in install.HOST_FILES:
        assert (tmp_path / dest.relative_to("/")).read_text() == shipped.text(name)

    before = _snapshot(tmp_path)
    code, out, err = _cli("install", "--root", str(tmp_path), "--json")
    assert code == 0, err
    assert {r for r, _d in _steps(out).values()} <= {"unchanged", "skipped"}
    assert _steps(out)[str(library)][0] == ("unchanged" if library.exists() else "skipped")
    assert _snapshot(tmp_path) == before


@needs_groupadd
def test_the_in_flight_bound_is_built_only_where_used_and_a_missing_compiler_is_no_failure(
    tmp_path: Path, library: Path, monkeypatch: pytest.MonkeyPatch
):
    cfg = tmp_path / "etc/gpushare/gpushare.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text('[gate]\nshallow_queue = "blocking"\n')
    code, out, err = _cli("install", "--root", str(tmp_path), "--no-systemd", "--json")
    assert code == 0, err
    assert _steps(out)[str(library)] == (
        "skipped",
        '[gate] shallow_queue = "blocking" does not use it',
    )
    assert not library.exists()
    cfg.write_text('[gate]\nshallow_queue = "bounded"\n')
    monkeypatch.setenv("CC", "no-such-cc")
    code, out, err = _cli("install", "--root", str(tmp_path), "--no-systemd", "--json")
    assert code == 0, err
    result, detail = _steps(out)[str(library)]
    assert result == "skipped"
    assert "no C compiler (no-such-cc)" in detail
    assert "CUDA_LAUNCH_BLOCKING=1" in detail
    assert not library.exists()


@needs_groupadd
def test_a_configured_library_path_is_built_there_under_the_root(tmp_path: Path, library: Path):
    # A package in a 0700 home: the operator names a library every user's job can load.
    cfg = tmp_path / "etc/gpushare/gpushare.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text('[paths]\ninflight_library = "/usr/local/lib/gpushare/libinflight.so"\n')
    code, out, err = _cli("install", "--root", str(tmp_path), "--no-systemd", "--json")
    assert code == 0, err
    built = tmp_path / "usr/local/lib/gpushare/libinflight.so"
    result, _detail = _steps(out)[str(built)]
    assert not library.exists()
    if native_build.compiler() is None:
        assert result == "skipped"
        return
    assert result == "created"
    ctypes.CDLL(str(built))
    for path in (built, built.parent):
        st = path.stat()
        assert (st.st_uid, st.st_mode & 0o022) == (0, 0), f"{path} must be root's, not writable"


@needs_groupadd
def test_an_edited_config_is_kept_byte_for_byte_and_said_so(tmp_path: Path):
    cfg = tmp_path / "etc/gpushare/gpushare.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text('[daemon]\nadmin_group = "gpuadmins"\n')
    code, out, err = _cli("install", "--root", str(tmp_path), "--no-systemd", "--json")
    assert code == 0, err
    steps = _steps(out)
    assert steps["/etc/gpushare/gpushare.toml"] == ("kept", "edited: not overwritten; it is valid")
    assert cfg.read_text() == '[daemon]\nadmin_group = "gpuadmins"\n'
    # The group is the one the kept config names.
    assert steps["group gpuadmins"][0] == "created"


@needs_groupadd
def test_an_invalid_config_stops_before_systemd_and_is_left_alone(tmp_path: Path):
    cfg = tmp_path / "etc/gpushare/gpushare.toml"
    cfg.parent.mkdir(parents=True)
    cfg.write_text("[control]\nperiod = -1\n")
    code, out, err = _cli("install", "--root", str(tmp_path))
    assert code == 1
    assert "failed        /etc/gpushare/gpushare.toml  (kept, but invalid:" in out
    assert "control.period" in out
    assert "skipped       systemd  (the config is invalid: fix it, then run again)" in out
    assert "a step failed" in err
    assert cfg.read_text() == "[control]\nperiod = -1\n"
    assert not (tmp_path / "etc/systemd/system/multi-user.target.wants").exists()


@needs_systemctl
def test_dry_run_changes_nothing_and_says_what_it_would_do(tmp_path: Path):
    (tmp_path / "etc").mkdir()
    before = _snapshot(tmp_path)
    code, out, err = _cli("install", "--root", str(tmp_path), "--dry-run")
    assert code == 0, err
    assert "would create  /etc/gpushare/gpushare.toml" in out
    assert "would create  group gpushare" in out
    assert _snapshot(tmp_path) == before


@needs_groupadd
@needs_systemctl
def test_uninstall_reverses_install_but_keeps_state_and_an_edited_config(tmp_path: Path):
    assert _cli("install", "--root", str(tmp_path))[0] == 0
    (tmp_path / "var/lib/gpushare/gpushare.db").write_text("registry")
    cfg = tmp_path / "etc/gpushare/gpushare.toml"
    cfg.write_text(cfg.read_text() + "# tuned here\n")
    code, out, err = _cli("uninstall", "--root", str(tmp_path), "--json")
    assert code == 0, err
    steps = _steps(out)
    assert steps["/etc/gpushare/gpushare.toml"] == ("kept", "edited; --purge removes it")
    assert steps["/var/lib/gpushare"][0] == "kept"
    assert steps["group gpushare"] == ("removed", "")
    assert not (tmp_path / "etc/systemd/system/gpushare.service").exists()
    assert not (tmp_path / "etc/systemd/system/multi-user.target.wants/gpushare.service").exists()
    assert not (tmp_path / "usr/bin/gpushare").is_symlink()
    assert (tmp_path / "var/lib/gpushare/gpushare.db").read_text() == "registry"
    assert cfg.exists()
    assert "gpushare:" not in (tmp_path / "etc/group").read_text()

    code, out, err = _cli("uninstall", "--root", str(tmp_path), "--purge", "--no-systemd")
    assert code == 0, err
    assert not cfg.exists() and not cfg.parent.exists()
    assert not (tmp_path / "var/lib/gpushare").exists()


@needs_groupadd
def test_uninstall_keeps_a_group_with_members_unless_purged(tmp_path: Path):
    assert _cli("install", "--root", str(tmp_path), "--no-systemd")[0] == 0
    group = tmp_path / "etc/group"
    group.write_text(
        "\n".join(
            line + "alice,bob" if line.startswith("gpushare:") else line
            for line in group.read_text().splitlines()
        )
        + "\n"
    )
    code, out, _err = _cli("uninstall", "--root", str(tmp_path), "--no-systemd")
    assert code == 0
    assert "kept          group gpushare  (members: alice, bob; --purge removes it anyway)" in out
    assert "gpushare:" in group.read_text()


@needs_groupadd
def test_a_failing_groupadd_is_a_failed_step_with_its_message(tmp_path: Path):
    (tmp_path / "etc/group").mkdir(parents=True)  # groupadd cannot rewrite a directory
    code, out, _err = _cli("install", "--root", str(tmp_path), "--no-systemd", "--json")
    assert code == 1
    result, detail = _steps(out)["group gpushare"]
    assert result == "failed"
    assert detail.startswith("groupadd: ")


def test_without_systemd_the_host_install_refuses_and_names_the_fix(monkeypatch, tmp_path: Path):
    monkeypatch.setattr(install, "SYSTEMD_RUNNING", tmp_path / "no-systemd")
    monkeypatch.setattr(os, "geteuid", lambda: 0)
    with pytest.raises(install.InstallError, match="use --no-systemd to install the files only"):
        install.install(install.Options(root=Path("/")), run=_no_commands)


def test_not_root_refuses_and_names_sudo(monkeypatch):
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    code, out, err = _cli("install")
    assert code == 1
    assert out == ""
    assert "must run as root: sudo gpushare install" in err


def test_a_missing_root_directory_is_refused(tmp_path: Path):
    code, out, _err = _cli("uninstall", "--root", str(tmp_path / "nope"), "--json")
    assert code == 1
    data = json.loads(out)
    assert data["ok"] is False
    assert "is not a directory" in data["error"]


def _no_commands(argv):
    raise AssertionError(f"no command may run: {argv}")


def test_dry_run_works_on_a_host_without_systemd_and_says_what_a_real_run_needs(monkeypatch):
    # Issue 28.6: `gpushare install --dry-run` without --no-systemd on a host without systemd
    # (this test machine has no /run/systemd/system either) shows the plan instead of refusing.
    monkeypatch.setattr(install, "SYSTEMD_RUNNING", Path("/nonexistent/systemd/system"))
    monkeypatch.setattr(os, "geteuid", lambda: 1000)
    code, out, err = _cli("install", "--dry-run", "--json")
    assert code == 0, err
    steps = _steps(out)
    assert steps["root"][0] == "skipped"
    assert "must run as root: sudo gpushare install" in steps["root"][1]
    assert steps["systemd"][0] == "skipped"
    assert "use --no-systemd to install the files only" in steps["systemd"][1]
    assert steps["/etc/systemd/system/gpushare.service"][0] in ("created", "updated", "unchanged")
    # A real run still refuses, with the same fix.
    code, out, err = _cli("install")
    assert code == 1
    assert "must run as root" in err


@needs_groupadd
def test_sysusers_and_tmpfiles_create_the_group_and_the_directories(tmp_path: Path):
    if shutil.which("systemd-sysusers") is None or shutil.which("systemd-tmpfiles") is None:
        pytest.skip("systemd-sysusers/systemd-tmpfiles are not installed (apt-get install systemd)")
    (tmp_path / "etc").mkdir()
    (tmp_path / "etc/group").write_text("root:x:0:\n")
    (tmp_path / "etc/passwd").write_text("root:x:0:0:root:/root:/bin/sh\n")
    sysusers = tmp_path / "sysusers.conf"
    sysusers.write_text(shipped.text(shipped.SYSUSERS))
    done = subprocess.run(["systemd-sysusers", f"--root={tmp_path}", str(sysusers)],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert any(
        line.startswith("gpushare:") for line in (tmp_path / "etc/group").read_text().splitlines()
    )
    tmpfiles = tmp_path / "tmpfiles.conf"
    tmpfiles.write_text(shipped.text(shipped.TMPFILES))
    (tmp_path / "var/lib").mkdir(parents=True)
    (tmp_path / "var/lib/gpushare").mkdir(mode=0o755)  # an old install's
    done = subprocess.run(["systemd-tmpfiles", "--create", f"--root={tmp_path}", str(tmpfiles)],
                          capture_output=True, text=True, timeout=60, check=False)  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert (tmp_path / "var/lib/gpushare").stat().st_mode & 0o777 == 0o711
    assert (tmp_path / "run/gpushare").stat().st_mode & 0o777 == 0o755


@needs_groupadd
def test_install_tightens_a_state_directory_others_could_read(tmp_path: Path):
    state = tmp_path / "var/lib/gpushare"
    state.mkdir(parents=True)
    state.chmod(0o755)
    code, out, err = _cli("install", "--root", str(tmp_path), "--no-systemd", "--json")
    assert code == 0, err
    assert _steps(out)["/var/lib/gpushare"] == ("updated", "mode 0755 -> 0711")
    assert state.stat().st_mode & 0o777 == 0o711


@needs_groupadd
def test_uninstall_removes_the_host_files_and_man_pages(tmp_path: Path):
    assert _cli("install", "--root", str(tmp_path), "--no-systemd")[0] == 0
    assert (tmp_path / "usr/local/share/man/man8/gpushare.8").is_file()
    code, _out, err = _cli("uninstall", "--root", str(tmp_path), "--no-systemd")
    assert code == 0, err
    for _name, dest, _what in install.HOST_FILES:
        assert not (tmp_path / dest.relative_to("/")).exists()
