"""Did a resumed attempt really resume? (issue 38, the step-0 rule from the program's output)

A restart or relaunch that clusterkit told where to resume (``JobPlan.resume_from``: the
profile's resume argument, spec/programs.py) is watched: the console lines pass through
:class:`ResumeWatch` unchanged, and it notes whether the program logged that it resumed
(the profile's ``resumed_marker``, e.g. HF's ``Resuming training from checkpoint``)
before its first progress line (``progress_marker``: HF's logged loss). A program that
logged progress first began at step 0 although a complete checkpoint existed:
``launch.run.launch`` ends the job with one error line instead of "finished".
"""

from __future__ import annotations

import re

from clusterkit.fold import Folded
from clusterkit.launch.console import ForwardingSink, Sink
from clusterkit.spec.programs import Profile


class ResumeWatch(ForwardingSink):
    """A :class:`~clusterkit.launch.console.Sink` that forwards everything to ``inner``
    and reads the rank lines for the profile's markers."""

    def __init__(self, inner: Sink, profile: Profile) -> None:
        super().__init__(inner)
        self.resumed = re.compile(profile.resumed_marker)
        self.progress = re.compile(profile.progress_marker)
        self.verdict: bool | None = None  # True: began at step 0; None: not seen yet

    def _read(self, rank: int | None, text: str) -> None:
        if self.verdict is not None or rank is None:
            return
        if self.resumed.search(text):
            self.verdict = False
        elif self.progress.search(text):
            self.verdict = True

    @property
    def began_fresh(self) -> bool:
        return self.verdict is True

    def line(self, node: str, rank: int | None, text: str, *, agent: bool = False) -> None:
        self._read(rank, text)
        self.inner.line(node, rank, text, agent=agent)

    def show(self, item: Folded) -> None:
        self._read(item.first_rank, item.text)
        self.inner.show(item)
