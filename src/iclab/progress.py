"""Progress reporting: a rich bar on a terminal, silence in CI or when output is not a tty.

Experiments receive a :class:`Reporter` and open one task per engine run; engines call the task's
callback with (step, observation) between jitted chunks.

The callback a task yields is a :class:`TaskCallback`: callable like a plain function, and
carrying what the launcher adds for the engines' loop: a checkpoint handle (``checkpoint``, see
:mod:`iclab.checkpoint`) and whether a NaN or infinite loss stops the run (``stop_on_divergence``).
:class:`RunReporter` wraps any reporter to add them, so experiments need no change.
"""

from __future__ import annotations

import contextlib
import os
import sys
from typing import Callable, Iterator

import numpy as np

TaskUpdate = Callable[[int, dict], None]


class TaskCallback:
    """What ``reporter.task(...)`` yields: ``cb(step, observation)`` updates the progress display.

    Attributes:
        checkpoint: a :class:`iclab.checkpoint.TaskCheckpoint`, or None (no checkpoints).
        stop_on_divergence: the engines' loop raises :class:`iclab.engines.Diverged` when
            the recorded loss stops being finite.
        label: the task's description (named in a divergence report).
    """

    def __init__(self, update: TaskUpdate | None = None, *, checkpoint=None, stop_on_divergence: bool = False,
                 label: str | None = None):
        self._update = update
        self.checkpoint = checkpoint
        self.stop_on_divergence = stop_on_divergence
        self.label = label

    def __call__(self, step: int, obs: dict) -> None:
        if self._update is not None:
            self._update(step, obs)



class Reporter:
    """Silent reporter: the interface, and what CI and non-terminals get."""

    @contextlib.contextmanager
    def task(self, description: str, total: int) -> Iterator[TaskCallback]:
        yield TaskCallback()


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

            yield TaskCallback(update)


class RunReporter(Reporter):
    """Wraps a reporter for one launched run: each task's callback carries the run's checkpoint
    handle for that task (keyed by the task's order and label) and stops the run on divergence."""

    def __init__(self, inner: Reporter | None = None, checkpoints=None, stop_on_divergence: bool = True):
        self.inner = inner or Reporter()
        self.checkpoints = checkpoints
        self.stop_on_divergence = stop_on_divergence

    @contextlib.contextmanager
    def task(self, description: str, total: int) -> Iterator[TaskCallback]:
        handle = self.checkpoints.task(description) if self.checkpoints is not None else None
        with self.inner.task(description, total) as cb:
            yield TaskCallback(cb, checkpoint=handle, stop_on_divergence=self.stop_on_divergence, label=description)


def task(reporter: Reporter | None, description: str, total: int):
    """``reporter.task(description, total)``, or a silent task when ``reporter`` is None.

    Args:
        reporter: any :class:`Reporter`, or None.
        description: the task's label (also the key of its checkpoints in a launched run).
        total: the number of units (steps) the task reports.
    Returns:
        A context manager yielding a :class:`TaskCallback`.
    """
    return (reporter or Reporter()).task(description, total)


def default_reporter() -> Reporter:
    """A rich bar when stderr is a terminal and CI is not set; otherwise silence."""
    if not _interactive():
        return Reporter()
    return RichReporter()


class SweepProgress:
    """Progress of a sweep: points done, failed (or diverged) and cached, of the total. Silent base."""

    def start(self, total: int) -> None:
        pass

    def update(self, done: int, failed: int, cached: int, running: int) -> None:
        pass

    def close(self) -> None:
        pass


class RichSweepProgress(SweepProgress):
    """One rich bar counting finished points, with done / failed / cached / running counts."""

    def __init__(self, console=None):
        from rich.console import Console

        self.console = console or Console(stderr=True)
        self._bar = None

    def start(self, total: int) -> None:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

        self._bar = Progress(TextColumn("sweep"), BarColumn(), MofNCompleteColumn(),
                             TextColumn("done {task.fields[done]}  failed {task.fields[failed]}  "
                                        "cached {task.fields[cached]}  running {task.fields[running]}"),
                             TimeElapsedColumn(), console=self.console, transient=True)
        self._bar.start()
        self._task = self._bar.add_task("sweep", total=total, done=0, failed=0, cached=0, running=0)

    def update(self, done: int, failed: int, cached: int, running: int) -> None:
        if self._bar is not None:
            self._bar.update(self._task, completed=done + failed + cached, done=done, failed=failed,
                             cached=cached, running=running)

    def close(self) -> None:
        if self._bar is not None:
            self._bar.stop()
            self._bar = None


def default_sweep_progress() -> SweepProgress:
    """A rich bar on a terminal (CI unset); otherwise silence."""
    return RichSweepProgress() if _interactive() else SweepProgress()


def _interactive() -> bool:
    return not os.environ.get("CI") and sys.stderr.isatty()
