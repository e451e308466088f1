"""`mpt launch --config FILE` (YAML or TOML) and `mpt config init`."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import run_mpt

from mpt import cli

SCRIPT = str(Path(__file__).parents[1] / "examples" / "digits.py")


@pytest.fixture
def mpt(monkeypatch, capsys):
    """Run the `mpt` CLI in this process (fast): returns (exit code, stdout, stderr)."""
    monkeypatch.setenv("COLUMNS", "200")

    def run(*args: str) -> tuple[int, str, str]:
        monkeypatch.setattr(sys, "argv", ["mpt", *args])
        with pytest.raises(SystemExit) as info:
            cli.main()
        captured = capsys.readouterr()
        return info.value.code, captured.out, captured.err

    return run


def plan_title(stdout: str) -> str:
    return stdout.splitlines()[0]


@pytest.mark.parametrize("name", ["run.yaml", "run.toml"])
def test_values_come_from_the_file_and_flags_win(tmp_path, mpt, name):
    path = tmp_path / name
    if name.endswith(".toml"):
        path.write_text('gpus = 3\nprecision = "bf16-mixed"\nmaster-port = 29555\n')
    else:
        path.write_text("gpus: 3\nprecision: bf16-mixed\nmaster-port: 29555\n")
    code, out, err = mpt("launch", "--config", str(path), "--dry-run", SCRIPT)
    assert code == 0, err
    assert "on 3 process(es): backend ddp, precision bf16-mixed, rendezvous 127.0.0.1:29555" \
        in plan_title(out)
    code, out, err = mpt("launch", "--config", str(path), "--gpus", "2", "--precision", "fp32",
                         "--dry-run", SCRIPT)
    assert code == 0, err
    assert "on 2 process(es): backend ddp, precision fp32, rendezvous 127.0.0.1:29555" \
        in plan_title(out)


def test_an_elastic_range_needs_no_quotes_in_yaml(tmp_path, mpt):
    """YAML 1.1 reads 2:4 as the base-60 number 124; a config file's range stays a range."""
    path = tmp_path / "run.yaml"
    path.write_text("nodes: 2:4\nglobal-batch-size: 12\nmaster-port: 29555\n")
    code, out, err = mpt("launch", "--config", str(path), "--dry-run", SCRIPT)
    assert code == 0, err
    assert "4 node(s), 4 process(es): global batch 12 = 4 process(es) x 3 per micro-batch" in out


def test_an_elastic_pipeline_lists_a_stage_count_for_the_worlds_its_stages_do_not_divide(mpt):
    flags = ("launch", "--nodes", "3:4", "--backend", "fsdp", "--master-port", "29555",
             "--dry-run")
    code, out, err = mpt(*flags, "--pipeline-stages", "2", SCRIPT)
    assert code == 2 and "--pipeline-stages=2" in err and "at 3 node(s)" in err
    assert "--pipeline-stages 2,1" in err
    code, out, err = mpt(*flags, "--pipeline-stages", "2,1", SCRIPT)
    assert code == 0, err
    assert "3 node(s), 3 process(es) (3 rank(s) sharding the state)" in out
    assert "4 node(s), 4 process(es) (2 pipeline stage(s) x 2 rank(s) sharding the state)" in out


@pytest.mark.parametrize(("text", "words"), [
    ("gpus: 2\nprecison: bf16-mixed\n", ["precison=bf16-mixed", "no such option", "precision"]),
    ("gpus: two\n", ["gpus=two", "whole number"]),
    ("precision: fp8\n", ["precision=fp8", "bf16-mixed"]),
    ("dry_run: maybe\n", ["dry_run=maybe"]),
    ("gpus: {a: 1}\n", ["gpus=", "one value"]),
])
def test_a_bad_key_or_value_is_one_error_naming_file_and_key(tmp_path, mpt, text, words):
    path = tmp_path / "run.yaml"
    path.write_text(text)
    code, _, err = mpt("launch", "--config", str(path), "--dry-run", SCRIPT)
    assert code == 2
    line, = err.strip().splitlines()
    assert line.startswith(f"mpt: error: {path}: ") and "Fix:" in line, line
    for word in words:
        assert word in line


@pytest.mark.parametrize(("name", "text", "words"), [
    ("run.json", "{}", ["--config=", "*.yaml"]),
    ("run.toml", "gpus = \n", ["not valid TOML"]),
    ("run.yaml", "- gpus\n", ["mapping"]),
    ("missing.yaml", None, ["cannot be read"]),
])
def test_an_unusable_file_is_one_error(tmp_path, mpt, name, text, words):
    path = tmp_path / name
    if text is not None:
        path.write_text(text)
    code, _, err = mpt("launch", "--config", str(path), SCRIPT)
    assert code == 2
    line, = err.strip().splitlines()
    for word in words:
        assert word in line


@pytest.mark.parametrize("name", ["mpt.yaml", "mpt.toml"])
def test_init_writes_a_template_launch_accepts_and_never_overwrites(tmp_path, mpt, name):
    path = tmp_path / name
    code, _, err = mpt("config", "init", str(path))
    assert code == 0, err
    text = path.read_text()
    # generated from the launch command: every option with its help, incl. this part's knobs
    for option in ("gpus", "precision", "master_port", "global_batch_size", "lr_scaling"):
        assert f"\n{option}" in text or f"\n# {option}" in text, option
    assert "# Processes per node" in text
    code, out, err = mpt("launch", "--config", str(path), "--dry-run", SCRIPT)
    assert code == 0, err
    assert "on 1 process(es): backend ddp, precision fp32" in plan_title(out)
    path.write_text("keep me")
    code, _, err = mpt("config", "init", str(path))
    assert code == 2 and "already exists" in err
    assert path.read_text() == "keep me"


def test_the_real_command_prints_one_line_and_exits_2(tmp_path):
    path = tmp_path / "run.yaml"
    path.write_text("nodes: 2\nnr: 5\n")
    result = run_mpt("launch", "--config", str(path), SCRIPT)
    assert result.returncode == 2
    assert result.stderr.startswith(f"mpt: error: {path}: nr=5 is invalid")
    assert result.stderr.count("\n") == 1 and "Traceback" not in result.stderr
