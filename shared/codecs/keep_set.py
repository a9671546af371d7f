"""A layer's keep set on the wire: the kept original positions [H, n] (H = 1 when one set serves
every KV head) as the payload "keep", in whichever encoding is smaller, so that its element type
and shape follow from the header alone (T, n, H):
- a bitmap, uint8 [H, ceil(T / 8)] (bit t of a row: byte t // 8, bit t % 8, least significant
  first), when ceil(T / 8) <= 4 n;
- else deltas, int32 [H, n]: the first position, then each position minus the one before.
`decode` checks what a peer sent (DataLoss naming the layer, the row and the limit): positions in
[0, T), strictly ascending, exactly n per row. Knows nothing about codecs or models.
"""

from __future__ import annotations

import torch

from shared.errors import DataLoss

KEEP_PAYLOAD = "keep"
_BITS = torch.tensor([1 << b for b in range(8)], dtype=torch.uint8)


def is_bitmap(num_tokens: int, kept: int) -> bool:
    return -(-num_tokens // 8) <= 4 * kept


def wire_shape(num_tokens: int, kept: int, rows: int) -> tuple[torch.dtype, tuple[int, int]]:
    """(element type, shape) of the "keep" payload of H = rows keep sets of `kept` of num_tokens."""
    if is_bitmap(num_tokens, kept):
        return torch.uint8, (rows, -(-num_tokens // 8))
    return torch.int32, (rows, kept)


def encode(positions: torch.Tensor, num_tokens: int) -> torch.Tensor:
    """positions [H, n] (ascending, < num_tokens) -> the "keep" payload (CPU)."""
    positions = positions.to("cpu", torch.long)
    rows, kept = positions.shape
    if not is_bitmap(num_tokens, kept):
        return torch.diff(positions, dim=1, prepend=torch.zeros(rows, 1, dtype=torch.long)).to(torch.int32)
    nbytes = -(-num_tokens // 8)
    mask = torch.zeros(rows, nbytes * 8, dtype=torch.bool)
    mask.scatter_(1, positions, True)
    return (mask.view(rows, nbytes, 8).to(torch.uint8) * _BITS).sum(dim=-1, dtype=torch.uint8)


def decode(payload: torch.Tensor, num_tokens: int, kept: int, layer: int) -> torch.Tensor:
    """The "keep" payload (dtype and shape already checked against wire_shape) -> positions
    [H, n] long; DataLoss when a row is out of range, not strictly ascending or not n long."""
    where = f"layer {layer}, payload {KEEP_PAYLOAD!r}"
    if payload.dtype == torch.uint8:
        bits = (payload[..., None] & _BITS).ne(0).reshape(payload.shape[0], -1)  # [H, 8 * ceil(T / 8)]
        if bits[:, num_tokens:].any():
            raise DataLoss(f"{where}: a kept position >= num_tokens={num_tokens} (bitmap bit past the context)")
        counts = bits.sum(dim=1)
        bad = torch.nonzero(counts != kept).flatten()
        if bad.numel():
            row = int(bad[0])
            raise DataLoss(f"{where}: row {row} keeps {int(counts[row])} positions, header.kept_tokens={kept}")
        return torch.nonzero(bits)[:, 1].view(payload.shape[0], kept)
    deltas = payload.to(torch.long)
    if (deltas[:, 1:] < 1).any() or (deltas[:, :1] < 0).any():
        row = int(torch.nonzero((deltas[:, 1:] < 1).any(dim=1) | (deltas[:, :1] < 0).any(dim=1)).flatten()[0])
        raise DataLoss(f"{where}: row {row} is not strictly ascending from 0 (a delta < 1, or a first position < 0)")
    positions = deltas.cumsum(dim=1)
    if (positions[:, -1] >= num_tokens).any():
        row = int(torch.nonzero(positions[:, -1] >= num_tokens).flatten()[0])
        raise DataLoss(f"{where}: row {row} reaches position {int(positions[row, -1])} >= num_tokens={num_tokens}")
    return positions
