"""What a transfer raises: a refused handshake, a lost peer, a failed batch."""

from __future__ import annotations


class TransferError(RuntimeError):
    """Base class of every error the transfer layer raises."""


class HandshakeError(TransferError):
    """The two sides' KV caches cannot exchange blocks; names the field and both values."""

    def __init__(self, field: str, local: object, remote: object, local_role: str,
                 remote_role: str) -> None:
        self.field = field
        super().__init__(
            f"handshake refused: {field} differs ({local_role} side {local!r}, {remote_role} "
            f"side {remote!r})"
        )


class PeerLostError(TransferError):
    """The other side died, closed its connection or stopped answering."""

    def __init__(self, peer: str, what: str, cause: BaseException | None = None) -> None:
        self.peer = peer
        detail = f": {type(cause).__name__}: {cause}" if cause is not None else ""
        super().__init__(f"lost the {peer} while {what}{detail}")
