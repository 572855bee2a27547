"""learner/servers.py: the registry of what each rollout server last said; who is behind, who is gone."""

import time

from learner.budget import SERVER_GONE_S
from learner.servers import ServerInfo, ServerRegistry


def test_wait_applied_returns_the_live_servers_still_behind():
    now = time.monotonic()
    servers = ServerRegistry(
        r0=ServerInfo(3, 0, 0, now),
        r1=ServerInfo(2, 0, 0, now),
        gone=ServerInfo(0, 0, 0, now - SERVER_GONE_S - 1),
    )
    started = time.monotonic()
    assert servers.wait_applied(3, timeout_s=0.3) == ["r1"]
    assert time.monotonic() - started >= 0.3
    servers["r1"].version = 3
    assert servers.wait_applied(3, timeout_s=60) == []
    assert servers.status_line() == "r0 v3 running 0 queued 0, r1 v3 running 0 queued 0"


def test_a_server_that_evaluates_says_so_in_its_counters():
    assert ServerInfo(1, 0, 0, 0.0, counters={"evaluating": 1}).evaluating
    assert not ServerInfo(1, 0, 0, 0.0, counters={"evaluating": 0}).evaluating
    assert ServerRegistry().status_line() == "no rollout server has said hello yet"
