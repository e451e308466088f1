"""The deepspeed backend without a job: its config, its bad input, its availability, detection."""

from __future__ import annotations

import json
import math
import sys

import pytest
import torch
import torch.distributed as dist
from conftest import run_mpt, worker

from mpt.backends import registered
from mpt.backends.deepspeed import DeepSpeedBackend, _import_deepspeed
from mpt.backends.deepspeed_config import build_config
from mpt.environments import detect_world
from mpt.errors import MissingDependencyError, UsageError
from mpt.precision import LossScaleConfig


def config(user: dict | None = None, **kw) -> dict:
    args = {"stage": None, "offload": frozenset(), "mode": None,
            "loss_scale": LossScaleConfig(), "accumulate": 1, "world_size": 2, **kw}
    return build_config(user or {}, **args)


def test_mpt_fills_what_the_user_config_leaves_out():
    c = config({"train_micro_batch_size_per_gpu": 8, "zero_optimization": {"stage": 3}},
               mode="bf16", accumulate=4)
    assert c["train_batch_size"] == 8 * 4 * 2 and c["gradient_accumulation_steps"] == 4
    assert c["zero_optimization"]["stage"] == 3 and c["bf16"] == {"enabled": True}
    assert c["data_types"] == {"buffer_dtype": "bf16"}  # a batchnorm's statistics follow
    assert "fp16" not in c and c["gradient_clipping"] == 0.0  # DeepSpeed's default would be 1.0
    c = config({"train_batch_size": 64}, stage=1, offload=frozenset({"optimizer"}))
    assert c["train_micro_batch_size_per_gpu"] == 32
    assert c["zero_optimization"] == {"stage": 1, "offload_optimizer": {"device": "cpu"}}
    assert config({"gradient_clipping": 0.5})["gradient_clipping"] == 0.5  # the user's wins


def test_fp16_maps_mpts_loss_scale_settings():
    c = config(mode="fp16", loss_scale=LossScaleConfig(init_scale=2.0**10,
                                                                    growth_interval=500))
    assert c["fp16"] == {"enabled": True, "loss_scale": 0, "initial_scale_power": 10,
                         "loss_scale_window": 500, "hysteresis": 1, "min_loss_scale": 1}
    static = config(mode="fp16", loss_scale=LossScaleConfig.parse("128"))
    assert static["fp16"] == {"enabled": True, "loss_scale": 128.0}
    with pytest.raises(UsageError, match="power of two"):
        config(mode="fp16", loss_scale=LossScaleConfig(init_scale=1000.0))


@pytest.mark.parametrize(("user", "kw", "match"), [
    ({"train_batch_size": 30, "train_micro_batch_size_per_gpu": 4}, {}, "must equal"),
    ({"train_batch_size": 7}, {}, "not a multiple"),
    ({"gradient_accumulation_steps": 4}, {"accumulate": 2}, "gradient_accumulation_steps=4"),
    ({"zero_optimization": {"stage": 1}}, {"stage": 2}, "sets stage 1"),
])
def test_conflicts_are_one_usage_error(user, kw, match):
    with pytest.raises(UsageError, match=match):
        config(user, **kw)


def test_conflict_is_raised_before_any_process_group_starts():
    import mpt

    with pytest.raises(UsageError, match="must equal"):
        mpt.Runtime(backend="deepspeed", env={}, backend_options={"config": {
            "train_batch_size": 3, "train_micro_batch_size_per_gpu": 2}})
    assert not dist.is_initialized()


@pytest.mark.parametrize(("flags", "message"), [
    (["--zero-stage", "4"], "--zero-stage=4 is invalid"),
    (["--zero-stage", "1", "--offload", "parameters"], "only ZeRO stage 3 partitions"),
    (["--zero-stage", "0", "--offload", "optimizer"], "stage 0 keeps no optimizer state"),
    (["--offload", "nvme"], "--offload=nvme is invalid"),
    (["--deepspeed-config", "{bad}"], "not valid JSON"),
    (["--deepspeed-config", '{"zero_optimisation": {}}'], "did you mean 'zero_optimization'"),
    (["--deepspeed-config", '{"optimizer": {"type": "Adam"}}'], "your torch optimizer"),
    (["--deepspeed-config", '{"zero_optimization": {"stage": 2}}', "--zero-stage", "3"],
     "sets stage 2"),
])
def test_bad_input_is_one_line_and_exit_code_2(tmp_path, monkeypatch, capsys, flags, message):
    """In-process through the CLI's entry point (a subprocess each would cost seconds)."""
    from mpt.cli import main

    if "--deepspeed-config" in flags:
        i = flags.index("--deepspeed-config") + 1
        (tmp_path / "ds.json").write_text(flags[i])
        flags = [*flags[:i], str(tmp_path / "ds.json"), *flags[i + 1:]]
    monkeypatch.setattr(sys, "argv", ["mpt", "launch", "--backend", "deepspeed", *flags,
                                      worker("ds_curves.py")])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2
    assert err.count("\n") == 1 and err.startswith("mpt: error: ") and message in err, err


def test_launch_without_deepspeed_installed_is_one_line(monkeypatch, capsys):
    from mpt.cli import main

    monkeypatch.setattr("mpt.backends.deepspeed._installed_version", lambda: None)
    monkeypatch.setattr(sys, "argv", ["mpt", "launch", "--backend", "deepspeed",
                                      worker("ds_curves.py")])
    with pytest.raises(SystemExit) as exit_:
        main()
    err = capsys.readouterr().err
    assert exit_.value.code == 2 and err.count("\n") == 1
    assert "needs deepspeed" in err and 'pip install "deepspeed>=0.19,<0.20"' in err


def test_bad_input_from_the_real_command_line():
    result = run_mpt("launch", "--backend", "deepspeed", "--zero-stage", "9",
                     worker("ds_curves.py"))
    assert result.returncode == 2 and result.stderr.count("\n") == 1
    assert "--zero-stage=9 is invalid" in result.stderr


def test_listed_with_the_reason_and_install_command_when_deepspeed_cannot_import(monkeypatch):
    assert registered()["deepspeed"] is DeepSpeedBackend  # listed without importing deepspeed
    monkeypatch.setitem(sys.modules, "deepspeed", None)  # `import deepspeed` now fails
    info = DeepSpeedBackend.availability()
    assert not info.available and "deepspeed" in info.reason and "deepspeed>=0.19" in info.install
    with pytest.raises(MissingDependencyError, match="needs deepspeed"):
        _import_deepspeed("cpu")


def test_cli_lists_deepspeed():
    result = run_mpt("backends")
    assert result.returncode == 0
    line = next(line for line in result.stdout.splitlines() if "deepspeed" in line)
    assert "yes" in line and "0.19." in line


def test_a_script_started_by_the_deepspeed_launcher_is_detected():
    # What deepspeed.launcher.launch exports for local rank 1 of node 1, 2 nodes x 2 processes.
    env = {"MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29600", "WORLD_SIZE": "4",
           "CROSS_RANK": "1", "CROSS_SIZE": "2", "LOCAL_SIZE": "2", "RANK": "3",
           "LOCAL_RANK": "1"}
    world = detect_world(env)
    assert (world.rank, world.local_rank, world.nr, world.nodes, world.gpus) == (3, 1, 1, 2, 2)
    assert (world.master_addr, world.master_port, world.source) == ("10.0.0.1", 29600,
                                                                   "torchelastic")


def test_loss_scaler_state_round_trips_through_mpts_format():
    from types import SimpleNamespace

    from mpt.backends.deepspeed_state import apply_scaler_state, loss_scaler_of, scaler_state
    from mpt.precision import LossScaleState

    ds = SimpleNamespace(cur_scale=1024.0, cur_iter=37, last_overflow_iter=30, scale_window=5,
                         dynamic=True)
    state = scaler_state(ds)
    assert state == LossScaleState(scale=1024.0, clean_steps=1)  # 6 clean steps, grew at 5
    fresh = SimpleNamespace(cur_scale=65536.0, cur_iter=0, last_overflow_iter=-1,
                            scale_window=5, dynamic=True)
    apply_scaler_state(fresh, state)
    assert scaler_state(fresh) == state
    # what mpt's checkpoint stores: GradScaler's layout, plain values, loadable by GradScaler
    scaler = torch.amp.GradScaler("cpu")
    scaler.load_state_dict(state.state_dict(growth_interval=5))
    assert LossScaleState.of(scaler) == state and json.dumps(state.state_dict())
    # ZeRO-0's fp16 optimizer names it differently and starts with no overflow at all
    stage0 = SimpleNamespace(cur_scale=2.0**16, cur_iter=3, last_overflow_iter=None,
                             scale_window=1000, dynamic_loss_scale=True)
    owner = SimpleNamespace(loss_scale_config=stage0)
    assert loss_scaler_of(owner) is stage0
    assert scaler_state(stage0).clean_steps == 3
    apply_scaler_state(stage0, LossScaleState(scale=8.0, clean_steps=1))
    assert (stage0.cur_scale, scaler_state(stage0).clean_steps) == (8.0, 1)


def test_a_batchnorm_model_trains_in_bf16_under_deepspeed():
    import mpt

    torch.manual_seed(0)
    rt = mpt.Runtime(backend="deepspeed", precision="bf16-mixed", env={})
    model = torch.nn.Sequential(torch.nn.Linear(4, 8), torch.nn.BatchNorm1d(8),
                                torch.nn.Linear(8, 1))
    model, _ = rt.setup(model, torch.optim.SGD(model.parameters(), lr=0.05))
    x, y = torch.randn(64, 4), torch.randn(64, 1)
    losses = []
    for _ in range(5):
        with rt.autocast():
            loss = (model(x).float() - y).pow(2).mean()
        rt.backward(loss)
        rt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] and all(map(math.isfinite, losses))
    rt.close()
