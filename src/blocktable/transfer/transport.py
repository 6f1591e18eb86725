"""The wire between the two sides: a :class:`Transport` and its ``torch.distributed`` form.

The workers only ever call the four methods of :class:`Transport`; another transport (NIXL
over UCX, Mooncake) would implement them (see ``docs/disaggregation.md``). Every wait is
bounded: a peer that died or stopped answering raises :class:`PeerLostError` naming it.
"""

from __future__ import annotations

import pickle
from datetime import timedelta
from typing import Any, Protocol

import torch

from blocktable.transfer.transfer_errors import PeerLostError


class Transport(Protocol):
    """Ordered, reliable messages and tensors to and from one peer."""

    peer: str  # who is on the other end, for error messages ("prefill side (rank 0)")

    def send_message(self, obj: Any) -> None:
        """Send a small picklable object (plans, acknowledgements)."""

    def recv_message(self) -> Any:
        """Receive the next object :meth:`send_message` sent."""

    def send_tensor(self, tensor: torch.Tensor) -> None:
        """Send a contiguous tensor whose shape and dtype the peer already knows."""

    def recv_tensor(self, out: torch.Tensor) -> None:
        """Receive into ``out`` (contiguous, the sender's shape and dtype)."""


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

    def _wait(self, work: Any, what: str) -> None:
        try:
            finished = work.wait(self.timeout)
        except Exception as exc:  # gloo raises on a closed socket or a timeout
            raise PeerLostError(self.peer, what, exc) from exc
        if finished is False:  # some backends report a timeout by returning False
            raise PeerLostError(self.peer, f"{what} (no answer in "
                                f"{self.timeout.total_seconds():g} s)")

    def send_tensor(self, tensor: torch.Tensor) -> None:
        work = self._dist.isend(tensor, self.peer_rank, group=self.group)
        self._wait(work, f"sending {tensor.numel() * tensor.element_size()} bytes")
        self.bytes_sent += tensor.numel() * tensor.element_size()

    def recv_tensor(self, out: torch.Tensor) -> None:
        work = self._dist.irecv(out, self.peer_rank, group=self.group)
        self._wait(work, f"receiving {out.numel() * out.element_size()} bytes")
        self.bytes_received += out.numel() * out.element_size()

    def send_message(self, obj: Any) -> None:
        payload = pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)
        self.send_tensor(torch.tensor([len(payload)], dtype=torch.int64, device=self.device))
        data = torch.frombuffer(bytearray(payload), dtype=torch.uint8).to(self.device)
        self.send_tensor(data)

    def recv_message(self) -> Any:
        size = torch.zeros(1, dtype=torch.int64, device=self.device)
        self.recv_tensor(size)
        data = torch.empty(int(size.item()), dtype=torch.uint8, device=self.device)
        self.recv_tensor(data)
        return pickle.loads(data.cpu().numpy().tobytes())
