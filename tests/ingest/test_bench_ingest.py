"""`clora bench ingest`'s several-process sides on the real broker, tiny: K bare consumers split the
partitions and read every message once; K ingest processes in one group and one data dir write the same
rows as one process does. What it proves is that the sides measure what they say, not how fast they are."""

from __future__ import annotations

import time

import pytest

from ingest.bench import PARTITIONS, clora_ingest, in_processes, produce
from ingest.broker import ensure_topics

pytestmark = pytest.mark.integration

EVENTS = 400  # 340 interactions (260 scored), 40 feedback, 20 malformed


@pytest.fixture
def topics(broker):
    stamp = time.time_ns()
    names = {"interactions": f"bench-{stamp}.i", "feedback": f"bench-{stamp}.f", "dead": f"bench-{stamp}.d"}
    ensure_topics(broker.bootstrap, list(names.values()), PARTITIONS)
    produce(broker.bootstrap, names, EVENTS, seed=0)
    return names


def test_processes_split_the_work_and_write_what_one_process_writes(broker, topics, tmp_path):
    one = clora_ingest(broker.bootstrap, topics, tmp_path / "one")
    assert one["rows"] == {"interactions": 340, "trajectories": 260, "feedback": 40, "dead_letters": 20}

    group = in_processes("ingest", 2, broker.bootstrap, topics, tmp_path / "group")
    assert group["rows"] == one["rows"]
    assert group["messages"] == EVENTS
    # Both members had partitions: the barrier held each window until the group had settled.
    assert [m["messages"] > 0 for m in group["members"]] == [True, True]
    assert group["seconds"] >= max(m["seconds"] for m in group["members"])
    assert group["synchronised"]  # no member's window opened before the others were in the group

    bare = in_processes("bare", 2, broker.bootstrap, topics, tmp_path / "bare")
    assert bare["messages"] == EVENTS
    assert [m["messages"] > 0 for m in bare["members"]] == [True, True]
    assert bare["synchronised"]
    assert bare["rate"] > 0 and bare["cpu_us"] > 0
