"""JAXPG_HANG_REPORT_SECONDS: how often a waiting collective says what it waits for (the
lines themselves are checked across processes: tests/multiprocess/test_hang_report_mp.py)."""

import pytest

from jaxpg.supervision import hang_report


@pytest.mark.parametrize("value, seconds", [(None, 60.0), ("", 60.0), ("2.5", 2.5),
                                            ("0", None)])
def test_interval_reads_the_environment(monkeypatch, value, seconds):
    if value is None:
        monkeypatch.delenv(hang_report.ENV, raising=False)
    else:
        monkeypatch.setenv(hang_report.ENV, value)
    assert hang_report.interval() == seconds


@pytest.mark.parametrize("value", ["soon", "-1", "nan"])
def test_a_bad_interval_is_named(monkeypatch, value):
    monkeypatch.setenv(hang_report.ENV, value)
    with pytest.raises(ValueError, match=rf"JAXPG_HANG_REPORT_SECONDS='{value}'"):
        hang_report.interval()


def test_off_reports_nothing(monkeypatch, capsys):
    monkeypatch.setenv(hang_report.ENV, "0")
    reporter = hang_report.Reporter(None, 10.0)
    reporter.poll(hang_report.Call(object(), "all_reduce", 3))  # would fail if it looked
    assert capsys.readouterr().err == ""
