"""Golden files pin the rendered objects of a few jobs, so any change to what reaches the cluster shows in review.

After an intended change, regenerate them and read the diff:

    PARATRAIN_UPDATE_GOLDENS=1 .venv/bin/python -m pytest tests/operator/test_render_golden.py
    git diff tests/operator/golden/
"""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import yaml

from paratrain.api import load_job
from paratrain_operator.render import render_job, to_yaml_stream

HERE = Path(__file__).resolve().parent
UPDATE = os.environ.get("PARATRAIN_UPDATE_GOLDENS") == "1"
# (job file, gang attempt): a plain job, a CR with uid and namespace, every cluster knob with Volcano, and
# coscheduling with a user /tmp at a later attempt.
CASES = [("minimal.yaml", 0), ("dp2-cpu.yaml", 0), ("gpu-3d-volcano.yaml", 0), ("coscheduling-text.yaml", 3),
         ("native-gang.yaml", 1)]


def rendered(job_file: str, attempt: int) -> str:
    job = load_job(HERE / "jobs" / job_file)
    objects = render_job(job, job.metadata.namespace or "default", attempt)
    text = to_yaml_stream(objects)
    assert list(yaml.safe_load_all(text)) == objects
    return text


@pytest.mark.parametrize("job_file,attempt", CASES)
def test_render_matches_golden(job_file: str, attempt: int) -> None:
    golden = HERE / "golden" / f"{Path(job_file).stem}.attempt{attempt}.yaml"
    text = rendered(job_file, attempt)
    if UPDATE:
        golden.write_text(text)
    assert golden.exists(), f"no golden file {golden.name}: run with PARATRAIN_UPDATE_GOLDENS=1"
    assert text == golden.read_text(), f"render of {job_file} changed: see the module docstring"


def test_no_stale_golden_files() -> None:
    expected = {f"{Path(f).stem}.attempt{a}.yaml" for f, a in CASES}
    assert {p.name for p in (HERE / "golden").glob("*.yaml")} == expected
