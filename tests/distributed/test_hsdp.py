"""HSDP (``--backend fsdp --fsdp-replicate R``) on 4 real processes: 2 replicas of 2 shards."""

from __future__ import annotations

import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).parents[1] / "workers"))
sys.path.insert(0, str(Path(__file__).parent))
from common import reference_params
from conftest import run_mpt, worker
from test_ddp import MICRO, STEPS, launch_equivalence


def test_hsdp_matches_one_process_and_shards_within_each_replica(tmp_path, free_port):
    ranks = launch_equivalence(tmp_path, free_port, 1, "--backend", "fsdp", "--fsdp-replicate",
                               "2", "--fsdp-wrap", "Linear", gpus=4)
    reference = reference_params(STEPS, 4 * MICRO)
    numel = sum(p.numel() for p in reference)
    held = [r["local_numel"] for r in ranks]  # ranks 0-1 and 2-3 each hold the whole model
    assert held[0] + held[1] == held[2] + held[3] == numel and held[:2] == held[2:]
    for r in ranks:
        for got, want in zip(r["params"], reference, strict=True):
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_dry_run_places_each_rank_and_a_bad_replica_count_is_one_line(tmp_path):
    plan = run_mpt("launch", "--gpus", "4", "--backend", "fsdp", "--fsdp-replicate", "2",
                   "--dry-run", worker("equivalence.py"))
    assert plan.returncode == 0, plan.stderr
    rows = [[cell.strip() for cell in line.split("│")[4:-2]]
            for line in plan.stdout.splitlines() if line.startswith("│")]
    assert rows == [["0", "0"], ["0", "1"], ["1", "0"], ["1", "1"]]  # replica, shard
    assert "layout: 2 data-parallel replica(s) x 2 rank(s) sharding the state" in plan.stdout
    result = run_mpt("launch", "--gpus", "4", "--backend", "fsdp", "--fsdp-replicate", "3",
                     "--dry-run", worker("equivalence.py"))
    assert result.returncode == 2, result.stderr
    assert result.stderr.count("\n") == 1 and "--fsdp-replicate=3" in result.stderr
    assert "pass one of 1, 2, 4" in result.stderr
    refused = run_mpt("launch", "--gpus", "2", "--backend", "ddp", "--fsdp-replicate", "2",
                      "--dry-run", worker("equivalence.py"))
    assert refused.returncode == 2 and "--fsdp-replicate" in refused.stderr, refused.stderr
