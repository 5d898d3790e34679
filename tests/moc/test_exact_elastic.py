"""moc._exact.elastic: the typed handover between exact managers (its wire form and how
every rank's handover becomes one)."""

from __future__ import annotations

import pytest

from moc._exact.elastic import ExactHandover


def test_handover_round_trips_through_its_wire_form():
    h = ExactHandover(last_persisted_step=12, windows_counted=5, windows_persisted=2, replays=1,
                      replayed_steps=3, replaying=True)
    assert ExactHandover.from_wire(h.to_wire()) == h
    assert ExactHandover.from_wire(ExactHandover().to_wire()).last_persisted_step is None


def test_merge_takes_the_first_ranks_counters_and_any_replay():
    a = ExactHandover(last_persisted_step=8, windows_counted=4, windows_persisted=1).to_wire()
    b = ExactHandover(last_persisted_step=8, windows_counted=4, windows_persisted=1, replaying=True).to_wire()
    assert ExactHandover.merge([None, None]) is None
    merged = ExactHandover.merge([None, a, b])
    assert merged is not None
    assert (merged.last_persisted_step, merged.windows_counted, merged.replaying) == (8, 4, True)
    only_a = ExactHandover.merge([a, None])
    assert only_a is not None and not only_a.replaying


def test_a_handover_missing_a_counter_is_refused():
    wire = ExactHandover().to_wire()
    del wire["windows_counted"]
    with pytest.raises(KeyError, match="windows_counted"):
        ExactHandover.from_wire(wire)
