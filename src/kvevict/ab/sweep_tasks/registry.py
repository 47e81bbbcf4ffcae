"""Every task a sweep can run, in the order a sweep runs them; a new task is one file here and one line below."""

from __future__ import annotations

from .base import SweepTask
from .generation import Generation
from .needle import Needle
from .ruler import Ruler
from .sinkmap import SinkMap

SWEEP_TASKS: tuple[SweepTask, ...] = (Needle(), Generation(), Ruler(), SinkMap())
