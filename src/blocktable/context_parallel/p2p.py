"""The peer-to-peer transport of the attention merge: symmetric memory and one kernel per call.

Where every rank of the context-parallel group is a GPU of one node, the ranks can write into
each other's memory over NVLink. :func:`open_symmetric_buffer` allocates one buffer per rank
with ``torch.distributed._symmetric_memory`` and learns where every peer's buffer is;
:class:`P2PMerge` then merges with a single Triton launch per call (see
:mod:`blocktable.context_parallel.p2p_kernel`): no NCCL collective, no host sync, no allocation,
capturable in a CUDA graph. NVLink multicast is never used.
"""

from __future__ import annotations

import socket
from dataclasses import dataclass

import torch
import torch.distributed as dist

from blocktable._triton import HAS_TRITON, Launcher, interpreting, next_power_of_2

if HAS_TRITON:
    from blocktable.context_parallel.p2p_kernel import _p2p_merge_kernel
else:  # the transport is unavailable; `auto` picks the collectives (p2p_unavailable_reason)
    _p2p_merge_kernel = None

FLAG_BYTES = 4
MAX_PROGRAMS = 128  # programs of the grid: every one must be resident at once (they spin)
_TILE_ELEMS = 4096  # elements of one tile row block, as in the collective kernels


def _round16(nbytes: int) -> int:
    return -(-nbytes // 16) * 16


@dataclass(frozen=True)
class SymmetricBuffer:
    """One rank's buffer that every peer can address, and where the peers' buffers are.

    Attributes
    ----------
    local : torch.Tensor
        uint8, flat, 16-byte aligned: this rank's buffer (on its device).
    delta16 : tuple of int
        Per rank of the group: that rank's buffer address minus ``local``'s, in units of 16
        bytes, as this process addresses it (0 for this rank).
    keepalive : object
        Whatever must live as long as the buffer (the symmetric-memory handle).
    """

    local: torch.Tensor
    delta16: tuple[int, ...]
    keepalive: object = None


@dataclass(frozen=True)
class P2PLayout:
    """Byte layout of a rank's symmetric buffer: flags, then LSE slots, then output slots.

    ``flags``: int32 ``[2, programs, world]`` (ready, done); ``lse``: float32
    ``[world, max_num_tokens, num_heads]``; ``out``: the output dtype
    ``[world, max_num_tokens, num_heads, head_dim]``. Slot ``w`` holds what rank ``w`` pushed.
    """

    world_size: int
    programs: int
    max_num_tokens: int
    num_heads: int
    head_dim: int
    elem_bytes: int

    @property
    def lse_offset_bytes(self) -> int:
        return _round16(2 * self.programs * self.world_size * FLAG_BYTES)

    @property
    def out_offset_bytes(self) -> int:
        lse = self.world_size * self.max_num_tokens * self.num_heads * 4
        return self.lse_offset_bytes + _round16(lse)

    @property
    def nbytes(self) -> int:
        out = self.world_size * self.max_num_tokens * self.num_heads * self.head_dim
        return self.out_offset_bytes + _round16(out * self.elem_bytes)


def tokens_per_tile(num_heads: int, head_dim: int) -> int:
    """Whole tokens per tile of the kernel (at least one)."""
    rows = max(1, _TILE_ELEMS // next_power_of_2(head_dim))
    return max(1, rows // num_heads)


def default_programs(max_num_tokens: int, num_heads: int, head_dim: int) -> int:
    """Programs of the grid: one per tile of ``max_num_tokens``, at most :data:`MAX_PROGRAMS`.

    Depends on the shapes only, so every rank of a group picks the same grid."""
    tiles = -(-max_num_tokens // tokens_per_tile(num_heads, head_dim))
    return max(1, min(MAX_PROGRAMS, tiles))


class P2PMerge:
    """The merge of one rank over symmetric buffers: one Triton launch per call.

    Every rank must call :meth:`run` in the same order with the same ``num_tokens`` and the
    same ``all_heads`` (as with collectives); a call whose peers never arrive traps after
    ``timeout_s`` instead of hanging. Results are views of this object's buffers, valid until
    its next call. One instance must not be used from two streams at once.

    Parameters
    ----------
    rank, world_size : int
        This rank and the group's size.
    max_num_tokens, num_heads, head_dim : int
        Shapes the buffers are sized for.
    dtype : torch.dtype
        Of the partial outputs and the result.
    heads_per_rank : int
        Heads each rank merges when ``all_heads`` is false (``num_heads // world_size``).
    buffer : SymmetricBuffer
        This rank's buffer, at least ``P2PLayout(...).nbytes`` bytes, zeroed on every rank
        before any rank's first call.
    programs : int
        Programs of the grid; equal on every rank.
    timeout_s : float or None
        How long a program waits for a peer before it traps (``None``: forever). Ignored under
        the Triton interpreter.
    tile_tokens : int or None
        Tokens per tile (equal on every rank); default :func:`tokens_per_tile`.
    """

    def __init__(
        self,
        *,
        rank: int,
        world_size: int,
        max_num_tokens: int,
        num_heads: int,
        head_dim: int,
        dtype: torch.dtype,
        heads_per_rank: int,
        buffer: SymmetricBuffer,
        programs: int,
        timeout_s: float | None,
        tile_tokens: int | None = None,
    ) -> None:
        if not HAS_TRITON:
            raise RuntimeError("transport='p2p' needs the triton package")
        self.rank, self.world_size = rank, world_size
        self.max_num_tokens, self.num_heads, self.head_dim = max_num_tokens, num_heads, head_dim
        self.dtype, self.heads_per_rank, self.programs = dtype, heads_per_rank, programs
        elem = torch.empty((), dtype=dtype).element_size()
        self.layout = P2PLayout(world_size, programs, max_num_tokens, num_heads, head_dim, elem)
        local = buffer.local
        if local.dtype != torch.uint8 or local.dim() != 1 or local.numel() < self.layout.nbytes:
            raise ValueError(
                f"buffer.local must be a flat uint8 tensor of at least {self.layout.nbytes} "
                f"bytes, got {local.dtype} {list(local.shape)}"
            )
        if local.data_ptr() % 16:
            raise ValueError("buffer.local must be 16-byte aligned")
        if len(buffer.delta16) != world_size or buffer.delta16[rank] != 0:
            raise ValueError(f"buffer.delta16 must hold {world_size} offsets, 0 at rank {rank}")
        self.buffer = buffer
        self.device = local.device
        nbytes = self.layout.nbytes
        self._sym_out = local[:nbytes].view(dtype)
        self._sym_f32 = local[:nbytes].view(torch.float32)
        self._sym_i32 = local[:nbytes].view(torch.int32)
        self._delta16 = torch.tensor(buffer.delta16, dtype=torch.int64, device=self.device)
        self._epoch = torch.zeros(programs, dtype=torch.int32, device=self.device)
        self.result = torch.zeros(max_num_tokens * num_heads * head_dim, dtype=dtype,
                                  device=self.device)
        self.result_lse = torch.zeros(max_num_tokens * num_heads, dtype=torch.float32,
                                      device=self.device)
        self._tok = tile_tokens or tokens_per_tile(num_heads, head_dim)
        interp = interpreting() or self.device.type != "cuda"
        self._timeout_ns = 0 if (timeout_s is None or interp) else max(1, int(timeout_s * 1e9))
        self._launch = Launcher(_p2p_merge_kernel, dynamic=(9,))
        self._views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self._tails: dict[tuple[bool, bool, bool], tuple[object, ...]] = {}
        self._bufs = (self._sym_out, self._sym_f32, self._sym_i32, self._delta16, self._epoch,
                      self.result, self.result_lse)

    def run(
        self, out: torch.Tensor, lse: torch.Tensor, *, all_heads: bool, want_lse: bool
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """Merge ``out`` ``[T, H, D]`` and ``lse`` float32 ``[T, H]`` (checked by the caller)
        with the peers'; returns ``[T, HR, D]`` and ``[T, HR]`` views (``HR`` = every head or
        this rank's slice)."""
        num_tokens = out.shape[0]
        hr = self.num_heads if all_heads else self.heads_per_rank
        self._kernel(out, lse, num_tokens, all_heads, want_lse)
        key = (num_tokens, hr)
        views = self._views.get(key)
        if views is None:
            if len(self._views) >= 256:
                self._views.clear()
            views = (self.result[: num_tokens * hr * self.head_dim].view(num_tokens, hr,
                                                                         self.head_dim),
                     self.result_lse[: num_tokens * hr].view(num_tokens, hr))
            self._views[key] = views
        return views

    def precompile(self, all_heads_modes: tuple[bool, ...]) -> None:
        """Compile the kernel's variants now (no launch), so that a rank compiling late cannot
        leave its peers waiting into their timeout at a first call. No-op under the
        interpreter or where this Triton lacks ``warmup``."""
        warmup = getattr(_p2p_merge_kernel, "warmup", None)
        if interpreting() or self.device.type != "cuda" or warmup is None:
            return
        out = torch.zeros(1, self.num_heads, self.head_dim, dtype=self.dtype, device=self.device)
        lse = torch.zeros(1, self.num_heads, dtype=torch.float32, device=self.device)
        with torch.cuda.device(self.device):
            for all_heads in all_heads_modes:
                for want_lse in (False, True):
                    try:
                        warmup(*self._args(out, lse, 1, all_heads, want_lse),
                               grid=(self.programs,), num_warps=4)
                    except TypeError:  # another warmup signature: the first call compiles
                        return

    def handshake(self, out: torch.Tensor, lse: torch.Tensor) -> None:
        """The kernel with no token: only its flags (the transport's floor)."""
        self._kernel(out[:0], lse[:0], 0, True, False)

    def _kernel(
        self, out: torch.Tensor, lse: torch.Tensor, num_tokens: int, all_heads: bool,
        want_lse: bool,
    ) -> None:
        self._launch((self.programs,), *self._args(out, lse, num_tokens, all_heads, want_lse))

    def _args(
        self, out: torch.Tensor, lse: torch.Tensor, num_tokens: int, all_heads: bool,
        want_lse: bool,
    ) -> tuple[object, ...]:
        aligned = out.data_ptr() % 16 == 0
        tail = self._tails.get((all_heads, want_lse, aligned))
        if tail is None:
            tail = self._tails[(all_heads, want_lse, aligned)] = self._tail(
                all_heads, want_lse, aligned)
        return (out, lse, *self._bufs, num_tokens, out.stride(0), out.stride(1), lse.stride(0),
                lse.stride(1), *tail)

    def _tail(self, all_heads: bool, want_lse: bool, aligned: bool) -> tuple[object, ...]:
        """The kernel's constexpr arguments of one mode."""
        hr = self.num_heads if all_heads else self.heads_per_rank
        lay, tok = self.layout, self._tok
        elem = lay.elem_bytes
        return (
            self.world_size, self.rank, self.num_heads, self.head_dim,
            next_power_of_2(self.head_dim), self.heads_per_rank, all_heads, hr,
            0 if all_heads else self.rank * self.heads_per_rank, tok,
            next_power_of_2(tok * self.num_heads), next_power_of_2(tok * hr),
            self.max_num_tokens, lay.lse_offset_bytes // 4, lay.out_offset_bytes // elem,
            16 // elem, want_lse, self._timeout_ns, aligned,
        )


def p2p_unavailable_reason(device: torch.device) -> str | None:
    """Why ``transport='p2p'`` cannot run on ``device`` in this process (checked before any
    collective, so every rank refuses alike), or ``None``."""
    if device.type != "cuda":
        return (f"transport='p2p' needs CUDA tensors (GPUs of one node), got device={device}; "
                "use transport='collectives' (gloo on the CPU)")
    if not HAS_TRITON:
        return "transport='p2p' needs the triton package"
    try:
        import torch.distributed._symmetric_memory as symm_mem
    except ImportError as err:
        return f"transport='p2p' needs torch.distributed._symmetric_memory ({err})"
    missing = [n for n in ("empty", "rendezvous") if not hasattr(symm_mem, n)]
    if missing:
        return (f"transport='p2p' needs torch.distributed._symmetric_memory.{missing[0]}, "
                f"missing in torch {torch.__version__}")
    return None


def choose_transport(group: dist.ProcessGroup, device: torch.device, backend: str = "auto") -> str:
    """``"p2p"`` where every rank of ``group`` can run it, else ``"collectives"``.

    ``"p2p"`` needs more than one rank, every rank on one node with a CUDA ``device``, Triton
    and symmetric memory (:func:`p2p_unavailable_reason` is ``None`` on every rank) and a
    ``backend`` other than ``"torch"``. A collective over ``group`` when it has more than one
    rank (every rank learns every other's answer, so all choose alike).
    """
    world = dist.get_world_size(group)
    if world == 1:
        return "collectives"
    reason = p2p_unavailable_reason(device)
    if reason is None and backend == "torch":
        reason = "backend='torch'"
    seen: list[object] = [None] * world
    mine = (reason, socket.gethostname())
    if device.type == "cuda":
        with torch.cuda.device(device):
            dist.all_gather_object(seen, mine, group=group)
    else:
        dist.all_gather_object(seen, mine, group=group)
    answers: list[tuple[str | None, str]] = [tuple(a) for a in seen]  # type: ignore[arg-type, misc]
    if any(r is not None for r, _ in answers) or len({h for _, h in answers}) > 1:
        return "collectives"
    return "p2p"


def check_one_node(hosts: list[str]) -> None:
    """Raise ``ValueError`` unless every rank (``hosts[rank]``) runs on the same host."""
    if len(set(hosts)) > 1:
        where = ", ".join(f"rank {r}: {h}" for r, h in enumerate(hosts))
        raise ValueError(f"transport='p2p' needs every rank of the group on one node ({where})")


def open_symmetric_buffer(
    group: dist.ProcessGroup, nbytes: int, device: torch.device
) -> SymmetricBuffer:
    """Allocate this rank's symmetric buffer of ``nbytes`` (zeroed on every rank on return).

    A collective over ``group``: every rank must call it with the same ``nbytes``. Uses
    ``torch.distributed._symmetric_memory`` (CUDA peer-to-peer mappings; multicast unused).

    Raises
    ------
    ValueError
        ``device`` is not CUDA, or the ranks are not on one node.
    RuntimeError
        Symmetric memory is unavailable in this torch, or its rendezvous failed.
    """
    reason = p2p_unavailable_reason(device)
    if reason is not None:
        raise ValueError(reason) if device.type != "cuda" else RuntimeError(reason)
    import torch.distributed._symmetric_memory as symm_mem

    rank, world = dist.get_rank(group), dist.get_world_size(group)
    with torch.cuda.device(device):
        hosts: list[object] = [None] * world
        dist.all_gather_object(hosts, socket.gethostname(), group=group)
        check_one_node([str(h) for h in hosts])
        tensor = symm_mem.empty(nbytes, dtype=torch.uint8, device=device)
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None and not hasattr(enable, "__deprecated__"):
            enable(group.group_name)  # older torch: the group must be registered first
        try:
            handle = symm_mem.rendezvous(tensor, group.group_name)
        except Exception as err:  # re-raised with what was tried
            raise RuntimeError(
                f"transport='p2p': symmetric-memory rendezvous of {nbytes} bytes failed on "
                f"rank {rank}: {err}"
            ) from err
        ptrs = [int(p) for p in handle.buffer_ptrs]
        offset = tensor.data_ptr() - ptrs[rank]
        size = int(getattr(handle, "buffer_size", offset + nbytes))
        if offset < 0 or offset + nbytes > size:
            raise RuntimeError(
                f"transport='p2p': the buffer ({nbytes} bytes at offset {offset}) is not inside "
                f"its symmetric allocation ({size} bytes)"
            )
        tensor.zero_()
        torch.cuda.synchronize(device)
        offsets: list[object] = [None] * world
        dist.all_gather_object(offsets, offset, group=group)  # also: every rank has zeroed
    if len(set(offsets)) != 1 or offset < 0:
        raise RuntimeError(
            f"transport='p2p': the buffer sits at different offsets of the symmetric "
            f"allocations ({offsets}); allocate the merger at the same point on every rank"
        )
    deltas = [p - ptrs[rank] for p in ptrs]
    if any(d % 16 for d in deltas):
        raise RuntimeError(f"transport='p2p': peer buffers are not 16-byte aligned ({deltas})")
    return SymmetricBuffer(tensor, tuple(d // 16 for d in deltas), (handle, tensor))
