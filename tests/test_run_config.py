"""One typed source of run settings: the CLI, config files, the launcher -> worker hand-off and
Runtime(...) arguments are all RunConfig, checked in one place, with one yes/no vocabulary."""

from __future__ import annotations

import dataclasses
import json

import pytest

import mpt
from mpt.errors import UsageError
from mpt.parse import BOOLEANS
from mpt.precision import AmpConfig
from mpt.run_config import VARIABLE, RunConfig


def test_every_setting_is_a_runtime_argument_and_a_launch_option():
    settings = {f.name for f in dataclasses.fields(RunConfig)}
    with mpt.Runtime(env={}, **dict.fromkeys(settings)) as rt:  # None keeps each default
        assert rt.config == RunConfig()
    with pytest.raises(UsageError, match="run setting=pipeline_stage is invalid"):
        mpt.Runtime(env={}, pipeline_stage=2)
    config = RunConfig(precision="bf16-mixed", accumulate=3)
    with mpt.Runtime(config, env={}, accumulate=2) as rt:  # a setting by name wins
        assert (rt.config.precision, rt.accumulate) == ("bf16-mixed", 2)
    from typer.main import get_command

    from mpt.cli import app

    launch = get_command(app).commands["launch"]  # type: ignore[attr-defined]
    assert settings <= {p.name for p in launch.params}


def test_the_hand_off_is_one_variable_and_round_trips():
    config = RunConfig.parse({"backend": "apex", "precision": "O2", "accumulate": "2",
                              "quiet": "yes", "precision_options": '{"loss_scale": 128}',
                              "backend_options": {"delay_allreduce": "on"}, "timeout": "60"})
    env = config.to_env()
    assert list(env) == [VARIABLE] and RunConfig.from_env(env) == config
    assert (config.accumulate, config.quiet, config.timeout) == (2, True, 60.0)


@pytest.mark.parametrize("word", sorted(BOOLEANS))
def test_one_vocabulary_of_yes_and_no_everywhere(word):
    want = BOOLEANS[word]
    assert RunConfig.parse({"quiet": word}).quiet is want  # a launch setting
    # an Apex override (`--master-weights yes` was refused while `delay_allreduce=yes` passed)
    overrides = {"master_weights": word, "loss_scale": 128.0}  # no masters: a static scale
    assert AmpConfig.resolve("O2", overrides).master_weights is want
    backend = mpt.Runtime(backend="apex", env={}, backend_options={"delay_allreduce": word})
    assert backend.backend.ddp_kwargs() == {"delay_allreduce": want}  # an Apex DDP option
    backend.close()


@pytest.mark.parametrize(("values", "argument"), [
    ({"quiet": "maybe"}, "--quiet"), ({"metrics_all_ranks": "2"}, "--metrics-all-ranks"),
    ({"accumulate": "two"}, "--accumulate"), ({"accumulate": 0}, "--accumulate"),
    ({"timeout": "-1"}, "--timeout"), ({"log_every": 0}, "--log-every"),
    ({"backend_options": "{oops"}, "--backend-options"), ({"lr_scaling": "cubic"}, None),
    ({"nonsense": 1}, "run setting"),
])
def test_bad_values_are_one_error_naming_the_setting(values, argument):
    with pytest.raises(UsageError) as info:
        RunConfig.parse(values)
    assert "\n" not in str(info.value)
    if argument is not None:
        assert str(info.value).startswith(f"{argument}=")


def test_a_bad_apex_override_names_it():
    with pytest.raises(UsageError, match=r"^master_weights=maybe"):
        AmpConfig.resolve("O2", {"master_weights": "maybe"})


def test_code_wins_over_the_hand_off_and_options_merge_key_by_key():
    env = RunConfig.parse({"backend": "apex", "precision": "bf16-mixed", "accumulate": 4,
                           "quiet": True,
                           "backend_options": {"gradient_predivide_factor": 2}}).to_env()
    rt = mpt.Runtime(env=env, accumulate=2, quiet=False,
                     backend_options={"delay_allreduce": True})
    assert (rt.precision.name, rt.accumulate, rt.config.quiet) == ("bf16-mixed", 2, False)
    assert rt.backend.ddp_kwargs() == {"gradient_predivide_factor": 2.0, "delay_allreduce": True}
    rt.close()


def test_a_variable_of_earlier_versions_is_refused_not_ignored():
    with pytest.raises(UsageError, match=r"^MPT_ACCUMULATE=4 .* MPT_RUN_CONFIG only"):
        mpt.Runtime(env={"MPT_ACCUMULATE": "4"})


def test_a_process_horovodrun_started_without_mpt_runs_horovod_unless_told():
    assert RunConfig.from_env({"HOROVOD_RANK": "0"}).backend == "horovod"
    told = {"HOROVOD_RANK": "0", **RunConfig(backend="ddp").to_env()}
    assert RunConfig.from_env(told).backend == "ddp"  # `mpt launch` hosting Horovod's rendezvous
    assert json.loads(told[VARIABLE])["backend"] == "ddp"
