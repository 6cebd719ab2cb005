"""A command forked by tests/zygote.py behaves as the same command started as a new interpreter."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

from tests import zygote
from tests.conftest import FAST, ROOT

pytestmark = pytest.mark.skipif(subprocess.Popen is not zygote.ForkedPopen,
                                reason="commands run as new interpreters here (FRONTIER_TEST_FORK=0)")


def both(args: list[str], **kwargs) -> tuple[subprocess.CompletedProcess, subprocess.CompletedProcess]:
    """`python -m ARGS` forked, then as a new interpreter: the forked one must have been forked."""
    command = [sys.executable, "-m", *args]
    kwargs = {"env": zygote._SERVER.env, **kwargs}  # whatever an earlier test in this worker set
    forked = zygote.ForkedPopen(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    assert forked._zygote is not None, f"not forked: {forked.not_forked}"
    out, err = forked.communicate(timeout=300)
    new = zygote._ORIGINAL_POPEN(command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, **kwargs)
    new_out, new_err = new.communicate(timeout=300)
    return (subprocess.CompletedProcess(command, forked.returncode, out, err),
            subprocess.CompletedProcess(command, new.returncode, new_out, new_err))


@pytest.mark.parametrize("args", [
    ["frontier.train", "model=tiny", "--cfg", "job"],  # prints, exit 0
    ["frontier.train", "model.depth=-1"],  # one sentence, exit 2
    ["frontier.tracking", "sync"],  # a usage line, exit 2
], ids=["prints", "refuses", "usage"])
def test_a_forked_command_prints_and_exits_as_a_new_interpreter(args):
    forked, new = both(args)
    assert (forked.returncode, forked.stdout, forked.stderr) == (new.returncode, new.stdout, new.stderr)


def test_a_forked_run_is_a_process_of_its_own_that_a_signal_stops(tmp_path):
    """Its own pid and session (start_new_session), SIGTERM handled by the run as at a terminal: exit 130."""
    args = [sys.executable, "-m", "frontier.train", *FAST, "budget.seconds=600", f"hydra.run.dir={tmp_path / 'run'}"]
    process = subprocess.Popen(args, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               start_new_session=True, env=zygote._SERVER.env)
    assert process._zygote is not None, f"not forked: {process.not_forked}"
    assert os.getpgid(process.pid) == process.pid != os.getpid()
    deadline = time.time() + 300
    while not (tmp_path / "run" / "metrics.jsonl").exists() and time.time() < deadline and process.poll() is None:
        time.sleep(0.2)
    os.killpg(process.pid, signal.SIGTERM)
    out, _ = process.communicate(timeout=300)
    assert process.returncode == 130, out[-2000:]
    assert (tmp_path / "run" / "resume.pt").exists()


@pytest.mark.parametrize("change", ["PYTHONPATH", "OMP_NUM_THREADS", "cwd", "preexec_fn"])
def test_a_command_whose_start_could_differ_runs_as_a_new_interpreter(tmp_path, change):
    kwargs = {"env": dict(zygote._SERVER.env), "cwd": ROOT}
    if change == "cwd":
        kwargs["cwd"] = tmp_path
    elif change == "preexec_fn":
        kwargs["preexec_fn"] = os.getpid
    else:
        kwargs["env"][change] = "7"
    process = subprocess.Popen([sys.executable, "-m", "frontier.train", "--help"], stdout=subprocess.DEVNULL, **kwargs)
    assert process._zygote is None and process.not_forked
    assert process.wait(timeout=300) == 0
