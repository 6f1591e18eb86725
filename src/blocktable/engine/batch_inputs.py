"""One step's per-request and per-token inputs, built with numpy in persistent buffers.

Everything a step sends to the device (``query_start_loc``, ``row_of_batch``, ``seq_lens``,
positions, input ids, the logits' token indices) lives in *one* int32 host buffer, pinned on
CUDA, and crosses in *one* asynchronous copy into one device buffer of the same layout::

    [ qsl : R+1 | rows : R | seq_lens : R | (pad) | positions : 2T | input_ids : 2T | last : 2R ]

(``R`` = max requests, ``T`` = max tokens; the int64 parts are int32 pairs viewed as int64).
No torch tensor is allocated per step, only views of the fixed buffers; on the CPU the device
buffer is the host buffer itself. A step may refill the host buffer only once the previous
step's copy has read it: an event recorded after the copy says so.

With a captured step (:meth:`BatchInputBuffers.fill_staged`) everything is written into the
step's staging buffer instead: ``query_start_loc``, rows, ``seq_lens`` and positions in their
places, the input ids and the logits' indices in its payload
(:func:`staged_payload_words` words). The step's one copy carries them to the device, and the
step's event says when the buffer may be refilled: no copy and no event from here.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import numpy as np
import torch

from blocktable.step.runner import StagedBatch


class BatchInputs(NamedTuple):
    """Views of this step's inputs (valid until the next :meth:`BatchInputBuffers.fill`)."""

    query_start_loc: torch.Tensor  # on device, int32 [num_reqs + 1]
    positions: torch.Tensor  # on device, int64 [num_tokens]
    row_of_batch: torch.Tensor  # on device, int32 [num_reqs]
    seq_lens: torch.Tensor  # on device, int32 [num_reqs]
    input_ids: torch.Tensor  # on device, int64 [num_tokens]
    logits_indices: torch.Tensor  # on device, int64 [num_reqs]: each request's last token
    query_start_loc_cpu: torch.Tensor  # on cpu (pinned with CUDA), int32 [num_reqs + 1]
    num_tokens: int


class ModelInputs(NamedTuple):
    """What the model reads besides the block-table step's outputs (views of fixed buffers)."""

    input_ids: torch.Tensor  # on device, int64 [num_tokens]
    logits_indices: torch.Tensor  # on device, int64 [num_reqs]: each request's last token
    num_tokens: int


# ModelInputs from a tuple of its fields in one C call (a NamedTuple's own __new__ is Python)
_model_inputs = partial(tuple.__new__, ModelInputs)


def staged_payload_words(max_num_reqs: int, max_num_tokens: int) -> int:
    """int32 words of a captured step's payload that :meth:`BatchInputBuffers.fill_staged`
    fills: the input ids (int64 ``[max_num_tokens]``), then the logits' indices (int64
    ``[max_num_reqs]``)."""
    return 2 * max_num_tokens + 2 * max_num_reqs


class BatchInputBuffers:
    """Persistent host and device buffers for steps of at most ``max_num_reqs`` requests and
    ``max_num_tokens`` tokens on ``device``."""

    def __init__(self, max_num_reqs: int, max_num_tokens: int, device: torch.device) -> None:
        R, T = max_num_reqs, max_num_tokens
        self.max_num_reqs, self.max_num_tokens = R, T
        cuda = device.type == "cuda"
        pos = 3 * R + 1 + (3 * R + 1) % 2  # int64 parts start at an even int32 offset
        ids = pos + 2 * T
        last = ids + 2 * T
        size = last + 2 * R
        # on cpu, int32 [size], pinned with CUDA
        self._host = torch.zeros(size, dtype=torch.int32, pin_memory=cuda)
        # on device, int32 [size]: the host buffer itself on the CPU
        self._device = torch.zeros(size, dtype=torch.int32, device=device) if cuda else self._host
        h = self._host.numpy()
        self._qsl = h[: R + 1]
        self._rows = h[R + 1 : 2 * R + 1]
        self._seq_lens = h[2 * R + 1 : 3 * R + 1]
        self._positions = h[pos:ids].view(np.int64)
        self._input_ids = h[ids:last].view(np.int64)
        self._last = h[last:].view(np.int64)
        d = self._device
        self._d_qsl = d[: R + 1]
        self._d_rows = d[R + 1 : 2 * R + 1]
        self._d_seq_lens = d[2 * R + 1 : 3 * R + 1]
        self._d_positions = d[pos:ids].view(torch.int64)
        self._d_input_ids = d[ids:last].view(torch.int64)
        self._d_last = d[last:].view(torch.int64)
        self._arange = np.arange(max(R, T), dtype=np.int64)
        self._decode_qsl = np.arange(R + 1, dtype=np.int32).tobytes()  # 1 token per request
        # fill_staged's: a captured step's device payload (int32, on device) and its views by
        # size, made once (slicing tensors every step costs host time)
        self._payload: torch.Tensor | None = None
        self._ids_views: dict[int, torch.Tensor] = {}
        self._last_views: dict[int, torch.Tensor] = {}
        self._copied = torch.cuda.Event() if cuda else None
        self._in_flight = False

    def fill(
        self,
        starts: np.ndarray,
        num_new_tokens: np.ndarray,
        rows: np.ndarray,
        input_ids: list[int],
    ) -> BatchInputs:
        """Write a step's inputs and start their copy to the device.

        Parameters
        ----------
        starts : np.ndarray
            int64 ``[num_reqs]``: tokens of each request already in the KV cache.
        num_new_tokens : np.ndarray
            int64 ``[num_reqs]``: tokens each request computes this step (>= 1).
        rows : np.ndarray
            int32 ``[num_reqs]``: each request's table row.
        input_ids : list of int
            ``[num_tokens]``: the step's tokens, request after request.
        """
        if self._in_flight and self._copied is not None:
            self._copied.synchronize()  # the last copy must have read the host buffer
        n, num_tokens = self._write(starts, num_new_tokens, rows, input_ids, self._qsl,
                                    self._positions, self._rows, self._seq_lens,
                                    self._input_ids, self._last)
        if self._copied is not None:
            self._device.copy_(self._host, non_blocking=True)
            self._copied.record()
            self._in_flight = True
        return BatchInputs(
            self._d_qsl[: n + 1], self._d_positions[:num_tokens], self._d_rows[:n],
            self._d_seq_lens[:n], self._d_input_ids[:num_tokens], self._d_last[:n],
            self._host[: n + 1], num_tokens,
        )

    def fill_staged(
        self,
        starts: np.ndarray,
        num_new_tokens: np.ndarray,
        rows: np.ndarray,
        input_ids: list[int],
        batch: StagedBatch,
        device_payload: torch.Tensor,
    ) -> ModelInputs:
        """:meth:`fill` into a captured step's staging: ``query_start_loc``, positions, rows and
        ``seq_lens`` in ``batch``'s places, the input ids and the logits' indices in its
        payload (the step's ``payload_words`` at least :func:`staged_payload_words`). The
        step sends them all. Returns the ids and the logits' indices as views of
        ``device_payload`` (the step's, int32 on device: valid once its device work ran) and
        the token count; the positions the model needs are the captured step's."""
        R, T = self.max_num_reqs, self.max_num_tokens
        payload = batch.payload
        if len(payload) < 2 * (T + R):
            raise ValueError(f"the step's payload holds {len(payload)} words, fewer than the "
                             f"{2 * (T + R)} of staged_payload_words({R}, {T})")
        ids_out = payload[: 2 * T].view(np.int64)
        n, num_tokens = self._write(starts, num_new_tokens, rows, input_ids,
                                    batch.query_start_loc, batch.positions, batch.row_of_batch,
                                    batch.seq_lens, ids_out,
                                    payload[2 * T : 2 * (T + R)].view(np.int64))
        if device_payload is not self._payload:
            self._payload = device_payload
            self._ids_views.clear()
            self._last_views.clear()
        ids = self._ids_views.get(num_tokens)
        if ids is None:
            ids = self._ids_views[num_tokens] = device_payload[: 2 * num_tokens].view(torch.int64)
        last = self._last_views.get(n)
        if last is None:
            last = self._last_views[n] = device_payload[2 * T : 2 * (T + n)].view(torch.int64)
        return _model_inputs((ids, last, num_tokens))

    def _write(
        self,
        starts: np.ndarray,
        num_new_tokens: np.ndarray,
        rows: np.ndarray,
        input_ids: list[int],
        qsl_out: np.ndarray,
        positions_out: np.ndarray,
        rows_out: np.ndarray,
        seq_lens_out: np.ndarray,
        ids_out: np.ndarray,
        last_out: np.ndarray,
    ) -> tuple[int, int]:
        """The numpy work of a fill into the given int32 / int64 buffers; ``(n, num_tokens)``."""
        n = len(starts)
        if n > self.max_num_reqs:
            raise ValueError(f"{n} requests, more than max_num_reqs={self.max_num_reqs}")
        qsl = qsl_out[: n + 1]
        qsl[0] = 0
        np.add.accumulate(num_new_tokens, out=qsl[1:])  # (np.cumsum wraps this in Python)
        num_tokens = int(qsl[n])
        if num_tokens > self.max_num_tokens or len(input_ids) != num_tokens:
            raise ValueError(
                f"{num_tokens} tokens ({len(input_ids)} input ids), more than "
                f"max_num_tokens={self.max_num_tokens} or not one id per token"
            )
        positions = positions_out[:num_tokens]
        if num_tokens == n and qsl.tobytes() == self._decode_qsl[: 4 * n + 4]:
            positions[:] = starts  # one token per request: it sits at its start
        else:
            # token t of request r sits at starts[r] + t - qsl[r]
            positions[:] = np.repeat(starts - qsl[:-1], num_new_tokens)
            positions += self._arange[:num_tokens]
        rows_out[:n] = rows
        np.add(starts, num_new_tokens, out=seq_lens_out[:n], casting="unsafe")
        np.subtract(qsl[1:], 1, out=last_out[:n])
        ids_out[:num_tokens] = input_ids
        return n, num_tokens
