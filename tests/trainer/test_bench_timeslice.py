"""bench/timeslice.py runs two commands by turns: while one runs, the other's whole process tree is stopped, a
grandchild included (a launcher's ranks), and each is told how long it ran. bench/nanogpt.py's ratio rests on it."""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "bench"))
from timeslice import Command, run_by_turns  # noqa: E402

# Busy for `seconds` of its own running time, noting the wall clock every few milliseconds.
WRITER = """
import sys, time
out, seconds = open(sys.argv[1], "w"), float(sys.argv[2])
start = time.process_time()
while time.process_time() - start < seconds:
    out.write(f"{time.monotonic()}\\n")
    end = time.process_time() + 0.003
    while time.process_time() < end:
        pass
out.close()
"""


def test_two_commands_run_by_turns_each_tree_stopped_while_the_other_runs(tmp_path):
    writer = tmp_path / "writer.py"
    writer.write_text(WRITER)
    commands = {
        "direct": Command([sys.executable, str(writer), str(tmp_path / "direct.txt"), "0.8"]),
        # the writer as a grandchild, under a shell: stopping the shell alone would leave it running
        "grandchild": Command(["/bin/sh", "-c", f'"{sys.executable}" "{writer}" "{tmp_path / "grandchild.txt"}" 0.8; '
                               "exit 0"]),
    }
    done = run_by_turns(commands, tmp_path / "logs", slice_seconds=0.3)
    assert {name: f.returncode for name, f in done.items()} == {"direct": 0, "grandchild": 0}, done
    marks = sorted((float(t), name) for name in commands
                   for t in (tmp_path / f"{name}.txt").read_text().split())
    switches = sum(a[1] != b[1] for a, b in zip(marks, marks[1:]))
    # ~0.8 s of running time each, 0.3 s turns: a handful of switches; run at once, they would interleave by the
    # millisecond (hundreds). A process's CPU time can run ahead of its turns on a busy machine, so allow slack.
    assert 2 <= switches <= 16, switches
    for name, finished in done.items():
        assert 0.7 < finished.active_seconds < 3.0, (name, finished.active_seconds)
