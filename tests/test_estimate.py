"""`mpt estimate-memory`: per-rank bytes from a model built on the meta device, by the formulas
each backend declares; checked against counts worked out by hand for a stack of Linear layers."""

from __future__ import annotations

import pytest
import torch
from conftest import run_mpt
from torch import nn

from mpt.backends import DDPBackend, DeepSpeedBackend, FSDPBackend
from mpt.estimate import activation_bytes, example_input, meta_model
from mpt.precision import describe

WIDTH, LAYERS = 1024, 4  # 4 x (1024 x 1024 + 1024) = 4,198,400 parameters, 1,049,600 a layer
P, LAYER = LAYERS * (WIDTH * WIDTH + WIDTH), WIDTH * WIDTH + WIDTH


def stack() -> nn.Module:
    return nn.Sequential(*[nn.Linear(WIDTH, WIDTH) for _ in range(LAYERS)])


def rows(cls, precision="fp32", world_size=2, states=2):
    return {r.label: r for r in cls.estimate_memory(meta_model(stack), describe(precision),
                                                    states, world_size, {})}


def test_the_model_is_never_allocated():
    model = meta_model(stack)
    assert all(p.is_meta for p in model.parameters())


def test_a_replica_holds_everything_and_masters_come_on_top():
    fp32 = rows(DDPBackend)["ddp"]
    assert (fp32.parameters, fp32.gradients, fp32.optimizer) == (4 * P, 4 * P, 8 * P)
    o2 = rows(DDPBackend, "O2")["ddp"]  # fp16 weights and gradients, fp32 masters + moments
    assert (o2.parameters, o2.gradients, o2.optimizer) == (2 * P, 2 * P, 12 * P)


def test_zero_stages_partition_optimizer_then_gradients_then_weights():
    found = rows(DeepSpeedBackend, world_size=4)
    assert found["deepspeed --zero-stage 0"].device == 16 * P  # fp32: no master copy
    assert found["deepspeed --zero-stage 1"].optimizer == 12 * P // 4  # master + 2 moments
    two = found["deepspeed --zero-stage 2"]
    assert (two.parameters, two.gradients) == (4 * P, 4 * P // 4)
    assert found["deepspeed --zero-stage 3"].device == (4 * P + 4 * P + 12 * P) // 4
    # offloaded: the state and the weights on the host, beside the partition's fp32 gradients
    offloaded = found["deepspeed --zero-stage 3 --offload optimizer,parameters"]
    assert offloaded.host == 12 * P // 4 + 4 * P // 4 + 4 * P // 4 and offloaded.optimizer == 0
    # ZeRO-1/2 also keep a buffer of the update and one of the largest gradient (a weight)
    staged = found["deepspeed --zero-stage 2 --offload optimizer"]
    assert staged.host == 12 * P // 4 + 4 * P // 4 + 4 * (P // 4 + WIDTH * WIDTH)
    bf16 = rows(DeepSpeedBackend, "bf16-mixed")["deepspeed --zero-stage 0"]
    assert (bf16.parameters, bf16.optimizer) == (2 * P, 12 * P)  # its bf16 mode keeps masters


def test_fsdp_holds_shards_and_one_gathered_unit():
    found = rows(FSDPBackend, world_size=2)
    # layers of 1.05 M parameters are units of their own; the root has none left
    assert found["fsdp"].parameters == 4 * P // 2 + 4 * LAYER
    assert found["fsdp"].optimizer == 8 * P // 2
    assert found["fsdp --fsdp-cpu-offload"].host == 16 * P // 2
    o2 = rows(FSDPBackend, "O2", world_size=2)["fsdp"]  # fp32 shards, units gathered in fp16
    assert (o2.parameters, o2.optimizer) == (4 * P // 2 + 2 * LAYER, 8 * P // 2)


def test_activations_are_what_autograd_saves_without_the_weights():
    model = meta_model(stack)
    # each Linear saves its input (8 x 1024 floats); its weight is a parameter
    saved = activation_bytes(model, example_input([8, WIDTH], torch.float32))
    assert saved == LAYERS * 8 * WIDTH * 4


def test_the_command_prints_every_backend_and_refuses_bad_input(tmp_path):
    (tmp_path / "net.py").write_text("from torch import nn\nfrom torch.nn import Linear\n"
                                     "def build():\n    return nn.Linear(8, 8)\n")
    result = run_mpt("estimate-memory", f"{tmp_path / 'net.py'}:build", "--input-shape", "4,8")
    assert result.returncode == 0, result.stderr
    for label in ("ddp", "deepspeed --zero-stage 3", "fsdp", "horovod"):
        assert label in result.stdout
    for args, argument in (([f"{tmp_path / 'net.py'}:nope"], "MODEL"),
                          ([f"{tmp_path / 'net.py'}:Linear"], "MODEL"),
                          ([f"{tmp_path / 'net.py'}:build", "--optimizer", "lion"], "--optimizer"),
                          ([f"{tmp_path / 'net.py'}:build", "--input-shape", "4,x"],
                           "--input-shape")):
        bad = run_mpt("estimate-memory", *args)
        assert bad.returncode == 2 and bad.stderr.startswith(f"mpt: error: {argument}=")
        assert len(bad.stderr.strip().splitlines()) == 1


@pytest.mark.parametrize("precision", ["O2"])
def test_refused_pairs_get_no_row(precision, tmp_path):
    (tmp_path / "net.py").write_text("from torch import nn\n"
                                     "def build():\n    return nn.Linear(8, 8)\n")
    result = run_mpt("estimate-memory", f"{tmp_path / 'net.py'}:build", "--precision", precision)
    assert result.returncode == 0 and "ddp" in result.stdout
    assert "fsdp" in result.stdout and "deepspeed" not in result.stdout  # DeepSpeed refuses O2


def test_the_snapshot_estimate_is_the_piece_a_run_writes(tmp_path):
    """A one-process run's snapshot piece against ``snapshot_estimate``: its tensor bytes are
    the weights and Adam's moments (plus a few hundred bytes of steps and RNG state)."""
    import mpt
    from mpt.checkpoint.snapshot import Piece
    from mpt.estimate import snapshot_estimate

    rt = mpt.Runtime(env={}, quiet=True, snapshot_every=1, snapshot_dir=str(tmp_path))
    model = nn.Sequential(*[nn.Linear(256, 256) for _ in range(3)])
    model, _ = rt.setup(model, torch.optim.Adam(model.parameters()))
    for _ in range(2):  # the store then holds the newest two snapshots
        rt.backward(model(torch.randn(2, 256)).sum())
        rt.step()
    rt.close()
    paths = sorted(tmp_path.iterdir())
    piece = Piece(str(paths[-1]))
    written = sum(n for _, n in piece.boxes.values())
    piece.close()
    store = sum(path.stat().st_size for path in paths)
    guess = snapshot_estimate(meta_model(lambda: nn.Sequential(
        *[nn.Linear(256, 256) for _ in range(3)])), weight_bytes=4, master_bytes=0,
        optimizer_states=2, world_size=1, per_node=1)
    assert guess.piece <= written <= guess.piece + 16 * 1024  # steps, RNG state
    assert len(paths) == 2 and guess.store <= store <= guess.store + 2 * 64 * 1024  # headers
