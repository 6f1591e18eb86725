"""The wire between the two sides: a :class:`Transport` and its ``torch.distributed`` form.

The workers only ever call the four methods of :class:`Transport`; another transport (NIXL
over UCX, Mooncake) would implement them (see ``docs/disaggregation.md``). Every wait is
bounded: a peer that died or stopped answering raises :class:`PeerLostError` naming it.

A message (:mod:`~blocktable.transfer.wire_format`) goes out as one fixed frame of
:data:`FRAME_BYTES` (its header, then as much of its body as fits: a whole plan, an offer's
small part), then the body's rest if any, then each large array: a point-to-point receive
must know its size, and each operation costs the host more than copying a few KiB. The
receiver lands them in memory it keeps (grown, never shrunk), so a message's arrays are valid
until its next :meth:`~TorchDistributedTransport.recv_message`.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from datetime import timedelta
from typing import Any, Protocol

import numpy as np
import torch

from blocktable.transfer.transfer_errors import PeerLostError
from blocktable.transfer.wire_format import (
    HEADER_LEN,
    MessageWriter,
    bulk_arrays,
    check_header,
    decode_message,
)


class Transport(Protocol):
    """Ordered, reliable messages and tensors to and from one peer."""

    peer: str  # who is on the other end, for error messages ("prefill side (rank 0)")

    def send_message(self, obj: Any) -> None:
        """Send a small picklable object (plans, acknowledgements)."""

    def recv_message(self) -> Any:
        """Receive the next object :meth:`send_message` sent. Its arrays may view this
        transport's memory until the next call (copy what must outlive it)."""

    def send_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        """Send contiguous tensors whose shapes and dtypes the peer already knows, each as
        soon as the iterable yields it (the next one may be produced while this one travels);
        return once every one is sent."""

    def recv_tensors(self, outs: Sequence[torch.Tensor]) -> Iterator[int]:
        """Receive into ``outs`` (contiguous, the sender's shapes and dtypes) in order,
        yielding ``i`` once ``outs[i]`` holds its data (the rest may still be arriving)."""


class TorchDistributedTransport:
    """Point-to-point ``torch.distributed`` send/recv (gloo on the CPU, NCCL on GPUs).

    Parameters
    ----------
    peer_rank : int
        The other side's rank in ``group``.
    peer_role : str
        ``"prefill"`` or ``"decode"``: named with the rank in errors.
    device : torch.device or str
        Where message bytes travel (``cuda`` for NCCL, ``cpu`` for gloo).
    timeout_s : float
        Longest wait for one operation; past it the peer counts as lost.
    group : ProcessGroup, optional
        Default: the default group (passed explicitly so several groups can coexist).
    """

    def __init__(self, peer_rank: int, peer_role: str, device: torch.device | str = "cpu",
                 timeout_s: float = 10.0, group: Any = None) -> None:
        import torch.distributed as dist

        if timeout_s <= 0:
            raise ValueError(f"timeout_s must be > 0, got {timeout_s}")
        self._dist = dist
        self.peer_rank = int(peer_rank)
        self.peer = f"{peer_role} side (rank {peer_rank})"
        self.device = torch.device(device)
        self.timeout = timedelta(seconds=timeout_s)
        self.group = group
        self.bytes_sent = 0
        self.bytes_received = 0
        self._writer = MessageWriter()  # its buffer is free again once send_message returns
        # the first send of every message, each way (host memory; moved when the device is not)
        self._frame_out = np.zeros(FRAME_BYTES, dtype=np.uint8)
        self._frame_in = torch.empty(FRAME_BYTES, dtype=torch.uint8, device=self.device)
        self._landing = torch.empty(0, dtype=torch.uint8, device=self.device)  # grown

    def _wait(self, work: Any, what: str) -> None:
        try:
            finished = work.wait(self.timeout)
        except Exception as exc:  # gloo raises on a closed socket or a timeout
            raise PeerLostError(self.peer, what, exc) from exc
        if finished is False:  # some backends report a timeout by returning False
            raise PeerLostError(self.peer, f"{what} (no answer in "
                                f"{self.timeout.total_seconds():g} s)")

    def _post(self, op: Any, tensor: torch.Tensor, what: str) -> Any:
        try:
            return op(tensor, self.peer_rank, group=self.group)
        except RuntimeError as exc:  # gloo raises at once when the peer's socket is closed
            raise PeerLostError(self.peer, what, exc) from exc

    def send_tensors(self, tensors: Iterable[torch.Tensor]) -> None:
        works = []
        try:
            for tensor in tensors:
                nbytes = tensor.numel() * tensor.element_size()
                works.append((self._post(self._dist.isend, tensor, f"sending {nbytes} bytes"),
                              nbytes))
        finally:  # a failed producer still waits for what is already posted
            for work, nbytes in works:
                self._wait(work, f"sending {nbytes} bytes")
                self.bytes_sent += nbytes

    def recv_tensors(self, outs: Sequence[torch.Tensor]) -> Iterator[int]:
        # every receive is posted first, so piece i + 1 lands while the caller uses piece i
        sizes = [out.numel() * out.element_size() for out in outs]
        works = [self._post(self._dist.irecv, out, f"receiving {nbytes} bytes")
                 for out, nbytes in zip(outs, sizes)]
        for i, (work, nbytes) in enumerate(zip(works, sizes)):
            self._wait(work, f"receiving {nbytes} bytes")
            self.bytes_received += nbytes
            yield i

    def send_tensor(self, tensor: torch.Tensor) -> None:
        """One tensor: :meth:`send_tensors` of one."""
        self.send_tensors((tensor,))

    def recv_tensor(self, out: torch.Tensor) -> None:
        """One tensor: :meth:`recv_tensors` of one."""
        for _ in self.recv_tensors((out,)):
            pass

    def send_message(self, obj: Any) -> None:
        header, body, bulk = self._writer.encode(obj)
        frame, first = self._frame_out, min(body.size, _FRAME_BODY_BYTES)
        frame[:_HEADER_BYTES] = header.view(np.uint8)
        frame[_HEADER_BYTES:_HEADER_BYTES + first] = body[:first]
        parts = [frame, body[first:], *bulk] if body.size > first else [frame, *bulk]
        self.send_tensors(torch.from_numpy(t).to(self.device) for t in parts)

    def recv_message(self) -> Any:
        frame = self._frame_in
        self.recv_tensor(frame)
        frame_np = frame.cpu().numpy()
        header = frame_np[:_HEADER_BYTES].view(np.int64)
        size = check_header(header)
        shapes = bulk_arrays(header)
        first = min(size, _FRAME_BODY_BYTES)
        # landing: the body's rest at [first, size), then each large array, aligned
        offsets, end = [], size
        for dtype, count in shapes:
            end += -end % _ALIGN_BYTES
            offsets.append(end)
            end += count * dtype.itemsize
        if self._landing.numel() < end:
            self._landing = torch.empty(max(end, 2 * self._landing.numel()), dtype=torch.uint8,
                                        device=self.device)
        landing = self._landing
        outs = [landing[o:o + count * dtype.itemsize].view(_torch_dtype(dtype))
                for (dtype, count), o in zip(shapes, offsets)]
        for _ in self.recv_tensors([landing[first:size], *outs] if size > first else outs):
            pass
        if size > first:
            body = landing[:size].cpu().numpy()
            body[:first] = frame_np[_HEADER_BYTES:_HEADER_BYTES + first]
        else:
            body = frame_np[_HEADER_BYTES:_HEADER_BYTES + size]
        return decode_message(header, body, [t.cpu().numpy() for t in outs])


FRAME_BYTES = 4096
"""Bytes of a message's first send: its header, then the start of its body."""

_HEADER_BYTES = HEADER_LEN * 8
_ALIGN_BYTES = 16  # where each large array lands in the landing buffer
_FRAME_BODY_BYTES = FRAME_BYTES - _HEADER_BYTES


def _torch_dtype(dtype: np.dtype) -> torch.dtype:
    return torch.from_numpy(np.empty(0, dtype)).dtype
