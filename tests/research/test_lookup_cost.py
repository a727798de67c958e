"""research/lookup_cost.py, small: both ways timed on the same text (their drafts checked equal
inside), and the table printed."""

from __future__ import annotations

from research import lookup_cost


def test_both_ways_are_timed_and_the_table_has_a_row_per_context(capsys):
    first, indexed, scanned = lookup_cost.per_step_ms(300, steps=20, vocab=50)
    assert first > 0 and indexed > 0 and scanned > 0
    lookup_cost.main(["--contexts", "100,400", "--steps", "10"])
    rows = [line for line in capsys.readouterr().out.splitlines() if line.startswith("| ")]
    assert [row.split("|")[1].strip() for row in rows[1:]] == ["100", "400"]
