"""Progress reporting: a rich bar on a terminal, silence in CI or when output is not a tty.

Experiments receive a :class:`Reporter` and open one task per engine run; engines call the task's
callback with (step, observation) between jitted chunks.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator

import numpy as np

TaskCallback = Callable[[int, dict], None]


class Reporter:
    """Silent reporter: the interface, and what CI and non-terminals get."""

    @contextlib.contextmanager
    def task(self, description: str, total: int) -> Iterator[TaskCallback]:
        yield lambda step, obs: None


class RichReporter(Reporter):
    """A rich progress bar per task: description, bar, step/total, current loss, ETA."""

    def __init__(self, console=None):
        from rich.console import Console

        self.console = console or Console(stderr=True)

    @contextlib.contextmanager
    def task(self, description: str, total: int) -> Iterator[TaskCallback]:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        columns = [
            TextColumn("{task.description}"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("loss {task.fields[loss]}"),
            TimeRemainingColumn(),
        ]
        with Progress(*columns, console=self.console, transient=True) as bar:
            task_id = bar.add_task(description, total=total, loss="–")

            def update(step: int, obs: dict) -> None:
                loss = obs.get("loss") if isinstance(obs, dict) else None
                shown = f"{float(np.mean(loss)):.5f}" if loss is not None else "–"
                bar.update(task_id, completed=step, loss=shown)

            yield update


def default_reporter() -> Reporter:
    """A rich bar when stderr is a terminal and CI is not set; otherwise silence."""
    if os.environ.get("CI") or not sys.stderr.isatty():
        return Reporter()
    return RichReporter()
