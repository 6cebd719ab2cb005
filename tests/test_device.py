import os

import pytest

from frontier.config import ConfigError
from frontier.device import resolve_device


def test_logical_core_setting_reaches_the_neuron_runtime(monkeypatch):
    monkeypatch.delenv("NEURON_LOGICAL_NC_CONFIG", raising=False)
    resolve_device("cpu", "fp32", neuron_logical_cores=2)
    assert os.environ["NEURON_LOGICAL_NC_CONFIG"] == "2"


def test_auto_falls_back_to_the_cpu_here():
    device = resolve_device("auto", "bf16")
    assert device.kind == "cpu" and device.autocast_dtype is not None


@pytest.mark.parametrize("name, missing", [("cuda", "no CUDA GPU"), ("neuron", "no Trainium device")])
def test_an_absent_accelerator_is_a_clear_error(name, missing):
    with pytest.raises(ConfigError, match=f"device='{name}' is not available: .*{missing}"):
        resolve_device(name, "bf16")
