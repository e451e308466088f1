"""`mpt env`: the report on this machine, as tables and as JSON."""

from __future__ import annotations

import io
import json

import torch
from conftest import run_mpt
from rich.console import Console

from mpt import report
from mpt.backends import Availability, DDPBackend


def test_env_json_has_every_section_and_the_machine_facts():
    result = run_mpt("env", "--json")
    assert result.returncode == 0, result.stderr
    facts = json.loads(result.stdout)
    assert {"mpt", "python", "platform", "torch", "devices", "backends", "packages",
            "environment"} <= set(facts)
    assert facts["torch"]["version"] == torch.__version__
    assert facts["torch"]["cuda_available"] == torch.cuda.is_available()
    assert facts["torch"]["distributed"]["gloo"] is True
    ddp = next(b for b in facts["backends"] if b["name"] == "ddp")
    assert ddp["available"] is True and torch.__version__ in ddp["version"]
    for row in facts["backends"]:
        assert row["available"] or row["reason"], row  # a missing backend says why
    assert facts["environment"]["source"] == "local"
    assert facts["environment"]["world_size"] == 1


def render(facts: dict) -> str:
    console = Console(width=200, record=True, file=io.StringIO())
    for table in report.tables(facts):
        console.print(table)
    return console.export_text()


def test_env_tables_show_versions_backends_and_world():
    text = render(report.collect({}))  # what `mpt env` prints (it passes os.environ)
    for title in ("system", "devices", "backends", "world (detected)"):
        assert title in text
    assert torch.__version__ in text
    assert any(" ddp " in line and "yes" in line for line in text.splitlines())


def test_unavailable_backend_is_listed_with_reason_and_install(monkeypatch):
    class Missing(DDPBackend):
        name = "missing"

        @classmethod
        def availability(cls) -> Availability:
            return Availability(available=False, reason="package gone", install="pip install x")

    monkeypatch.setitem(__import__("mpt.backends").backends._registry, "missing", Missing)
    facts = report.collect({})
    row = next(b for b in facts["backends"] if b["name"] == "missing")
    assert row == {"name": "missing", "available": False, "version": "", "reason": "package gone",
                   "install": "pip install x"}
    assert "package gone; pip install x" in render(facts)


def test_detected_cluster_world_and_its_source():
    slurm = {"SLURM_PROCID": "3", "SLURM_NTASKS": "4", "SLURM_LOCALID": "1", "SLURM_NNODES": "2",
             "SLURM_NODEID": "1", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_ID": "5",
             "MPT_RUN_CONFIG": '{"precision": "bf16-mixed"}'}
    world = report.collect(slurm)["environment"]
    assert world["source"] == "slurm" and world["rank"] == 3 and world["world_size"] == 4
    assert world["master_addr"] == "gpu07" and world["settings"] == {"precision": "bf16-mixed"}
    broken = report.collect({"WORLD_SIZE": "2"})["environment"]  # reported, not raised
    assert broken["source"] == "error" and "WORLD_SIZE=2" in broken["error"]
