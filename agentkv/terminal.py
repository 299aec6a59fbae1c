"""What every command does the same way at the terminal: tables that never cut a number, and a
first Ctrl-C that asks long work to stop at a safe point (a second stops at once)."""

from __future__ import annotations

import signal
import sys
import threading

from rich.cells import cell_len
from rich.console import Console
from rich.table import Table
from rich.text import Text

EXIT_INTERRUPTED = 130  # a run stopped by Ctrl-C (what finished is written), as a shell reports SIGINT


def compact(x: float) -> str:
    """A count in a few characters (950, 21.3k, 4.87M, 1.02B), for cells that must stay narrow."""
    for unit, div in (("B", 1e9), ("M", 1e6), ("k", 1e3)):
        if abs(x) >= div:
            return f"{x / div:.3g}{unit}"
    return f"{x:.3g}" if x != int(x) else f"{int(x)}"


def _lines(cells: list) -> list[str]:
    """The plain text lines of table cells (markup read, renderables that are not text skipped)."""
    out = []
    for c in cells:
        text = Text.from_markup(c) if isinstance(c, str) else c
        if isinstance(text, Text):
            out.extend(text.plain.splitlines())
    return out


def _width(cells: list) -> int:
    return max((cell_len(x) for x in _lines(cells)), default=0)


_WHOLE = 24  # number cells up to this wide stay on one line; longer ones (a reason, a list) wrap


def _longest_word(cells: list) -> int:
    return max((cell_len(w) for x in _lines(cells) for w in x.split()), default=1)


def fit(table: Table, width: int) -> int:
    """Fix every column's width for a console `width` wide: number (right-justified) columns keep
    every cell whole (a header wider than its numbers, or a long text cell, wraps at spaces), text
    columns share what is left and fold, down to their longest word (at most 20). No word of a
    number column is ever cut. Returns the table's width."""
    nums = [c for c in table.columns if c.justify == "right"]
    texts = [c for c in table.columns if c.justify != "right"]
    for col in nums:
        widest = max((n for n in (_width([c]) for c in col.cells) if n <= _WHOLE), default=0)
        head = col.header if isinstance(col.header, str) else ""
        if "\n" in head:  # a header already in lines keeps them
            widest = max(widest, _width([head]))
        elif _width([head]) > widest:  # one line wider than the numbers: a word a line
            col.header = head.replace(" ", "\n")
        col.overflow, col.width = "fold", max(widest, _longest_word([col.header, *col.cells]))
    pad = table.padding[1] + table.padding[3]
    used = (pad + 1) * len(table.columns) + 1 + sum(c.width for c in nums)  # borders and padding
    left = max(0, width - used)
    for i, col in enumerate(texts):
        natural = max(1, _width([col.header, *col.cells]))
        least = min(20, _longest_word([col.header, *col.cells]))
        col.no_wrap, col.overflow = False, "fold"
        col.width = max(least, min(natural, left // (len(texts) - i)))
        left -= col.width
    return used + sum(c.width for c in texts)


def show(console: Console, table: Table) -> None:
    """Print `table` at the console's width, or wider when its numbers need more room (the terminal
    then wraps the line): a figure is never cut to `1,405,52…`, on a terminal or piped."""
    width = console.width
    need = fit(table, width)
    if need > width:  # drop the cells' side padding (borders still part them) before going wider
        table.padding = (0, 0)
        need = fit(table, width)
    if need <= width:
        console.print(table)
        return
    console.width = need  # print() caps its width at the console's
    try:
        console.print(table, crop=False)
    finally:
        console.width = width


def progress_bar(console: Console, label: str = "{task.description}", visible: bool = True):
    """The progress bar of long work: label, bar, done/total, elapsed and ETA (`visible=False`: silent)."""
    from rich.progress import (
        BarColumn,
        MofNCompleteColumn,
        Progress,
        TextColumn,
        TimeElapsedColumn,
        TimeRemainingColumn,
    )

    columns = (TextColumn(label), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), TextColumn("ETA"))
    return Progress(*columns, TimeRemainingColumn(), console=console, transient=True, disable=not visible)


def ignore_sigint() -> None:
    """In a worker process: leave Ctrl-C to the parent, which decides what to keep."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)


class StopRequest:
    """`with StopRequest(note) as stop:` the first SIGINT sets `stop.requested` (and prints `note`
    on stderr) so the work can finish or drop the item in hand and write what is done; a second
    raises KeyboardInterrupt. Installed even when the shell started us with SIGINT ignored (a
    background job), as bench does; a no-op off the main thread."""

    def __init__(self, note: str = "") -> None:
        self.note, self.requested, self._old = note, False, None
        self._event = threading.Event()

    def _on_signal(self, signum, frame) -> None:
        if self.requested:
            raise KeyboardInterrupt
        self.requested = True
        self._event.set()
        if self.note:
            print(self.note, file=sys.stderr, flush=True)

    def wait(self, timeout: float) -> bool:
        """Sleep up to `timeout` s, waking early on a stop request; True when one came."""
        return self._event.wait(timeout)

    def __enter__(self) -> StopRequest:
        if threading.current_thread() is threading.main_thread():
            self._old = signal.signal(signal.SIGINT, self._on_signal)
        return self

    def __exit__(self, *exc) -> None:
        if self._old is not None:
            signal.signal(signal.SIGINT, self._old)
            self._old = None
