"""Progress of long commands on stderr: a rich bar on a terminal, log lines elsewhere.

Pipes, files and tests get no bar (nothing to erase, nothing between the lines they parse);
they get what :func:`log_every` sends through logging instead, if anything.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager

from rich.console import Console
from rich.progress import (
    BarColumn,
    MofNCompleteColumn,
    Progress,
    SpinnerColumn,
    TextColumn,
    TimeElapsedColumn,
)

__all__ = ["Update", "bar", "log_every"]

# (done, total): total None while unknown.
Update = Callable[[int, int | None], None]


def _ignore(done: int, total: int | None) -> None:
    return None


@contextmanager
def bar(description: str, *, console: Console) -> Iterator[Update]:
    """Yield an ``update(done, total)`` that draws a bar on ``console`` if it is a terminal
    (erased when done, so what the command prints stays clean), else does nothing.
    Safe to call from several threads."""
    if not console.is_terminal:
        yield _ignore
        return
    with Progress(
        SpinnerColumn(),
        TextColumn("{task.description}"),
        BarColumn(),
        MofNCompleteColumn(),
        TimeElapsedColumn(),
        console=console,
        transient=True,
    ) as progress:
        task = progress.add_task(description, total=None)

        def update(done: int, total: int | None) -> None:
            progress.update(task, completed=done, total=total)

        yield update


def log_every(step: int, report: Callable[[int, int], None]) -> Update:
    """An ``update`` that calls ``report(done, total)`` every ``step`` items (not at 0 and
    not at the end: the caller sums up the whole itself)."""

    def update(done: int, total: int | None) -> None:
        if done and done % step == 0 and done != total:
            report(done, total or 0)

    return update
