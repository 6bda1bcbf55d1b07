"""The benchmark and demo tables (``aiocache_kv.bench.report``): fitted to a terminal, plain
text anywhere else."""

from __future__ import annotations

import io

import pytest

from aiocache_kv.bench.report import heading, table

HEADERS = ["chat", "prompt", "TTFT no cache ms", "speedup"]
ROWS = [["chat A", 160, "12.3", "[bold]x[/] :smile:"], ["chat B", 12345, "1.0", "1.0x"]]


class FakeTerminal(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_plain_text_when_not_a_terminal(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("FORCE_COLOR", "1")  # still no escape codes in a pipe
    monkeypatch.setenv("COLUMNS", "20")  # and no wrapping
    out = io.StringIO()
    table(HEADERS, ROWS, out=out)
    lines = out.getvalue().splitlines()
    assert len(lines) == 4 and "\x1b" not in out.getvalue()
    assert lines[0].split() == ["chat", "prompt", "TTFT", "no", "cache", "ms", "speedup"]
    assert set(lines[1]) == {"-", " "}
    assert lines[2].split() == ["chat", "A", "160", "12.3", "[bold]x[/]", ":smile:"]  # verbatim
    assert lines[3].split() == ["chat", "B", "12345", "1.0", "1.0x"]
    assert all(line == line.rstrip() for line in lines)
    # the first column is left-aligned, the others right-aligned (default align)
    assert lines[2].startswith("chat A") and lines[3].index("12345") < lines[2].index("160")


def test_align_and_heading() -> None:
    out = io.StringIO()
    heading("section", out=out)
    table(["event", "medium", "n"], [["BlockStored", "GPU", 3]], out=out, align="llr")
    assert out.getvalue().splitlines()[:2] == ["", "== section =="]
    assert out.getvalue().splitlines()[-1].split() == ["BlockStored", "GPU", "3"]
    with pytest.raises(ValueError):
        table(["a", "b"], [[1, 2]], out=io.StringIO(), align="l")


def test_a_terminal_table_fits_its_width(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("COLUMNS", "40")
    out = FakeTerminal()
    wide = [[f"chat {i}", 100 * i, "12.3", "long cell " * 3] for i in range(3)]
    table(HEADERS, wide, out=out)
    text = out.getvalue()
    assert "\x1b[1m" in text  # bold headers on a terminal
    plain = [line for line in _strip_ansi(text).splitlines() if line.strip()]
    assert plain and max(len(line) for line in plain) <= 40


def _strip_ansi(text: str) -> str:
    import re

    return re.sub(r"\x1b\[[0-9;]*m", "", text)
