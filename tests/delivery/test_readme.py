"""The README's install and first-job sections stay true: its job YAML is valid, its chart values exist."""

from __future__ import annotations

import re

import yaml

from paratrain.api import parse_job

from .conftest import CHART_DIR, ROOT

README = (ROOT / "README.md").read_text()


def test_readme_jobs_are_valid() -> None:
    blocks = [yaml.safe_load(b) for b in re.findall(r"```yaml\n(.*?)```", README, re.S)]
    jobs = [b for b in blocks if isinstance(b, dict) and b.get("kind") == "ParallelTrainJob"]
    assert jobs, "the README shows a first GPU job"
    for doc in jobs:
        job = parse_job(doc)
        assert job.spec.resources.gpus_per_node > 0


def test_readme_chart_values_exist() -> None:
    values = yaml.safe_load((CHART_DIR / "values.yaml").read_text())
    install = README[README.index("## Install on a cluster"):README.index("## Run a first job")]
    first_cells = [line.split("|")[1] for line in install.splitlines() if line.startswith("| `")]
    keys = [k for cell in first_cells for k in re.findall(r"`([\w.]+)`", cell)]
    keys += re.findall(r"--set ([\w.]+)=", install)
    assert len(keys) >= 8
    for key in keys:
        node = values
        for part in key.split("."):
            assert isinstance(node, dict) and part in node, f"README names chart value {key!r}, not in values.yaml"
            node = node[part]
