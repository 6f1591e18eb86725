"""Two in-process transports joined by queues: both sides in one process (tests, examples).

Tensors are copied on send, as a wire would. A side that stops answering makes the other
raise :class:`PeerLostError` after ``timeout_s``.
"""

from __future__ import annotations

import queue
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import torch

from blocktable.transfer.transfer_errors import PeerLostError


class QueueTransport:
    """One end of a :func:`local_pair`."""

    def __init__(self, inbox: queue.Queue[Any], outbox: queue.Queue[Any], peer: str,
                 timeout_s: float) -> None:
        self._inbox, self._outbox = inbox, outbox
        self.peer = peer
        self.timeout_s = timeout_s

    def _get(self, what: str) -> Any:
        try:
            return self._inbox.get(timeout=self.timeout_s)
        except queue.Empty:
            raise PeerLostError(self.peer, f"{what} (no answer in {self.timeout_s:g} s)") from None

    def send_message(self, obj: Any) -> None:
        self._outbox.put(("message", obj))

    def recv_message(self) -> Any:
        kind, obj = self._get("receiving a message")
        if kind != "message":
            raise RuntimeError(f"protocol error: expected a message from the {self.peer}, "
                               f"got a {kind}")
        return obj

    def send_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        for tensor in tensors:
            self._outbox.put(("tensor", tensor.clone()))

    def recv_tensors(self, outs: Sequence[torch.Tensor]) -> Iterator[int]:
        for i, out in enumerate(outs):
            kind, obj = self._get("receiving a tensor")
            if kind != "tensor" or obj.shape != out.shape or obj.dtype != out.dtype:
                raise RuntimeError(f"protocol error: expected a {out.dtype} tensor "
                                   f"{list(out.shape)} from the {self.peer}, got {kind}")
            out.copy_(obj)
            yield i

def local_pair(timeout_s: float = 10.0) -> tuple[QueueTransport, QueueTransport]:
    """``(prefill_end, decode_end)``: what one sends the other receives, in order."""
    to_decode: queue.Queue[Any] = queue.Queue()
    to_prefill: queue.Queue[Any] = queue.Queue()
    return (QueueTransport(to_prefill, to_decode, "decode side", timeout_s),
            QueueTransport(to_decode, to_prefill, "prefill side", timeout_s))
