"""Live progress on stderr (kiln.core.progress): shown after the delay, with the stage, the
counters and the time elapsed; nothing for short work, when not a terminal, or when told not to."""

import io
import time

from kiln.core import progress as live


class _Terminal(io.StringIO):
    def __init__(self, tty: bool):
        super().__init__()
        self.tty = tty

    def isatty(self) -> bool:
        return self.tty


def test_progress_shows_the_stage_counters_and_elapsed_time_after_the_delay(monkeypatch):
    monkeypatch.setattr(live, "DELAY_S", 0.2)
    monkeypatch.setattr(live, "REDRAW_S", 0.05)
    monkeypatch.delenv("KILN_PROGRESS", raising=False)
    out = _Terminal(tty=True)
    with live.progress("kiln compile m.pt2", stream=out) as p:
        assert p is not None
        live.section("prefill")
        live.stage("search")
        live.count("regions searched", 2, 5)
        time.sleep(0.5)
        with live.progress("nested", stream=out) as inner:  # one progress at a time
            assert inner is None
    text = out.getvalue()
    assert "kiln compile m.pt2: prefill · search · regions searched 2/5 · 0 s" in text
    assert "kiln compile m.pt2: prefill · done · " in text.splitlines()[-1] or \
        "kiln compile m.pt2: prefill · done · " in text.split("\r")[-1]
    live.stage("no progress shown: nothing happens")
    live.count("x", 1, 2)


def test_progress_is_quiet_for_short_work_off_a_terminal_or_when_told(monkeypatch):
    monkeypatch.setattr(live, "REDRAW_S", 0.05)
    monkeypatch.delenv("KILN_PROGRESS", raising=False)
    short = _Terminal(tty=True)
    with live.progress("short", stream=short):  # under the 2 s delay: prints nothing
        live.stage("search")
        time.sleep(0.2)
    assert short.getvalue() == ""
    monkeypatch.setattr(live, "DELAY_S", 0.0)
    piped = _Terminal(tty=False)
    with live.progress("piped", stream=piped) as p:
        assert p is None
    monkeypatch.setenv("KILN_PROGRESS", "0")
    with live.progress("told not to", stream=_Terminal(tty=True)) as p:
        assert p is None
    monkeypatch.setenv("KILN_PROGRESS", "1")
    asked = _Terminal(tty=False)
    with live.progress("asked", stream=asked) as p:
        assert p is not None
        time.sleep(0.2)
    assert "asked" in asked.getvalue()
