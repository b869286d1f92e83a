"""Every import is declared in pyproject.toml and every declared package is used, checked by deptry (configured in
pyproject's [tool.deptry]). A package installed by hand on one machine would otherwise make the suite green there
and red on a fresh one."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def deptry(*args: str, config: Path = ROOT / "pyproject.toml") -> subprocess.CompletedProcess:
    exe = shutil.which("deptry")
    assert exe, "deptry missing: it comes with the dev extra (bash scripts/setup.sh)"
    return subprocess.run([exe, *args, "--config", str(config), "--no-ansi"], cwd=ROOT, capture_output=True,
                          text=True, timeout=120)


def test_every_import_is_declared_and_every_dependency_used() -> None:
    out = deptry(".")
    assert out.returncode == 0, out.stderr


def test_the_product_needs_no_dev_only_package() -> None:
    # The trainer and operator ship without the dev extra (images, `pip install paratrain[trainer]`).
    out = deptry("trainer", "operator", "--optional-dependencies-dev-groups", "dev", "--ignore", "DEP002")
    assert out.returncode == 0, out.stderr


def test_a_dropped_declaration_fails_naming_the_module(tmp_path: Path) -> None:
    # The check above can fail: without safetensors in the trainer extra, deptry names the import.
    pyproject = (ROOT / "pyproject.toml").read_text()
    dropped, count = re.subn(r' "safetensors[^"]*",', "", pyproject)
    assert count == 1
    (tmp_path / "pyproject.toml").write_text(dropped)
    out = deptry(".", config=tmp_path / "pyproject.toml")
    # DEP003 where another package pulled safetensors in (transformers does), DEP001 where nothing did.
    assert out.returncode == 1
    named = r"trainer/paratrain/train/models/hf\.py:\d+:\d+: DEP00[13] 'safetensors' imported"
    assert re.search(named, out.stderr), out.stderr
