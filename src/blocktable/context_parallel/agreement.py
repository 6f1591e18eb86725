"""Ranks agree before they talk: every rank's settings gathered once and compared.

A setting that two ranks must share (the CP interleave, block sizes, dtypes, head counts, the
merge pattern...) and that differs between them makes collectives pair the wrong buffers: the
result is a silently wrong answer, garbage, an abort inside the transport or a hang.
:func:`agree` gathers every rank's settings in one collective when a merger or an engine
starts and raises the same :class:`ConfigMismatchError` on every rank when they differ.
"""

from __future__ import annotations

import contextlib
from collections.abc import Mapping
from typing import Any

import torch


class ConfigMismatchError(ValueError):
    """The ranks of a group disagree on a setting they must share.

    Attributes
    ----------
    fields : dict
        Each differing setting's name -> its value on each rank (a list in rank order).
    """

    def __init__(self, what: str, fields: dict[str, list[Any]]) -> None:
        self.fields = fields
        parts = [
            f"{name} ({', '.join(f'rank {r}: {v!r}' for r, v in enumerate(values))})"
            for name, values in fields.items()
        ]
        super().__init__(f"{what}: the ranks disagree on " + "; ".join(parts))


def agree(
    group: Any, what: str, settings: Mapping[str, Any], *, device: torch.device | None = None
) -> None:
    """Gather ``settings`` from every rank of ``group`` and raise if any differ (a collective).

    Every rank must call it at the same point. Besides ``settings``, the library version, the
    world size and the group's global ranks in order are compared, and each rank's reported
    rank must be its place in the group.

    Parameters
    ----------
    group : torch.distributed.ProcessGroup
        The group whose ranks must agree.
    what : str
        Who asks (``"AttentionMerger"``); starts the error message.
    settings : mapping
        Setting name -> a picklable value comparable with ``==`` (dtypes as strings).
    device : torch.device or None
        A CUDA device makes it the current one during the exchange (NCCL groups need it).

    Raises
    ------
    ConfigMismatchError
        On every rank alike: names each differing setting and its value on each rank.
    """
    import torch.distributed as dist

    from blocktable import __version__

    world, rank = dist.get_world_size(group), dist.get_rank(group)
    mine = {
        "library version": __version__,
        "world size": world,
        "group ranks": tuple(dist.get_process_group_ranks(group)),
        "rank": rank,
        **settings,
    }
    gathered: list[Any] = [None] * world
    cuda = device is not None and device.type == "cuda"
    with torch.cuda.device(device) if cuda else contextlib.nullcontext():
        dist.all_gather_object(gathered, mine, group=group)
    differ: dict[str, list[Any]] = {}
    names = list(mine) + [n for g in gathered for n in g if n not in mine]
    for name in dict.fromkeys(names):
        values = [g.get(name, "<missing>") for g in gathered]
        expected = list(range(world)) if name == "rank" else [values[0]] * world
        if values != expected:
            differ[name] = values
    if differ:
        raise ConfigMismatchError(what, differ)
