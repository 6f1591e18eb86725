"""Both sides exchange their :class:`KVCacheLayout` once, before any block moves."""

from __future__ import annotations

from blocktable.transfer.kv_layout import KVCacheLayout, check_compatible
from blocktable.transfer.transfer_errors import HandshakeError
from blocktable.transfer.transport import Transport

PROTOCOL_VERSION = 2  # 2: offers carry each request's stop tokens
_INT_FIELDS = ("num_layers", "num_kv_heads", "head_dim", "block_size", "kernel_block_size")


def _is_positive_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


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
    fields = theirs.get("layout", {})
    for name, mine in local.to_dict().items():
        if name not in fields:
            raise HandshakeError(name, mine, "missing", local_role, remote_role)
    bad = next((name for name in _INT_FIELDS if not _is_positive_int(fields[name])), None)
    if bad is not None:
        raise HandshakeError(bad, getattr(local, bad), fields[bad], local_role, remote_role)
    if fields["block_size"] % fields["kernel_block_size"]:
        raise HandshakeError(
            "kernel_block_size", local.kernel_block_size,
            f"{fields['kernel_block_size']}, which does not divide its block_size "
            f"{fields['block_size']}", local_role, remote_role)
    remote = KVCacheLayout(**{name: fields[name] for name in local.to_dict()})
    check_compatible(local, remote, local_role, remote_role)
    return remote
