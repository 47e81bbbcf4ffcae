"""One eviction step, written once for every place a step runs, and its fast paths.

`stages.py` (`absorb`, `scores`), `paths.py` (the reference step and its registered fast paths: the
ring, in place), `views.py` (`view_of`: a row group's `SlotView`), `selection.py` (victim and kept slots
from scores), `states.py` (what each policy carries from one step to the next), `outputs.py` (a chunk's
outputs step by step, in one tensor).
"""
