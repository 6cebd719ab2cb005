import time

from frontier.budget import BudgetClock
from frontier.config import BudgetConfig


def test_excluded_steps_are_forgiven_up_to_the_cap():
    clock = BudgetClock(BudgetConfig(seconds=100, excluded_steps=2, startup_cap_seconds=5))
    clock.add_step(3.0)  # excluded
    clock.add_step(4.0)  # excluded, but only 2 s remain under the cap: 2 s charged
    clock.add_step(1.0)  # charged
    assert clock.excluded == 5.0
    assert clock.charged == 3.0
    assert clock.progress == 0.03


def test_time_outside_steps_is_not_charged():
    clock = BudgetClock(BudgetConfig(seconds=10, excluded_steps=0))
    with clock.step():
        time.sleep(0.05)
    time.sleep(0.2)  # an evaluation between steps
    with clock.step():
        time.sleep(0.05)
    assert 0.1 <= clock.charged < 0.2


def test_done_at_the_budget_or_at_max_steps():
    clock = BudgetClock(BudgetConfig(seconds=1.0, excluded_steps=0))
    clock.add_step(0.6)
    assert not clock.done
    clock.add_step(0.6)
    assert clock.done and clock.progress == 1.0
    steps = BudgetClock(BudgetConfig(seconds=1e6, excluded_steps=0, max_steps=4))
    for _ in range(2):
        steps.add_step(0.1)
    assert steps.progress == 0.5 and not steps.done
    for _ in range(2):
        steps.add_step(0.1)
    assert steps.done


def test_synchronises_the_device_around_each_step():
    calls = []
    clock = BudgetClock(BudgetConfig(), synchronize=lambda: calls.append(1))
    with clock.step():
        pass
    assert len(calls) == 2
