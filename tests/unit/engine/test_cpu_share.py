"""`CpuShare`: one torch thread fewer for each core other processes take."""

from __future__ import annotations

import pytest

from trio_llm.engine.cpu_share import WINDOW_SECONDS, CpuShare, machine_busy_seconds


class FakeMachine:
    """A machine whose busy seconds are ours plus what the others take per second."""

    def __init__(self) -> None:
        self.now = 0.0
        self.ours = 0.0
        self.theirs = 0.0

    def run(self, seconds: float, our_cores: float, their_cores: float) -> None:
        self.now += seconds
        self.ours += seconds * our_cores
        self.theirs += seconds * their_cores

    def share(self, max_threads: int = 2, cores: int = 2) -> CpuShare:
        return CpuShare(
            max_threads,
            cores,
            busy=lambda: self.ours + self.theirs,
            own=lambda: self.ours,
            clock=lambda: self.now,
        )


def test_a_core_taken_costs_one_thread_and_comes_back() -> None:
    machine = FakeMachine()
    share = machine.share()
    assert share.recommend() == 2
    machine.run(WINDOW_SECONDS / 2, 2.0, 1.0)
    assert share.recommend() == 2  # no full window yet
    machine.run(WINDOW_SECONDS, 1.5, 1.0)  # a hog on one core
    assert share.recommend() == 1
    assert share.others == pytest.approx(1.0)
    machine.run(WINDOW_SECONDS, 1.0, 0.5)  # half a core: not enough to come back
    assert share.recommend() == 1
    machine.run(WINDOW_SECONDS, 1.0, 0.05)  # the hog is gone
    assert share.recommend() == 2


def test_small_loads_do_not_flap_and_limits_hold() -> None:
    machine = FakeMachine()
    share = machine.share()
    for their in (0.3, 0.6, 0.2, 0.5):  # the API server, a client: below the margin
        machine.run(WINDOW_SECONDS, 2.0, their)
        assert share.recommend() == 2
    machine.run(WINDOW_SECONDS, 1.0, 5.0)  # more than every core: still one thread
    assert share.recommend() == 1
    busy = FakeMachine()
    wide = busy.share(max_threads=2, cores=8)
    busy.run(WINDOW_SECONDS, 2.0, 3.0)
    assert wide.recommend() == 2  # never above the configured count


def test_without_proc_stat_the_count_stays() -> None:
    share = CpuShare(2, 2, busy=lambda: None)
    assert share.recommend() == 2


def test_this_machine_reports_busy_seconds() -> None:
    first = machine_busy_seconds()
    assert first is not None and first > 0
    total = 0
    for i in range(200_000):
        total += i
    assert machine_busy_seconds() >= first


def test_num_threads_auto_turns_it_on_and_a_count_fixes_it() -> None:
    from trio_llm.cli.main import build_parser, config_from_args

    def engine(*flags: str):
        return config_from_args(build_parser().parse_args(["serve", *flags])).engine

    # The default adapts on the CPU (issue 32), as auto does; a count fixes it.
    assert (engine().num_threads, engine().adapts_threads) == (None, True)
    assert (
        engine("--num-threads", "auto").num_threads,
        engine("--num-threads", "auto").adapts_threads,
    ) == (None, True)
    assert (
        engine("--num-threads", "3").num_threads,
        engine("--num-threads", "3").adapts_threads,
    ) == (3, False)
    with pytest.raises(SystemExit):
        build_parser().parse_args(["serve", "--num-threads", "0"])
