"""Each CPU replica's cores (pure)."""

from __future__ import annotations

import pytest

from serving.placement import bind_value, core_list, replica_cores


@pytest.mark.parametrize(
    ("rank", "threads", "sharing", "host", "value"),
    [
        (0, None, 2, [0, 1], "0"),
        (1, None, 2, [0, 1], "1"),
        (0, None, 1, [0, 1], "0-1"),  # one replica on the host: all its cores
        (2, None, 2, [0, 1], "0"),  # more replicas than the host takes: they share, round robin
        (1, 2, 4, [0, 1, 2, 3, 4, 5, 6, 7], "2-3"),
        (1, None, 3, [0, 1, 2, 3, 4, 5, 6], "2-3"),  # 7 cores, 3 replicas: 2 each, one left
        (0, 4, 1, [4, 5, 6, 7], "4-7"),  # the cores the process may use, not from 0
        (0, 8, 1, [0, 1], "0-1"),
    ],
)
def test_replicas_get_cores_of_their_own(rank: int, threads: int | None, sharing: int, host: list, value: str) -> None:
    assert bind_value("cores", rank, threads, sharing, host) == value


def test_other_bindings_are_vllms() -> None:
    assert bind_value("auto", 1, None, 2, [0, 1]) == "auto"
    assert bind_value("nobind", 0, 1, 2, [0, 1]) == "nobind"
    assert core_list([0, 2, 3]) == "0,2,3" and core_list([5]) == "5" and replica_cores(3, 1, [0, 1]) == [1]
