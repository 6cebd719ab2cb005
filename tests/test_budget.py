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
    time.sleep(1.0)  # an evaluation between steps: far longer than a busy machine oversleeps the steps
    with clock.step():
        time.sleep(0.05)
    assert 0.1 <= clock.charged < 0.5


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


def test_each_launch_forgives_its_own_startup_steps():
    cfg = BudgetConfig(seconds=100, excluded_steps=2, startup_cap_seconds=5)
    first = BudgetClock(cfg)
    for seconds in (3.0, 1.0, 1.0):  # two compilation steps, one charged
        first.add_step(seconds, tokens=100)
    resumed = BudgetClock(cfg)  # a new process: `resume=` recompiles, and is forgiven again
    resumed.load_state_dict(first.state_dict())
    for seconds in (4.0, 2.0, 1.0):
        resumed.add_step(seconds, tokens=100)
    assert resumed.excluded_per_launch == [4.0, 5.0] and resumed.excluded == 9.0
    assert resumed.charged == 1.0 + 1.0 + 1.0  # 1 s of the second launch's step 2 was past the cap
    assert resumed.steps == 6


def test_throughput_counts_only_the_charged_part_of_each_step():
    clock = BudgetClock(BudgetConfig(seconds=100, excluded_steps=2, startup_cap_seconds=5))
    clock.add_step(4.0, tokens=100)  # forgiven
    clock.add_step(2.0, tokens=100)  # 1 s forgiven, 1 s charged: half its tokens count
    clock.add_step(1.0, tokens=100)
    assert clock.charged == 2.0 and clock.charged_tokens == 150.0


def test_the_clock_keeps_the_cpu_time_of_charged_steps_and_resumes_it():
    clock = BudgetClock(BudgetConfig(seconds=10, excluded_steps=1, startup_cap_seconds=5))
    clock.add_step(2.0, tokens=100, cpu_seconds=4.0)  # forgiven: neither its time nor its CPU time is charged
    clock.add_step(1.0, tokens=100, cpu_seconds=1.5)
    assert clock.charged_cpu == 1.5
    resumed = BudgetClock(clock.cfg)
    resumed.load_state_dict(clock.state_dict())
    assert resumed.charged_cpu == 1.5
