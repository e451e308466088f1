"""kill -9 in the middle of saves (24 trials): the previous checkpoint always loads."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from conftest import worker

TRIALS = 24


def test_kill_9_at_random_points_of_a_save_leaves_a_loadable_latest(tmp_path):
    out = tmp_path / "kills.json"
    result = subprocess.run([sys.executable, worker("ckpt_kill.py"), str(tmp_path / "ckpt"),
                             str(TRIALS), str(out)], capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr[-3000:]
    trials = json.loads(out.read_text())["trials"]
    assert len(trials) == TRIALS
    previous = 0
    for t, trial in enumerate(trials):
        # `latest` always names a whole checkpoint, and that is what a load of the root takes
        assert Path(trial["resolved"]).name == trial["latest"]
        assert trial["step"] == int(trial["latest"].removeprefix("step-"))
        assert trial["step"] >= previous  # never an older one than before the kill
        # trial t's child saves steps 1000 (t + 1) + 1, + 2, ...
        assert trial["step"] == previous or 1000 * (t + 1) < trial["step"] < 1000 * (t + 2)
        # `latest` is whole, and at most one whole checkpoint is newer: the one whose rename
        # was done when the kill cut the pointer update. (More than keep=2 may be whole: each
        # kill between a commit and its pruning leaves one more until a save runs to its end.)
        assert trial["latest"] in trial["complete"]
        assert sum(name > trial["latest"] for name in trial["complete"]) <= 1
        previous = trial["step"]
    # the kills landed both inside saves (a staging directory left) and between them
    assert any(trial["leftovers"] for trial in trials)
    assert sum(trials[t]["step"] > trials[t - 1]["step"] for t in range(1, TRIALS)) >= 3
