"""Model builders the `mpt plan` tests name as FILE.py:FUNCTION."""

from __future__ import annotations

from torch import nn


def mlp() -> nn.Module:
    """docs/benchmarks.md's communication-bound MLP: 25.2 M parameters, 100.7 MB of fp32
    gradients."""
    return nn.Sequential(nn.Linear(1024, 4096), nn.ReLU(), nn.Linear(4096, 4096), nn.ReLU(),
                         nn.Linear(4096, 1024))


def deep() -> nn.Module:
    """Eight layers of about one size (29.4 M parameters): fsdp's units are alike (16 MiB, the
    first and last 8), where the MLP's are 16, 64 and 16 MiB."""
    layers = [nn.Linear(1024, 2048), *(nn.Linear(2048, 2048) for _ in range(6)),
              nn.Linear(2048, 1024)]
    return nn.Sequential(*(m for layer in layers for m in (layer, nn.ReLU())))


def small() -> nn.Module:
    """A model whose own step a calibration times in a moment."""
    return nn.Sequential(nn.Linear(1024, 64), nn.ReLU(), nn.Linear(64, 8))


def normed() -> nn.Module:
    """Starts with a Flatten (no weights); batch norm over features, whose training forward
    refuses a batch of one sample."""
    return nn.Sequential(nn.Flatten(), nn.Linear(12, 4), nn.BatchNorm1d(4))


class _MetaOnly(nn.Linear):
    def forward(self, x):
        if x.device.type != "meta":
            raise RuntimeError("this layer runs on the meta device only")
        return super().forward(x)


def meta_only() -> nn.Module:
    """Plans like any model; its real step fails, as one that does not fit its device would."""
    return nn.Sequential(_MetaOnly(1024, 8))


def huge() -> nn.Module:
    """8.6 G parameters: more than any rank of a small cluster holds with Adam."""
    return nn.Sequential(*(nn.Linear(32768, 32768) for _ in range(8)))


def not_a_module() -> int:
    return 3
