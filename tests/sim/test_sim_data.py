"""The simulator's shipped data: where names resolve, both file formats, and the derivation script."""

from __future__ import annotations

import csv
import datetime
import gzip
import io
import json
import shutil
import subprocess
import sys
import tarfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from typer.testing import CliRunner

from gpushare.cli.app import app
from gpushare.sim import data, scenario

REPO = Path(__file__).resolve().parents[2]
SHIPPED = REPO / "gpushare" / "data"
PROFILE = "orion-v100-kernels/resnet50_4_fwd.csv"
AZURE = "azure-llm-2023/AzureLLMInferenceTrace_code.csv"
PODS = "alibaba-gpu-v2023/openb_pod_list_default.csv"


@pytest.fixture(autouse=True)
def _fresh_caches(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    monkeypatch.delenv(data.DATA_ENV, raising=False)
    loaders = (data.load_profile, data.load_azure_arrivals, data.load_genai_qps)
    for fn in (*loaders, data.load_alibaba_pods):
        fn.cache_clear()
    yield
    for fn in (*loaders, data.load_alibaba_pods):
        fn.cache_clear()


def test_names_resolve_inside_the_package() -> None:
    assert data.package_root() == SHIPPED
    assert data.resolve(PROFILE) == SHIPPED / PROFILE
    # A name stored compressed resolves to its .gz.
    assert data.resolve(AZURE) == SHIPPED / f"{AZURE}.gz"
    assert len(data.load_azure_arrivals(AZURE)) == 8819


def test_every_shipped_folder_names_its_source_and_licence() -> None:
    folders = [p for p in SHIPPED.iterdir() if p.is_dir()]
    assert folders
    for folder in folders:
        text = (folder / "README.md").read_text()
        assert "**Source:**" in text and "**Licence:**" in text and "**Derived:**" in text


def test_a_missing_name_lists_every_path_tried(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path))
    with pytest.raises(data.DataError) as info:
        data.resolve("orion-v100-kernels/nope.csv")
    msg = str(info.value)
    assert str(tmp_path / "orion-v100-kernels/nope.csv") in msg
    assert str(SHIPPED / "orion-v100-kernels/nope.csv.gz") in msg


def test_user_data_dir_must_exist(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path / "absent"))
    with pytest.raises(data.DataError, match="is not a directory.*unset it"):
        data.resolve(PROFILE)


def test_user_data_dir_comes_first_then_the_package(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    mine = tmp_path / "orion-v100-kernels" / "mine_fwd.csv"
    mine.parent.mkdir()
    mine.write_text("Profile,SM_usage,Duration\n1,80,2000\n0,40,1000\n")
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path))
    prof = data.load_profile("orion-v100-kernels/mine_fwd.csv")
    assert prof.name == "mine_fwd" and prof.total_s == pytest.approx(3e-6)
    assert data.resolve(PROFILE) == SHIPPED / PROFILE  # not in mine: the shipped one


def test_an_unreadable_profile_names_the_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    bad = tmp_path / "orion-v100-kernels" / "bad_fwd.csv.gz"
    bad.parent.mkdir()
    bad.write_bytes(b"not gzip at all")
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path))
    with pytest.raises(data.DataError, match=r"cannot read kernel profile .*bad_fwd\.csv\.gz"):
        data.load_profile("orion-v100-kernels/bad_fwd.csv")


# --- the upstream formats, and the script that derives the shipped files from them ------------


def _rows(path: Path) -> list[dict[str, str]]:
    with data.open_text(path) as fh:
        return list(csv.DictReader(fh))


def _write_csv(path: Path, header: list[str], rows: list[list[str]]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    with path.open("w", newline="") as fh:
        w = csv.writer(fh, lineterminator="\n")
        w.writerow(header)
        w.writerows(rows)


def _fake_originals(root: Path) -> None:
    """Upstream-format files whose derivation must give back exactly the shipped files."""
    for src in sorted((SHIPPED / "orion-v100-kernels").glob("*.csv")):
        rows = [
            [f"kernel_{i}", r["Profile"], "0", r["SM_usage"], r["Duration"]]
            for i, r in enumerate(_rows(src))
        ]
        header = ["Name", "Profile", "Memory_footprint", "SM_usage", "Duration"]
        _write_csv(root / "orion-v100-kernels" / src.name, header, rows)
    for name in (
        "orion-v100-kernels/mps_example_resnet50inf_resnet50train_V100.log.json",
        "igniter-v100/latency_vs_mps_thread_pct.csv",
        "igniter-v100/colocated_latency.csv",
    ):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(SHIPPED / name, root / name)
    stamps = [r["TIMESTAMP"] for r in _rows(SHIPPED / f"{AZURE}.gz")]
    _write_csv(
        root / AZURE,
        ["TIMESTAMP", "ContextTokens", "GeneratedTokens"],
        [[t, "100", "10"] for t in stamps],
    )
    # The conversation trace: timestamps rebuilt from the shipped offsets (100 ns exact).
    conv = _rows(SHIPPED / "azure-llm-2023/conv_tokens.csv.gz")
    base = datetime.datetime(2023, 11, 16, 18, 15, 46)
    stamps_conv = []
    for r in conv:
        whole, _, frac = r["arrival_s"].partition(".")
        at = base + datetime.timedelta(seconds=int(whole))
        stamps_conv.append(f"{at:%Y-%m-%d %H:%M:%S}.{frac}")
    _write_csv(
        root / "azure-llm-2023/AzureLLMInferenceTrace_conv.csv",
        ["TIMESTAMP", "ContextTokens", "GeneratedTokens"],
        [
            [t, r["context_tokens"], r["generated_tokens"]]
            for t, r in zip(stamps_conv, conv, strict=True)
        ],
    )
    qps = _rows(SHIPPED / "alibaba-genai-2026/qps_per_minute.csv")
    text = io.StringIO()
    w = csv.writer(text, lineterminator="\n")
    w.writerow(["timestamp_anon", "value", "container_ip", "request_type"])
    for r in qps:  # one container per minute, 17 s into it: the per-minute sums are exact
        w.writerow([f"{(27_000_000 + int(r['minute'])) * 60 + 17}.0", r["qps"], "", "API"])
    payload = text.getvalue().encode()
    (root / "alibaba-genai-2026").mkdir(parents=True)
    with tarfile.open(root / "alibaba-genai-2026/qps.tar.gz", "w:gz") as tar:
        info = tarfile.TarInfo("qps.csv")
        info.size = len(payload)
        tar.addfile(info, io.BytesIO(payload))
    pods = _rows(SHIPPED / f"{PODS}.gz")
    header = ["name", "cpu_milli", "memory_mib", "num_gpu", "gpu_milli", "gpu_spec", "qos"]
    rows = [[p["name"], "8000", "1024", p["num_gpu"], p["gpu_milli"], "", p["qos"]] for p in pods]
    # Rows the derivation must drop: whole GPUs, several GPUs, other QoS classes.
    rows += [
        ["x-whole", "1", "1", "1", "1000", "", "LS"],
        ["x-two", "1", "1", "2", "500", "", "BE"],
        ["x-burst", "1", "1", "1", "500", "", "Burstable"],
    ]
    _write_csv(root / PODS, header, rows)


def test_derivation_rebuilds_every_shipped_file_exactly(tmp_path: Path) -> None:
    originals, out = tmp_path / "orig", tmp_path / "out"
    _fake_originals(originals)
    script = REPO / "scripts" / "derive-sim-data.py"
    done = subprocess.run(
        [sys.executable, script, "--from", originals, "--to", out],
        capture_output=True,
        text=True,
        check=False,
    )
    assert done.returncode == 0, done.stderr
    built = sorted(p.relative_to(out) for p in out.rglob("*") if p.is_file())
    shipped = sorted(
        p.relative_to(SHIPPED) for p in SHIPPED.rglob("*") if p.is_file() and p.suffix != ".md"
    )
    # Every data file the package ships (its READMEs aside) is derived by the script.
    assert built == [p for p in shipped if p.parts[0] != "validation"]
    for rel in built:
        assert (out / rel).read_bytes() == (SHIPPED / rel).read_bytes(), rel
    check = [sys.executable, script, "--from", originals, "--to", SHIPPED, "--check"]
    assert subprocess.run(check, capture_output=True, check=False).returncode == 0
    (out / PROFILE).write_text("Profile,SM_usage,Duration\n1,1,1\n")
    check[5] = out
    changed = subprocess.run(check, capture_output=True, text=True, check=False)
    assert changed.returncode == 1 and PROFILE in changed.stderr


def test_upstream_formats_load_to_the_same_data(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    shipped = (
        data.load_profile(PROFILE),
        data.load_azure_arrivals(AZURE),
        data.load_genai_qps("alibaba-genai-2026/qps_per_minute.csv"),
        data.load_alibaba_pods(PODS),
    )
    _fake_originals(tmp_path)
    monkeypatch.setenv(data.DATA_ENV, str(tmp_path))
    for fn in (data.load_profile, data.load_azure_arrivals, data.load_alibaba_pods):
        fn.cache_clear()
    assert data.resolve(PROFILE) == tmp_path / PROFILE  # the upstream five-column file
    upstream = (
        data.load_profile(PROFILE),
        data.load_azure_arrivals(AZURE),
        data.load_genai_qps("alibaba-genai-2026/qps.tar.gz"),
        data.load_alibaba_pods(PODS),
    )
    assert upstream == shipped


def test_the_orion_point_ships() -> None:
    point = json.loads(
        data.resolve(
            "orion-v100-kernels/mps_example_resnet50inf_resnet50train_V100.log.json"
        ).read_text()
    )
    assert point["p99-latency-0"] == pytest.approx(181.0, abs=0.1)


def test_gz_is_read_decompressed(tmp_path: Path) -> None:
    path = tmp_path / "x.csv.gz"
    path.write_bytes(gzip.compress(b"a\n1\n"))
    assert _rows(path) == [{"a": "1"}]


# --- shipped scenarios -------------------------------------------------------------------------


def test_shipped_scenarios_by_name() -> None:
    names = scenario.shipped()
    assert "demo" in names and "pairs/bert_2_fwd+bert_8_fb1" in names
    assert scenario.find("demo") == REPO / "gpushare" / "scenarios" / "demo.toml"
    assert scenario.load("pairs/bert_2_fwd+bert_8_fb1.toml").name == "pair-bert_2_fwd+bert_8_fb1"
    with pytest.raises(scenario.ScenarioError, match=r"gpushare sim --list"):
        scenario.find("../not-a-scenario")


def test_sim_list_and_no_scenario() -> None:
    runner = CliRunner()
    listed = runner.invoke(app, ["sim", "--list"])
    assert listed.exit_code == 0
    assert any(line.startswith("azure-bursty ") for line in listed.output.splitlines())
    none = runner.invoke(app, ["sim"])
    assert none.exit_code == 2 and "gpushare sim --list" in none.output


def test_a_scenario_naming_a_missing_profile_exits_2(tmp_path: Path) -> None:
    text = (REPO / "gpushare" / "scenarios" / "demo.toml").read_text()
    bad = tmp_path / "bad.toml"
    bad.write_text(text.replace("resnet50_4_fwd.csv", "resnet50_4_fwd_gone.csv", 1))
    res = CliRunner().invoke(app, ["sim", str(bad), "--no-progress", "-o", str(tmp_path)])
    assert res.exit_code == 2
    assert f"{bad}: online[0].profile: no such data file" in res.output
    assert "resnet50_4_fwd_gone.csv" in res.output and "internal error" not in res.output


def test_no_path_outside_the_repository_in_tracked_files() -> None:
    """No absolute path of a development machine, no data read from beside the clone."""
    git = shutil.which("git")
    if git is None or not (REPO / ".git").exists():
        pytest.skip("not a git checkout: the tracked files are unknown")
    listed = subprocess.run(
        [git, "ls-files", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        text=True,
        check=True,
    ).stdout.split()
    outside = ("/" + "work/", "../" + "shared")
    hits = []
    for name in listed:
        path = REPO / name
        if path.suffix in (".gz", ".png") or not path.is_file():
            continue
        text = path.read_text(errors="replace")
        hits += [f"{name}: {needle}" for needle in outside if needle in text]
    assert hits == []
