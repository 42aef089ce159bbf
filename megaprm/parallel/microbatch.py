"""Micro-batches for the pipeline schedule: fixed-size rows, or packed rows by a token budget.

RL responses vary widely in length, so right-padded micro-batches spend much of their compute
on padding. `make_micro_batches(..., max_tokens=N)` instead packs whole sequences (their real
tokens only) back to back into rows of at most N tokens (first-fit decreasing, like verl's
dynamic batch size / `ppo_max_token_len_per_gpu`); each packed row is one `TokenBatch` of
shape [1, T] whose `layout.cu_seqlens` makes attention block-diagonal causal and restarts RoPE
per sequence (Megatron's thd `PackedSeqParams`). Every position of a packed sequence computes
exactly what it computes in its right-padded row.

Per-token outputs computed on a micro-batch's tokens (`logits[:, :-1]` convention: position t
predicts t+1) come back to one row per sequence with `unpack(mb, x)`: [n, L-1], zeros past each
sequence's end, differentiable, so loss functions written for right-padded rows apply
unchanged. `to_rows(mbs, parts, B)` puts the per-micro-batch rows back in the caller's order.
Payload tensors stay one row per sequence ([n, ...], rows of the caller's [B, ...]), so
`unpack(mb, x)` and `mb.payload` always have the same rows.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Dict, List, Optional

import torch

from megaprm.parallel.pipeline import TokenBatch


@dataclass
class RowLayout:
    """Where a micro-batch's sequences come from and (packed) where they sit in its one row.

    rows [n] long: index of each sequence in the batch given to `make_micro_batches`;
    lengths [n] long: real tokens of each sequence; row_length: L of that batch;
    cu_seqlens [k + 1] int32 (packed only): offsets of the k segments of the packed row, the
    n sequences in order then, when the row was padded to a fixed size, one pad segment.
    """

    rows: torch.Tensor
    lengths: torch.Tensor
    row_length: int
    cu_seqlens: Optional[torch.Tensor] = None

    @property
    def packed(self) -> bool:
        return self.cu_seqlens is not None

    def position_ids(self) -> torch.Tensor:
        """[1, T]: 0, 1, ... restarting at each segment."""
        cu = self.cu_seqlens.long()
        pos = torch.arange(int(cu[-1]), device=cu.device)
        seg = torch.bucketize(pos, cu[1:], right=True)
        return (pos - cu[seg]).unsqueeze(0)

    def packed_seq_params(self):
        from megatron.core.packed_seq_params import PackedSeqParams

        cu = self.cu_seqlens
        n = int((cu[1:] - cu[:-1]).max())
        return PackedSeqParams(qkv_format="thd", cu_seqlens_q=cu, cu_seqlens_kv=cu,
                               max_seqlen_q=n, max_seqlen_kv=n)


def _index_rows(payload: Optional[Dict[str, torch.Tensor]], rows: torch.Tensor, extra: int = 0):
    if payload is None:
        return None
    out = {}
    for k, v in payload.items():
        v = v[rows]
        if extra:
            v = torch.cat([v, v.new_zeros(extra, *v.shape[1:])])
        out[k] = v
    return out


def _fixed_rows(ids, mask, payload, lengths, size, pp_size) -> List[TokenBatch]:
    """Today's split: `size` rows each; with pp > 1 the last is padded with zero rows."""
    out = []
    B, L = ids.shape
    for s in range(0, B, size):
        rows = torch.arange(s, min(s + size, B))
        extra = size - len(rows) if pp_size > 1 else 0
        mb_ids, mb_mask = ids[rows], mask[rows]
        if extra:
            mb_ids = torch.cat([mb_ids, mb_ids.new_zeros(extra, L)])
            mb_mask = torch.cat([mb_mask, mb_mask.new_zeros(extra, L)])
        out.append(TokenBatch(mb_ids, mb_mask, _index_rows(payload, rows, extra),
                              RowLayout(rows, lengths[rows], L)))
    return out


def pack_bins(lengths: List[int], max_tokens: int) -> List[List[int]]:
    """First-fit decreasing: lists of indices whose lengths sum to <= max_tokens each."""
    order = sorted(range(len(lengths)), key=lambda i: (-lengths[i], i))
    bins, room = [], []
    for i in order:
        for b, r in enumerate(room):
            if lengths[i] <= r:
                bins[b].append(i)
                room[b] -= lengths[i]
                break
        else:
            bins.append([i])
            room.append(max_tokens - lengths[i])
    return [sorted(b) for b in bins]


def _packed_row(ids, mask, payload, lengths, rows, pad_to: Optional[int]) -> TokenBatch:
    L = ids.shape[1]
    lens = lengths[rows]
    parts_ids = [ids[r, :n] for r, n in zip(rows.tolist(), lens.tolist())]
    # a sequence's last position predicts the next sequence's first token: never counted
    parts_mask = [torch.cat([mask[r, :n - 1], mask.new_zeros(1)])
                  for r, n in zip(rows.tolist(), lens.tolist())]
    seg = lens.tolist()
    total = sum(seg)
    if pad_to is not None and pad_to > total:
        parts_ids.append(ids.new_zeros(pad_to - total))
        parts_mask.append(mask.new_zeros(pad_to - total))
        seg.append(pad_to - total)
    cu = torch.zeros(len(seg) + 1, dtype=torch.int32, device=ids.device)
    cu[1:] = torch.tensor(seg, dtype=torch.int32, device=ids.device).cumsum(0)
    return TokenBatch(torch.cat(parts_ids)[None], torch.cat(parts_mask)[None],
                      _index_rows(payload, rows), RowLayout(rows, lens, L, cu))


def make_micro_batches(input_ids: torch.Tensor, loss_mask: torch.Tensor,
                       payload: Optional[Dict[str, torch.Tensor]] = None, *,
                       micro_batch_size: Optional[int] = None, max_tokens: Optional[int] = None,
                       lengths: Optional[torch.Tensor] = None,
                       pp_size: int = 1) -> List[TokenBatch]:
    """Split right-padded rows into micro-batches, by row count or packed by a token budget.

    input_ids [B, L] long, loss_mask [B, L] (position t counts the prediction of t+1),
    payload {name: [B, ...]} (kept one row per sequence), lengths [B] real tokens per row
    (required with max_tokens; default L). Exactly one of:
      micro_batch_size: rows of that many sequences ([size, L]; with pp_size > 1 the last one
        is padded with zero rows so every micro-batch has the same shape);
      max_tokens: packed rows [1, T] with T <= max_tokens (with pp_size > 1, T == max_tokens).
    With packing, loss_mask must be 0 on positions length-1 .. L-2 (they predict past the
    sequence's end, which a packed row replaces by the next sequence); the packed loss_mask is 0
    at each sequence's last position.
    """
    if (micro_batch_size is None) == (max_tokens is None):
        raise ValueError("make_micro_batches: pass exactly one of micro_batch_size / max_tokens")
    B, L = input_ids.shape
    if lengths is None:
        if max_tokens is not None:
            raise ValueError("make_micro_batches: max_tokens (packing) needs `lengths`, the real "
                             "tokens of each row")
        lengths = torch.full((B,), L, dtype=torch.long, device=input_ids.device)
    lengths = lengths.long()
    if B and (int(lengths.min()) < 1 or int(lengths.max()) > L):
        raise ValueError(f"lengths must lie in [1, {L}] (the row length); got "
                         f"[{int(lengths.min())}, {int(lengths.max())}]")
    if micro_batch_size is not None:
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size={micro_batch_size}: must be >= 1")
        return _fixed_rows(input_ids, loss_mask, payload, lengths, micro_batch_size, pp_size)
    longest = int(lengths.max()) if B else 0
    if max_tokens < longest:
        raise ValueError(f"max_tokens={max_tokens} is below the longest sequence ({longest} "
                         f"tokens); raise max_tokens to at least {longest}")
    pos = torch.arange(L, device=input_ids.device)
    # the last column predicts nothing in a right-padded row either: not checked
    past_end = (pos[None, :] >= (lengths[:, None] - 1)) & (pos[None, :] < L - 1)
    if bool((loss_mask.ne(0) & past_end).any()):
        r = int((loss_mask.ne(0) & past_end).any(1).nonzero()[0])
        raise ValueError(f"loss_mask row {r} counts a prediction at or past position "
                         f"length-1={int(lengths[r]) - 1}; packing needs lengths that cover "
                         "every masked target")
    bins = pack_bins(lengths.tolist(), max_tokens)
    pad_to = max_tokens if pp_size > 1 else None
    return [_packed_row(input_ids, loss_mask, payload, lengths,
                        torch.tensor(b, dtype=torch.long, device=input_ids.device), pad_to)
            for b in bins]


def unpack(mb: TokenBatch, x: torch.Tensor, fill: float = 0.0) -> torch.Tensor:
    """Per-token outputs of `mb` -> the rows of `mb.payload` (one per sequence, `layout.rows`).

    Packed: x [1, T-1, ...] (the `logits[:, :-1]` convention) -> [n, L-1, ...], or x [1, T, ...]
    (aligned with input_ids) -> [n, L, ...]; positions past a sequence's end hold `fill`.
    Differentiable. Right-padded micro-batches are returned as they are (their payload keeps
    the pp padding rows too; `to_rows` drops them)."""
    layout = mb.layout
    if layout is None or not layout.packed:
        return x
    shift = mb.input_ids.shape[1] - x.shape[1]
    assert shift in (0, 1) and x.shape[0] == 1, "unpack: x must be [1, T] or [1, T-1] (packed)"
    width = layout.row_length - shift
    j = torch.arange(width, device=x.device)
    start = layout.cu_seqlens[:-1][: len(layout.rows)].long()
    idx = (start[:, None] + j[None, :]).clamp(max=x.shape[1] - 1)  # [n, width]
    valid = j[None, :] < (layout.lengths[:, None] - shift)
    flat = x[0]
    vals = flat[idx.reshape(-1)].reshape(*idx.shape, *flat.shape[1:])
    valid = valid.reshape(*valid.shape, *([1] * (vals.dim() - 2)))
    return torch.where(valid, vals, torch.full_like(vals, fill))


def to_rows(micro_batches: List[TokenBatch], parts: List[torch.Tensor],
            num_rows: int) -> torch.Tensor:
    """Per-micro-batch `unpack`ed rows -> [num_rows, ...] in the caller's original row order."""
    first = parts[0]
    out = first.new_zeros(num_rows, *first.shape[1:])
    for mb, part in zip(micro_batches, parts):
        rows = mb.layout.rows.to(out.device)
        out[rows] = part[: len(rows)]
    return out
