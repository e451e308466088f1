"""Every refusal of the DeepSpeed config x ``--precision`` table leads somewhere: each
alternative its "Fix" names, followed alone, is accepted.

The hints are read as a user reads them (the error's text), applied, and checked the way
`mpt launch` checks a run before any process starts (``resolve_precision``): no training.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field, replace
from typing import Any

import pytest

from mpt.backends import resolve_precision
from mpt.errors import UsageError
from mpt.precision import PRECISIONS

CONFIGS: list[dict[str, Any]] = [
    {},
    {"fp16": {"enabled": True}},
    {"fp16": {"enabled": False}},
    {"fp16": {"enabled": True, "loss_scale": 0}, "bf16": {"enabled": False}},
    {"bf16": {"enabled": True}},
    {"bf16": {"enabled": False}},
    {"bfloat16": {"enabled": True}},
    {"fp16": {"enabled": False}, "bf16": {"enabled": True}},
    {"fp16": {"enabled": False}, "bf16": {"enabled": False}},
    {"fp16": {"loss_scale": 128}},  # a section that does not say whether it is on
]
"""DeepSpeed configs as far as precision goes: sections on, off, both, and bf16's old name."""


@dataclass(frozen=True)
class Run:
    """What a user passes to `mpt launch`, as far as the check goes."""

    precision: str | None
    """``--precision`` (None: left out)."""
    config: dict[str, Any] = field(default_factory=dict)
    """``--deepspeed-config``'s content."""
    device: str = "cpu"
    """Where it runs."""
    backend: str = "deepspeed"

    def refusal(self) -> UsageError | None:
        """The launcher's error for this run, None where it is accepted."""
        options = {"config": self.config} if self.backend == "deepspeed" else {}
        try:
            resolve_precision(self.backend, self.precision, device_type=self.device,
                              backend_options=options)
        except UsageError as exc:
            return exc
        return None


def _without(config: dict[str, Any], key: str) -> dict[str, Any]:
    assert key in config, f"the hint drops a section the config lacks: {key}"
    return {k: v for k, v in config.items() if k != key}


def follow(run: Run, alternative: str) -> list[Run]:
    """The run(s) the user gets by doing what ``alternative`` (one of the hint's) says; a hint
    in words this test does not know fails it, so that every new hint is followed here too."""
    if found := re.fullmatch(r"use --precision (\S+) \(or leave --precision out\)", alternative):
        return [replace(run, precision=found[1]), replace(run, precision=None)]
    if found := re.fullmatch(r"use --precision (\S+) and drop the '(\w+)' section of the "
                             r"DeepSpeed config", alternative):
        return [replace(run, precision=found[1], config=_without(run.config, found[2]))]
    if found := re.fullmatch(r"use --precision (\S+)", alternative):
        return [replace(run, precision=found[1])]
    if found := re.fullmatch(r"drop the '(\w+)' section of the DeepSpeed config", alternative):
        return [replace(run, config=_without(run.config, found[1]))]
    if alternative == "run on GPUs":
        return [replace(run, device="cuda")]
    if found := re.fullmatch(r"--backend (\w+) for (\S+) \(without DeepSpeed's flags\)",
                             alternative):
        assert found[2] == run.precision
        return [replace(run, backend=found[1], config={})]
    raise AssertionError(f"a hint this test cannot follow: {alternative!r}")


pytestmark = pytest.mark.filterwarnings("ignore:torch.cuda.amp.GradScaler is enabled")
"""The cuda cells build their precision's GradScaler on this CPU machine: it says so."""

TABLE = [Run(precision, config, device) for config in CONFIGS
         for precision in [None, *PRECISIONS] for device in ("cpu", "cuda")]


def test_the_table_refuses_for_each_reason():
    """The table reaches every kind of refusal (else the test below would prove little)."""
    reasons = [error.problem for run in TABLE if (error := run.refusal()) is not None]
    for kind in ("has no fp16 on CPU", "config that enables fp16", "config that disables bf16",
                 "config that enables bfloat16", "keeps fp32 master weights itself"):
        assert any(kind in reason for reason in reasons), kind
    assert len(reasons) > 100


@pytest.mark.parametrize("run", TABLE, ids=lambda r: f"{r.precision}-{json.dumps(r.config)}-"
                         f"{r.device}")
def test_every_hint_is_accepted_when_followed(run: Run):
    error = run.refusal()
    if error is None:
        return
    alternatives = error.hint.split(", or ")
    assert alternatives and all(alternatives), error
    for alternative in alternatives:
        for fixed in follow(run, alternative):
            assert fixed.refusal() is None, (f"{error}\n  followed: {alternative}\n  gives: "
                                             f"{fixed.refusal()}")


def test_fp16_config_on_cpu_no_longer_loops(run_cli, tmp_path):
    """The issue's case, through the command line: the first hint turns fp16 off as well."""
    config = tmp_path / "ds.json"
    config.write_text(json.dumps({"fp16": {"enabled": True}}))
    script = tmp_path / "train.py"
    script.write_text("")
    base = ["launch", "--backend", "deepspeed", "--deepspeed-config", str(config), "--dry-run"]
    refused = run_cli(*base, "--precision", "fp16-mixed", str(script))
    assert refused.returncode == 2
    assert "use --precision bf16-mixed and drop the 'fp16' section" in refused.stderr
    config.write_text("{}")
    accepted = run_cli(*base, "--precision", "bf16-mixed", str(script))
    assert accepted.returncode == 0, accepted.stderr


def test_a_config_that_enables_both_modes_is_refused_first():
    """Otherwise no --precision could be accepted, and each hint would send to the other."""
    error = Run("fp16-mixed", {"fp16": {"enabled": True}, "bf16": {"enabled": True}},
                "cuda").refusal()
    assert error is not None and "enables bf16 as well" in str(error)
