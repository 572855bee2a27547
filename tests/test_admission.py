"""Admission control: the rule of PROCESSES.md, checked as arithmetic and as a simulated run."""
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from rollout_server.admission import Admission


def test_without_replies_the_budget_is_staleness_plus_one_batches():
    adm = Admission(max_staleness=2, batch_prompts=4)
    started = 0
    while adm.room():
        adm.admit()
        started += 1
    assert started == 12
    with pytest.raises(RuntimeError, match="room for 0"):
        adm.admit()


def test_reply_with_progress_reopens_admission():
    adm = Admission(max_staleness=0, batch_prompts=2)
    adm.admit(2)
    assert adm.room() == 0
    adm.on_reply(version=0, accepted=2, received=2)  # received and buffered, not yet used
    assert adm.in_flight == 0 and adm.room() == 0
    adm.on_reply(version=1, accepted=2, received=2)  # one step done: one more batch is useful
    assert adm.room() == 2


def test_accepted_counts_other_servers_groups():
    adm = Admission(max_staleness=1, batch_prompts=3)
    adm.on_reply(version=0, accepted=5, received=0)  # five groups came from elsewhere
    assert adm.used == 5 and adm.room() == 1


def test_learner_reporting_more_than_sent_never_widens_the_budget():
    adm = Admission(max_staleness=1, batch_prompts=2)
    adm.admit(1)
    adm.on_reply(version=0, accepted=0, received=9)
    assert adm.in_flight == 0 and adm.room() == 4


def test_bad_parameters_are_one_clear_error():
    with pytest.raises(ValueError, match="batch_prompts >= 1"):
        Admission(max_staleness=0, batch_prompts=0)


@settings(max_examples=200, deadline=None)
@given(staleness=st.integers(0, 3), batch=st.integers(1, 5),
       script=st.lists(st.sampled_from(["gen", "recv", "step"]), max_size=80))
def test_simulated_learner_never_sees_more_than_the_budget(staleness, batch, script):
    """A greedy server against a learner that receives, accepts and steps in any order."""
    adm = Admission(staleness, batch)
    sent = received = accepted = used = version = 0
    for action in script:
        if action == "gen":
            n = adm.room()
            adm.admit(n)
            sent += n
        elif action == "recv" and received < sent:
            received += 1
            accepted += 1
        elif action == "step" and accepted - used >= batch:
            used += batch
            version += 1
        adm.on_reply(version, accepted, received)
        # every group ever started fits the staleness window of the current version
        assert adm.admitted <= (staleness + version + 1) * batch
