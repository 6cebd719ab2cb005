import math

import pytest

from frontier.config import ScheduleConfig
from frontier.schedule import lr_multiplier, muon_momentum


@pytest.mark.parametrize("name, cfg, expected", [
    ("wsd", dict(warmup_fraction=0.0, warmdown_fraction=0.5, final_lr_fraction=0.1), (1.0, 1.0, 0.1)),
    ("wsd", dict(warmup_fraction=0.2, warmdown_fraction=0.4, final_lr_fraction=0.0), (0.0, 1.0, 0.0)),
    ("cosine", dict(warmup_fraction=0.0, final_lr_fraction=0.0), (1.0, 0.5, 0.0)),
    ("cosine", dict(warmup_fraction=0.0, final_lr_fraction=0.2), (1.0, 0.6, 0.2)),
    ("constant", dict(warmup_fraction=0.0), (1.0, 1.0, 1.0)),
])
def test_lr_multiplier_at_start_middle_and_end(name, cfg, expected):
    schedule = ScheduleConfig(name=name, **cfg)
    got = tuple(lr_multiplier(schedule, p) for p in (0.0, 0.5, 1.0))
    assert all(math.isclose(g, e, abs_tol=1e-9) for g, e in zip(got, expected)), got


def test_wsd_decays_linearly_inside_the_warmdown():
    schedule = ScheduleConfig(name="wsd", warmdown_fraction=0.5, final_lr_fraction=0.0)
    assert math.isclose(lr_multiplier(schedule, 0.75), 0.5)


def test_warmup_ramps_linearly():
    schedule = ScheduleConfig(name="constant", warmup_fraction=0.1)
    assert math.isclose(lr_multiplier(schedule, 0.05), 0.5)


def test_muon_momentum_warms_up_then_holds():
    schedule = ScheduleConfig(momentum_start=0.85, momentum_end=0.95, momentum_warmup_fraction=0.1)
    assert muon_momentum(schedule, 0.0) == 0.85
    assert math.isclose(muon_momentum(schedule, 0.05), 0.90)
    assert muon_momentum(schedule, 0.5) == 0.95
