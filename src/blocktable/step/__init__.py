"""The block-table part of an engine step, captured once and replayed (:class:`CapturedStep`).

``layout`` describes the staging buffer, ``runner`` the step object.
"""

from __future__ import annotations

from blocktable.step.runner import CapturedStep, StagedBatch, StepOutputs

__all__ = ["CapturedStep", "StagedBatch", "StepOutputs"]
