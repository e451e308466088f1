"""A backend's flag given with another backend is refused by the flag as typed, naming the
backend that owns it (`--zero-stage belongs to --backend deepspeed`)."""

from __future__ import annotations

import pytest

from mpt.cli import _backend_flags

FLAGS = sorted(_backend_flags().values(), key=lambda found: found[2].flag or "")


def test_every_backend_has_its_flags_checked():
    """The generated flags this test walks through; deepspeed's and fsdp's at least."""
    owners = {backend for backend, _, _ in FLAGS}
    assert {"deepspeed", "fsdp"} <= owners, owners


@pytest.mark.parametrize(("owner", "name", "option"), FLAGS,
                         ids=[option.flag for _, _, option in FLAGS])
def test_a_flag_of_another_backend_names_itself_and_its_backend(run_cli, tmp_path, owner, name,
                                                                option):
    script = tmp_path / "train.py"
    script.write_text("")
    other = "ddp" if owner != "ddp" else "deepspeed"
    value = [] if option.is_switch else ["2"]
    result = run_cli("launch", "--backend", other, option.flag, *value, "--dry-run", str(script))
    assert result.returncode == 2
    assert result.stderr.count("\n") == 1, result.stderr
    assert f"{option.flag} (option {name!r}) belongs to --backend {owner}" in result.stderr, \
        result.stderr
    assert f"Fix: pass --backend {owner}, or drop {option.flag}" in result.stderr
    assert "backend option" not in result.stderr


def test_an_unknown_option_from_code_is_still_named_by_its_key():
    from mpt.backends import DDPBackend
    from mpt.errors import UsageError

    with pytest.raises(UsageError, match="backend option=no_such is invalid"):
        DDPBackend.check_options({"no_such": 1})


def test_launch_flags_are_the_backends_own():
    """How a job may start (Horovod's --hosts, --hostfile, --horovod-controller) is declared by
    the backend and generated into `mpt launch`; cli.py names no backend's flag."""
    from pathlib import Path

    import mpt.cli
    from mpt.backends import BUILTIN
    from mpt.cli import _launch_flags

    found = {p: (owner, name) for p, (owner, name, _) in _launch_flags().items()}
    assert found == {"hosts": ("horovod", "hosts"), "hostfile": ("horovod", "hostfile"),
                     "horovod_controller": ("horovod", "controller")}
    source = Path(mpt.cli.__file__).read_text()
    for cls in BUILTIN.values():
        for option in [*cls.options.values(), *cls.launch_options.values()]:
            assert option.flag is None or f'"{option.flag}"' not in source, option.flag
