"""Every kind of bad input stops before training with one clear sentence and a non-zero exit."""
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from tests.conftest import FAST, run_cli


@pytest.mark.parametrize("override, message", [
    ("model=huge", "Could not find 'model/huge'"),
    ("model.heads=4", "Key 'heads' not in 'ModelConfig'"),
    ("model.depth=ten", "Value 'ten' of type 'str' could not be converted to Integer"),
    ("model.depth=-1", "model.depth=-1 is not allowed: must be a positive integer"),
    ("schedule.warmdown_fraction=1.5", "schedule.warmdown_fraction=1.5 is not allowed: must be between 0 and 1"),
    ("model.n_head=3", "model.d_model=128 is not allowed: must be divisible by model.n_head=3"),
    ("optim=sgd", "Could not find 'optim/sgd'"),
    ("train.batch_tokens=1000", "train.batch_tokens=1000 is not allowed: must be a multiple of model.seq_len=256"),
    ("data.path=/no/such/folder", "data.path='/no/such/folder' does not exist"),
    ("data.path=", "data.path='' is not allowed: set it to a directory or file of text"),
    ("device=cuda", "device='cuda' is not available"),
    ("precision=fp8", "precision='fp8' is not allowed: choose one of auto, bf16, fp32"),
    ("neuron_logical_cores=3", "neuron_logical_cores=3 is not allowed: 1 (8 logical cores per Trainium2 chip)"),
])
def test_bad_input_is_one_clear_sentence(override, message):
    result = run_cli([*FAST, override, "budget.max_steps=1"])
    assert result.returncode != 0
    assert message in result.stderr, result.stderr
    assert "Traceback" not in result.stderr


def test_a_data_file_without_text_column_names_the_file(tmp_path):
    for s in range(2):
        pq.write_table(pa.table({"body": ["words"] * 3}), tmp_path / f"shard_{s:05d}.parquet")
    result = run_cli([*FAST, f"data.path={tmp_path}", f"data.cache_dir={tmp_path / 'cache'}"])
    assert result.returncode == 2
    assert f"error: {tmp_path / 'shard_00000.parquet'} has no 'text' column" in result.stderr
    assert "Traceback" not in result.stderr
