"""A missing, truncated or foreign checkpoint is one sentence naming the file, wherever it is read."""
from dataclasses import asdict

import pytest
import torch

from frontier.checkpoint import CheckpointError, load_for_eval, read_checkpoint, save_final
from frontier.config import ConfigError, ModelConfig
from frontier.model import GPT
from tests.conftest import command_in_process


class _Tokenizer:  # save_final needs only these two
    path = None

    def fingerprint(self):
        return "test"


@pytest.fixture
def final_pt(tmp_path):
    """A real, tiny final.pt."""
    config = ModelConfig(depth=1, d_model=32, n_head=2, seq_len=16)
    path = tmp_path / "run" / "final.pt"
    save_final(path, GPT(config, 64), {"model": asdict(config)}, _Tokenizer())
    return path


def truncated(path):
    data = path.read_bytes()
    path.write_bytes(data[:len(data) // 2])
    return path


def foreign(path):
    torch.save({"state_dict": {"w": torch.zeros(2)}}, path)  # someone else's torch file
    return path


def not_torch(path):
    path.write_text("this is not a checkpoint\n")
    return path


def empty(path):
    path.write_bytes(b"")
    return path


DAMAGE = [
    (truncated, "it is truncated, damaged or not a torch checkpoint"),
    (empty, "it is truncated, damaged or not a torch checkpoint (EOFError"),
    (not_torch, "it is truncated, damaged or not a torch checkpoint"),
    (foreign, "it is not a frontier checkpoint (it holds keys state_dict"),
]


@pytest.mark.parametrize("damage, reason", DAMAGE, ids=[d.__name__ for d, _ in DAMAGE])
def test_read_checkpoint_names_the_file_and_the_key(final_pt, damage, reason):
    damage(final_pt)
    with pytest.raises(CheckpointError) as caught:
        read_checkpoint(final_pt, "resume=")
    assert str(caught.value).startswith(f"resume={final_pt} is not allowed: {reason}")
    assert isinstance(caught.value, ConfigError) and "\n" not in str(caught.value)


def test_read_checkpoint_refuses_what_is_not_a_file(tmp_path):
    with pytest.raises(CheckpointError, match="the file does not exist"):
        read_checkpoint(tmp_path / "final.pt", "checkpoint=")
    with pytest.raises(CheckpointError, match="it is not a file"):
        read_checkpoint(tmp_path, "checkpoint=")


def test_load_for_eval_refuses_a_truncated_final_pt(final_pt):
    assert read_checkpoint(final_pt, "checkpoint=")["format"] == 1
    truncated(final_pt)
    with pytest.raises(CheckpointError, match=f"checkpoint={final_pt} is not allowed: it is truncated"):
        load_for_eval(final_pt)


@pytest.mark.parametrize("damage, reason", DAMAGE, ids=[d.__name__ for d, _ in DAMAGE])
def test_eval_command_refuses_a_damaged_final_pt(final_pt, damage, reason):
    damage(final_pt)
    result = command_in_process("frontier.eval", [f"checkpoint={final_pt}", "device=cpu", "tracking.enabled=false"])
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"error: checkpoint={final_pt} is not allowed: {reason}" in result.stderr.strip().splitlines()[-1]


@pytest.mark.parametrize("damage, reason", DAMAGE, ids=[d.__name__ for d, _ in DAMAGE])
def test_resume_refuses_a_damaged_resume_pt(tmp_path, final_pt, damage, reason):
    resume_pt = damage(final_pt.rename(final_pt.with_name("resume.pt")))
    result = command_in_process("frontier.train", [f"resume={resume_pt.parent}", f"hydra.run.dir={tmp_path / 'new'}"])
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert f"error: resume={resume_pt} is not allowed: {reason}" in result.stderr.strip().splitlines()[-1]


def resume_pt_of(run_dir, **state):
    """A resume.pt holding every key a resume reads, empty but for `state`."""
    from frontier.trainer import RESUME_KEYS

    run_dir.mkdir()
    torch.save({**{key: {} for key in RESUME_KEYS}, **state}, run_dir / "resume.pt")


def test_resume_refuses_a_resume_pt_of_the_earlier_optimizer_layout(tmp_path):
    """A resume.pt saved without "format": its optimizers were not yet torch.optim's, and their groups
    have no `initial_lr` for the schedule; refused before the run builds anything."""
    run_dir = tmp_path / "run"
    resume_pt_of(run_dir, config={"model": {"depth": 2}})
    result = command_in_process("frontier.train", [f"resume={run_dir}", f"hydra.run.dir={tmp_path / 'new'}"])
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1] == (
        f"error: resume={run_dir / 'resume.pt'} is not allowed: it has format 1, this version reads format 2 "
        "(its optimizer state is laid out otherwise); start the run again without resume=")
    assert sorted(path.name for path in run_dir.iterdir()) == ["resume.pt"]


def test_resume_refuses_a_resume_pt_whose_config_is_not_this_versions(tmp_path):
    from frontier.trainer import RESUME_FORMAT

    run_dir = tmp_path / "run"
    # a later version's config, or an edited file
    resume_pt_of(run_dir, format=RESUME_FORMAT, config={"model": {"depth": 2, "no_such_knob": 1}})
    result = command_in_process("frontier.train", [f"resume={run_dir}", f"hydra.run.dir={tmp_path / 'new'}"])
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stderr.strip().splitlines()[-1].startswith(
        f"error: resume={run_dir / 'resume.pt'} is not allowed: its saved config does not fit this version's schema")
    assert sorted(path.name for path in run_dir.iterdir()) == ["resume.pt"]  # the run's own records untouched
