"""horovodrun's own lines without --log-dir: held back where the ranks spoke (mpt's summary says
which rank failed), shown where none did (horovodrun could not start them)."""

from __future__ import annotations

import io
import shutil
import sys
from pathlib import Path

import pytest
from conftest import run_mpt

from mpt.launchers.horovodrun_output import RankOutput

REPORT = ["Process 0 exit with status code 2.\n", "Terminating remaining workers after failure "
          "of Process 0.\n", "Process name: 0\n", "Exit code: 2\n"]


def test_its_report_is_held_back_once_a_rank_has_spoken():
    console, output = io.StringIO(), RankOutput(None)
    for line in ["[0]<stderr>:mpt: error: refused\n", *REPORT]:
        output.write(line, console)
    output.close()
    assert console.getvalue() == "[0]<stderr>:mpt: error: refused\n"


def test_the_shells_report_of_a_rank_it_stopped_is_held_back_with_its_own_lines():
    console, output = io.StringIO(), RankOutput(None)
    for line in ["[0]<stderr>:mpt: error: refused\n", "[1]<stderr>:Terminated\n",
                 "[1]<stderr>:Killed\n", *REPORT]:
        output.write(line, console)
    output.close()
    assert console.getvalue() == "[0]<stderr>:mpt: error: refused\n"


def test_its_lines_are_all_there_is_when_no_rank_spoke():
    out, err, output = io.StringIO(), io.StringIO(), RankOutput(None)
    output.write("ssh: connect to host h1 port 22: Connection refused\n", err)
    output.write("horovodrun: all hosts unreachable\n", out)
    output.close()
    assert err.getvalue().startswith("ssh: connect") and out.getvalue().startswith("horovodrun")


@pytest.mark.skipif(shutil.which("horovodrun", path=str(Path(sys.executable).parent)) is None,
                    reason="`make` installs horovod into .venv")
def test_a_refusal_on_every_rank_under_horovodrun_is_one_error_and_one_summary(tmp_path):
    script = tmp_path / "refused.py"
    script.write_text("import torch\nimport mpt\n\nrt = mpt.Runtime(quiet=True)\n"
                      "model = torch.nn.Linear(4, 4)\n"
                      "rt.setup(model, torch.optim.Adam(model.parameters(), eps=1e-8))\n")
    result = run_mpt("horovodrun", "--precision", "O3", "-np", "2", "-H", "localhost:2",
                     "--gloo", sys.executable, str(script), timeout=180)
    assert result.returncode == 2, result.stderr
    lines = (result.stdout + result.stderr).splitlines()
    errors = [line for line in lines if "mpt: error: optimizer eps=1e-08" in line]
    assert len(errors) == 1 and len(lines) == 2, lines
    assert lines[-1].startswith("mpt: rank ") and "exited with code 2" in lines[-1]
