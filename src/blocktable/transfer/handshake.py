"""Both sides exchange their :class:`KVCacheLayout` once, before any block moves."""

from __future__ import annotations

from blocktable.transfer.errors import HandshakeError
from blocktable.transfer.layout import KVCacheLayout, check_compatible
from blocktable.transfer.transport import Transport

PROTOCOL_VERSION = 1


def handshake(transport: Transport, local: KVCacheLayout, local_role: str,
              remote_role: str) -> KVCacheLayout:
    """Send ``local``, receive the peer's, and raise :class:`HandshakeError` (naming the field
    and both values) when they cannot exchange blocks. Both sides compare, so both refuse
    together. The prefill side speaks first (a blocking send on both sides could deadlock).
    """
    hello = {"version": PROTOCOL_VERSION, "layout": local.to_dict()}
    if local_role == "prefill":
        transport.send_message(hello)
        theirs = transport.recv_message()
    else:
        theirs = transport.recv_message()
        transport.send_message(hello)
    if theirs.get("version") != PROTOCOL_VERSION:
        raise HandshakeError("version", PROTOCOL_VERSION, theirs.get("version"), local_role,
                             remote_role)
    try:
        remote = KVCacheLayout(**theirs["layout"])
    except (TypeError, ValueError) as exc:
        raise HandshakeError("layout", local.to_dict(), f"{theirs['layout']} ({exc})",
                             local_role, remote_role) from exc
    check_compatible(local, remote, local_role, remote_role)
    return remote
