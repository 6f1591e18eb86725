"""How a message travels: its pickle and, beside it, the memory of the numpy arrays it holds.

Pickle protocol 5 hands every array's buffer out of band: a message of flat arrays (an
:class:`~blocktable.transfer.messages.OfferBatch` of 64 prompts) is sent from the arrays'
own memory and rebuilt on the other side as arrays viewing the received bytes, with no copy
into or out of a pickle on either side. A message is a fixed-size header (int64
``[MAX_FRAMES + 1]``: the number of frames, then their byte sizes), then every non-empty frame.
"""

from __future__ import annotations

import pickle
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

MAX_FRAMES = 16
"""Most frames one message travels in (its pickle, then its arrays' memory)."""


def encode_message(obj: Any) -> list[memoryview]:
    """``obj`` as frames: its pickle, then the memory of every numpy array it holds (not
    copied); a message with more arrays than fit in :data:`MAX_FRAMES` keeps them inside the
    pickle."""
    arrays: list[pickle.PickleBuffer] = []
    payload = pickle.dumps(obj, protocol=5, buffer_callback=arrays.append)
    if len(arrays) >= MAX_FRAMES:
        return [memoryview(pickle.dumps(obj, protocol=5))]
    return [memoryview(payload)] + [a.raw() for a in arrays]


def decode_message(frames: Sequence[Any]) -> Any:
    """The object :func:`encode_message` made ``frames`` of (byte buffers, in order); its
    arrays view the frames' memory."""
    return pickle.loads(frames[0], buffers=frames[1:])


def message_tensors(obj: Any) -> list[torch.Tensor]:
    """What goes on the wire for ``obj`` (cpu tensors): the header, then every non-empty
    frame of :func:`encode_message` (uint8)."""
    frames = encode_message(obj)
    header = np.zeros(MAX_FRAMES + 1, dtype=np.int64)
    header[0] = len(frames)
    header[1:len(frames) + 1] = [f.nbytes for f in frames]
    return [torch.from_numpy(header)] + [_frame_tensor(f) for f in frames if f.nbytes]


def empty_frames(header: np.ndarray) -> list[np.ndarray]:
    """Uninitialized uint8 frames (on cpu) of the sizes ``header`` lists: where the
    receiver lands a message's frames before :func:`decode_message`."""
    if not 1 <= int(header[0]) <= MAX_FRAMES:
        raise ValueError(f"a message header must list 1 to {MAX_FRAMES} frames, got "
                         f"{int(header[0])}")
    return [np.empty(n, dtype=np.uint8) for n in header[1:int(header[0]) + 1].tolist()]


def _frame_tensor(frame: memoryview) -> torch.Tensor:
    if frame.readonly:  # torch views only writable memory: copy (the pickle: small)
        frame = memoryview(bytearray(frame))
    return torch.frombuffer(frame, dtype=torch.uint8)
