"""The block-table part of an engine step, captured once and replayed (:class:`CapturedStep`).

``layout`` describes the pinned staging buffer, ``host`` applies a step's update and stages its
changed entries, ``kernels`` holds the device-side scatter, ``runner`` the step object.
"""

from __future__ import annotations

from blocktable.step.runner import CapturedStep, StagedBatch, StepOutputs

__all__ = ["CapturedStep", "StagedBatch", "StepOutputs"]
