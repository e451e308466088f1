"""Heartbeats: what a rank writes, and what the launcher concludes from them."""

from __future__ import annotations

import time

from mpt.fault import Beat, Heartbeat, StallWatch, read_beats, suspects


def beat(rank: int, phase: str, age: float, now: float) -> Beat:
    return Beat(rank=rank, step=7, phase=phase, since=now - age, written=now)


def test_the_rank_outside_the_collective_is_the_suspect():
    now = time.time()
    waiting, hung = beat(0, "backward", 5.0, now), beat(1, "script", 5.2, now)
    assert suspects({0: waiting, 1: hung}, now) == [hung]
    # everyone computing, or everyone waiting: no clear picture, nobody is named
    assert suspects({0: beat(0, "script", 5, now), 1: hung}, now) == []
    assert suspects({0: waiting, 1: beat(1, "step", 5, now)}, now) == []
    # a rank that just left a collective is not blamed
    assert suspects({0: waiting, 1: beat(1, "script", 0.1, now)}, now) == []


def test_a_stuck_rank_is_reported_once_and_a_moving_one_never(tmp_path):
    stuck, moving = Heartbeat(str(tmp_path), 0, interval=0.05), Heartbeat(str(tmp_path), 1,
                                                                          interval=0.05)
    stuck.mark("backward", 3)
    reports: list[str] = []
    watch = StallWatch(str(tmp_path), timeout=0.4, report=reports.append)
    try:
        for step in range(30):  # 1.5 s
            moving.mark("script", step)
            time.sleep(0.05)
    finally:
        watch.stop()
        stuck.close()
        moving.close()
    assert len(reports) == 1, reports
    assert "rank 0: step 3, in backward" in reports[0]
    beats = read_beats(str(tmp_path))
    assert (beats[0].step, beats[0].phase) == (3, "backward")
    assert (beats[1].step, beats[1].phase) == (29, "script")
