"""The operator's layering: it never imports the trainer (nor torch), so its image needs neither."""

from __future__ import annotations

import subprocess
import sys

PROBE = """
import sys
import paratrain_operator.__main__, paratrain_operator.handlers
loaded = sorted(m for m in sys.modules if m.split(".")[0] == "torch" or m.startswith("paratrain.train"))
print(",".join(loaded))
"""


def test_the_operator_imports_neither_the_trainer_nor_torch():
    out = subprocess.run([sys.executable, "-c", PROBE], capture_output=True, text=True, timeout=300, check=True)
    assert out.stdout.strip() == ""
