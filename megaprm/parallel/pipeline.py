"""The one seam into Megatron's pipeline schedules: forward-only and training steps.

Callers hand in a list of micro-batches (any objects) and two callables:

* `forward(model, mb) -> output`: runs the stage (`gpt_forward` for the usual causal LM);
* `post(mb, output) -> (loss_sum | None, payload)`: on the last stage only. For training,
  `loss_sum` must already be divided by the global normaliser (e.g. the token count of the whole
  mini-batch over all dp ranks): the config sets `calculate_per_token_loss`, so Megatron neither
  divides by the micro-batch count nor averages grads over dp, and the normalisation lives in
  exactly one place, the trainer.

Micro-batches may differ in length when pp == 1; with pp > 1 Megatron's p2p exchange needs one
[s, b, h] shape, so callers pad to a common `seq_length` (`pad_to` helps).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, List, Optional

import torch
import torch.distributed as dist

from megaprm.parallel import cpu
from megaprm.parallel.device import model_device, to_device
from megaprm.parallel.groups import Groups


@dataclass
class TokenBatch:
    """Token sequences of one micro-batch, as the model sees them.

    input_ids [b, s] long; loss_mask [b, s] float (1 on tokens whose *next-token* prediction
    counts, i.e. position t predicts input_ids[t+1]); payload: method-specific tensors [n, ...],
    one row per sequence. `layout` (`parallel.microbatch.RowLayout`, from
    `microbatch.make_micro_batches`) says which source rows the sequences are and, for packed
    rows (b = 1, several sequences back to back), where each starts; None = right-padded rows.
    """

    input_ids: torch.Tensor
    loss_mask: torch.Tensor
    payload: Any = None
    layout: Any = None

    @property
    def seq_length(self) -> int:
        return self.input_ids.shape[1]


def causal_mask(seq_len: int, device=None) -> torch.Tensor:
    """[1, 1, s, s] bool, True = masked (Megatron's convention for the local attention)."""
    return torch.ones(seq_len, seq_len, dtype=torch.bool, device=device).triu(1)[None, None]


def gpt_forward(model, mb: TokenBatch) -> torch.Tensor:
    """GPTModel stage forward: logits [b, s, V/tp] on the last stage.

    Right-padded rows pass no mask (causal attention: every real position sees only real
    tokens, no [s, s] mask is built); packed rows pass Megatron's PackedSeqParams (thd), so
    RoPE restarts and attention stays inside each sequence."""
    ids = mb.input_ids
    layout = mb.layout
    if layout is not None and layout.cu_seqlens is not None:
        return model(input_ids=ids, position_ids=layout.position_ids(), attention_mask=None,
                     packed_seq_params=layout.packed_seq_params())
    b, s = ids.shape
    pos = torch.arange(s, device=ids.device).unsqueeze(0).expand(b, s)
    return model(input_ids=ids, position_ids=pos, attention_mask=None)


def pad_to(t: torch.Tensor, length: int, value=0) -> torch.Tensor:
    """Right-pad dim 1 of [b, s, ...] to `length`."""
    if t.shape[1] == length:
        return t
    pad = torch.full((t.shape[0], length - t.shape[1], *t.shape[2:]), value,
                     dtype=t.dtype, device=t.device)
    return torch.cat([t, pad], dim=1)


def unwrap(model):
    """The model inside a DDP wrapper (`wrap_ddp`), or the model itself."""
    return model.module if hasattr(model, "module") else model


def run(model, micro_batches: List[TokenBatch], *, groups: Groups,
        forward: Callable = gpt_forward,
        post: Callable[[TokenBatch, torch.Tensor], tuple],
        forward_only: bool) -> List[Any]:
    """Run the schedule; returns the payloads `post` produced, on the last stage (else [])."""
    from megatron.core.pipeline_parallel import get_forward_backward_func

    if not micro_batches:
        return []
    seq_length = max(mb.seq_length for mb in micro_batches)
    if groups.pp_size > 1 and any(mb.seq_length != seq_length for mb in micro_batches):
        raise ValueError("with pp > 1 every micro-batch must have the same length (use pad_to)")
    mbs = micro_batches[0].input_ids.shape[0]
    if groups.pp_size > 1 and any(mb.input_ids.shape[0] != mbs for mb in micro_batches):
        raise ValueError("with pp > 1 every micro-batch must have the same batch size")

    device = model_device(model)

    def step(data_iterator, model_chunk):
        mb = to_device(next(data_iterator), device)  # the device rule's one crossing point
        with cpu.paused():  # the model and the loss name no CUDA device (parallel.cpu)
            output = forward(model_chunk, mb)

        def loss_func(output_tensor):
            with cpu.paused():
                loss, payload = post(mb, output_tensor)
            if loss is None:
                loss = output_tensor.sum() * 0.0
            return loss, torch.tensor(1, dtype=torch.int), {"payload": payload}

        return output, loss_func

    fb = get_forward_backward_func()
    out = fb(forward_step_func=step, data_iterator=iter(micro_batches), model=[model],
             num_microbatches=len(micro_batches), seq_length=seq_length,
             micro_batch_size=mbs, forward_only=forward_only)
    return [o["payload"] for o in out] if groups.is_last_stage else []


def broadcast_from_last_stage(obj: Any, groups: Groups) -> Any:
    """Give every pp stage the last stage's Python object (results of a forward-only pass)."""
    if groups.pp_size == 1:
        return obj
    box = [obj if groups.is_last_stage else None]
    src = dist.get_global_rank(groups.pp, groups.pp_size - 1)
    dist.broadcast_object_list(box, src=src, group=groups.pp)
    return box[0]


# --------------------------------------------------------------------------------- training

def wrap_ddp(model, groups: Groups, *, distributed_optimizer: Optional[bool] = None,
             grad_reduce_in_fp32: bool = True):
    """Megatron DDP: contiguous grad buffers in fp32 (in the parameters' dtype with
    `grad_reduce_in_fp32=False`), grads summed (not averaged) over dp.

    distributed_optimizer: shard the optimiser state over dp (Megatron's DistributedOptimizer);
    default: on CUDA with dp > 1 (Megatron's optimizer refuses CPU tensors).

    overlap_grad_reduce stays off: Megatron's overlapped hook asserts every parameter DDP holds
    gets a grad in every backward, which a trainable PRM breaks (its LM head is unused when
    lm_loss_weight = 0), and the overlap is only correct with the schedule's no_sync/grad_sync
    hooks wired into the model config (else buckets reduce after the first micro-batch):
    neither is tested without a GPU."""
    from megatron.core.distributed import (
        DistributedDataParallel,
        DistributedDataParallelConfig,
    )

    if distributed_optimizer is None:
        distributed_optimizer = torch.cuda.is_available() and groups.dp_size > 1
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=grad_reduce_in_fp32, overlap_grad_reduce=False,
        use_distributed_optimizer=distributed_optimizer,
    )
    return DistributedDataParallel(config=model.config, ddp_config=ddp_config, module=model)


def optional_group(group) -> Optional[Any]:
    return group if group is not None and dist.get_world_size(group) > 1 else None
