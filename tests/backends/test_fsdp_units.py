"""fsdp's unit choice: which submodules fully_shard gets apart from the root (no process)."""

from __future__ import annotations

import pytest
from torch import nn

from mpt.backends.fsdp import MIN_UNIT_PARAMETERS, units
from mpt.errors import UsageError


def block(width: int) -> nn.Sequential:
    return nn.Sequential(nn.Linear(width, width), nn.ReLU())


def test_a_module_list_is_never_a_unit_its_parameters_count_above_it():
    """Blocks below the size threshold in a ModuleList that passes it (a GPT's transformer
    blocks): fully_shard refuses a container without forward, so the module holding the list
    becomes the unit instead."""
    width = 640  # 410k parameters a block: three pass MIN_UNIT_PARAMETERS, one does not
    assert width * width + width < MIN_UNIT_PARAMETERS < 3 * (width * width + width)

    class Tower(nn.Module):
        def __init__(self) -> None:
            super().__init__()
            self.blocks = nn.ModuleList(block(width) for _ in range(3))

        def forward(self, x):
            for b in self.blocks:
                x = b(x)
            return x

    model = nn.Sequential(Tower(), nn.Linear(width, 2))
    assert units(model, None) == [model[0]]
    with pytest.raises(UsageError, match="--fsdp-wrap=ModuleList is invalid: ModuleList has no "
                       "forward"):
        units(model, frozenset({"ModuleList"}))


def test_named_classes_and_large_modules_become_units_innermost_first():
    big = 1100  # 1.2M parameters: a unit by size
    model = nn.Sequential(block(big), nn.Sequential(block(8), block(8)))
    assert units(model, None) == [model[0][0]]
    assert units(model, frozenset({"Linear"})) == [model[0][0], model[1][0][0], model[1][1][0]]
