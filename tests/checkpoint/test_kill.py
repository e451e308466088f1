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
        # a load of the root takes the newest committed checkpoint: no committed step is lost,
        # also where the kill cut the `latest` update after a commit's rename (then `latest`
        # names an older one; each such kill leaves one more committed checkpoint after it)
        assert Path(trial["resolved"]).name == trial["complete"][-1]
        assert trial["step"] == int(trial["complete"][-1].removeprefix("step-"))
        assert trial["step"] >= previous  # never an older one than before the kill
        # trial t's child saves steps 1000 (t + 1) + 1, + 2, ...
        assert trial["step"] == previous or 1000 * (t + 1) < trial["step"] < 1000 * (t + 2)
        # `latest` always names a whole checkpoint
        assert trial["latest"] in trial["complete"]
        previous = trial["step"]
    # the kills landed both inside saves (a staging directory left) and between them
    assert any(trial["leftovers"] for trial in trials)
    assert sum(trials[t]["step"] > trials[t - 1]["step"] for t in range(1, TRIALS)) >= 3
