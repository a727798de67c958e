"""RecentReplies: what an outage publishes again is the window before it, oldest first."""

from protocol import ReplyMessage
from worker.recent_replies import RecentReplies


def reply(seq: int) -> ReplyMessage:
    return ReplyMessage("r", seq, [seq])


def test_an_outage_resends_the_window_before_it_oldest_first_and_once():
    recent = RecentReplies(window_s=2.0)
    recent.published([("gw-a", reply(0))], gone=(), now=10.0)
    recent.published([("gw-a", reply(1)), ("gw-gone", reply(9))], gone={"gw-gone"}, now=11.5)
    recent.published([("gw-a", reply(2))], gone=(), now=12.5)  # reply 0 leaves the window
    assert [r.seq for _, r in recent.take(now=12.6)] == [1, 2]  # not to a gateway that is gone
    assert recent.take(now=12.7) == []  # taken once: the publish that sends them keeps them


def test_after_a_quiet_spell_an_outage_resends_nothing():
    recent = RecentReplies(window_s=2.0)
    recent.published([("gw-a", reply(0))], gone=(), now=10.0)
    assert recent.take(now=600.0) == []  # read by any gateway long ago
