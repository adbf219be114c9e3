"""The autoscaler's decision and what it reads, the prefetch that follows the size, ``--autoscale``."""

from __future__ import annotations

import asyncio

import pytest

from broker_svc import Settings
from broker_svc.errors import ConfigurationError
from worker.config import WorkerConfig, parse_autoscale, prefetch_for
from worker.pool.autoscale import decide
from worker.pool.demand import BacklogDemand, Load


def in_1_to_4(*, size: int, waiting: int, spare_for_s: float) -> int:
    """``decide`` for ``--autoscale 4,1 --autoscale-keepalive 30``."""
    return decide(size=size, waiting=waiting, spare_for_s=spare_for_s, minimum=1, maximum=4, keepalive_s=30.0)


def test_waiting_deliveries_grow_the_pool_by_as_many_at_once_up_to_max():
    assert in_1_to_4(size=1, waiting=1, spare_for_s=0) == 2
    assert in_1_to_4(size=1, waiting=2, spare_for_s=0) == 3
    assert in_1_to_4(size=2, waiting=10, spare_for_s=0) == 4
    assert in_1_to_4(size=4, waiting=10, spare_for_s=0) == 4


def test_a_child_spare_for_the_keepalive_is_retired_one_at_a_time_down_to_min():
    assert in_1_to_4(size=4, waiting=0, spare_for_s=29.9) == 4
    assert in_1_to_4(size=4, waiting=0, spare_for_s=30.0) == 3
    assert in_1_to_4(size=2, waiting=0, spare_for_s=300) == 1
    assert in_1_to_4(size=1, waiting=0, spare_for_s=300) == 1


def test_waiting_deliveries_win_over_an_old_spare_timer():
    assert in_1_to_4(size=3, waiting=1, spare_for_s=300) == 4


def test_a_size_outside_a_new_range_is_moved_into_it_at_once():
    assert decide(size=1, waiting=0, spare_for_s=0, minimum=3, maximum=6, keepalive_s=30) == 3
    assert decide(size=5, waiting=3, spare_for_s=0, minimum=1, maximum=2, keepalive_s=30) == 2


def test_the_pool_keeps_one_child_when_min_is_zero():
    assert decide(size=1, waiting=0, spare_for_s=300, minimum=0, maximum=4, keepalive_s=30) == 1


def test_prefetch_is_children_times_threads_times_multiplier():
    assert prefetch_for(3, multiplier=1) == 3
    assert prefetch_for(3, multiplier=4) == 12
    assert prefetch_for(2, multiplier=2, threads=4) == 16


@pytest.mark.parametrize(
    ("text", "expected"),
    [("10,3", (10, 3)), ("3,10", (10, 3)), ("4", (4, 0)), (" 4 , 1 ", (4, 1)), ("2,2", (2, 2))],
)
def test_autoscale_reads_celerys_max_comma_min(text: str, expected: tuple[int, int]):
    assert parse_autoscale(text) == expected


@pytest.mark.parametrize("text", ["", "a", "4,b", "1,2,3", "0", "-1,3", "4,-1"])
def test_a_malformed_autoscale_is_refused(text: str):
    with pytest.raises(ValueError, match="autoscale|integers|MAX"):
        parse_autoscale(text)


def test_the_config_checks_the_autoscale_range_and_starts_inside_it():
    settings = Settings()
    config = WorkerConfig(app_spec="m:app", settings=settings, concurrency=1, autoscale=(4, 1))
    assert config.prefetch_count == 1  # each child its own prefetch: no headroom (worker/pool/autoscale.py)
    with pytest.raises(ValueError, match="between 1 and 4"):
        WorkerConfig(app_spec="m:app", settings=settings, concurrency=5, autoscale=(4, 1))
    with pytest.raises(ValueError, match="max >= 1"):
        WorkerConfig(app_spec="m:app", settings=settings, concurrency=1, autoscale=(1, 2))
    with pytest.raises(ValueError, match="keepalive"):
        WorkerConfig(
            app_spec="m:app", settings=settings, concurrency=1, autoscale=(4, 1), autoscale_keepalive_s=0
        )


def test_a_pool_may_autoscale_dedupe_and_run_threads():
    settings = Settings()
    config = WorkerConfig(app_spec="m:app", settings=settings, concurrency=1, autoscale=(4, 1))
    assert config.autoscale == (4, 1)
    deduping = WorkerConfig(app_spec="m:app", settings=settings, dedupe_window_s=60)
    assert deduping.dedupe_window_s == 60
    assert WorkerConfig(app_spec="m:app", settings=settings, threads=4).threads == 4
    with pytest.raises(ConfigurationError, match="at least 1"):
        WorkerConfig(app_spec="m:app", settings=settings, threads=0)


def backlog(busy: int, ready: int, threads: int = 1) -> tuple[BacklogDemand, list[int]]:
    """A ``BacklogDemand`` over fixed figures, and the list of times the queues were asked."""
    asked: list[int] = []

    async def read_ready() -> int:
        asked.append(ready)
        return ready

    return BacklogDemand(running=lambda: busy, ready=read_ready, threads=threads), asked


def test_with_consuming_children_the_ready_backlog_waits_only_while_every_child_is_busy():
    demand, asked = backlog(busy=2, ready=7)
    assert asyncio.run(demand.look(2)) == Load(busy=2, waiting=7)
    assert asyncio.run(demand.look(3)) == Load(busy=2, waiting=0)  # a free child takes the next one
    assert asked == [7]  # the queues are not asked while a child is free
    assert demand.held() == 2
    idle, asked = backlog(busy=2, ready=0)
    assert asyncio.run(idle.look(2)) == Load(busy=2, waiting=0) and asked == [0]


def test_with_threads_a_child_is_busy_when_all_its_threads_are_and_each_n_ready_make_one_child():
    demand, asked = backlog(busy=7, ready=5, threads=4)
    assert asyncio.run(demand.look(2)) == Load(busy=1, waiting=0) and asked == []  # a thread is free
    full, asked = backlog(busy=8, ready=5, threads=4)
    assert asyncio.run(full.look(2)) == Load(busy=2, waiting=2)  # 5 ready: two more children
    assert full.held() == 8
