"""Apply parallelism to a plain Kiln Transformer from outside, in torchtitan's order:
tensor (+ sequence) parallel -> activation checkpointing -> compile -> FSDP2 or DDP.
With train.precision = "fp8" the trainer has already swapped the block linears for torchao's
Float8Linear (kiln.train.precision.convert_to_fp8), as torchtitan converts before all of these;
FSDP2 then all-gathers their bf16 weights and each matmul casts to float8 itself.

The model file knows nothing of this: every function here rewrites modules in place (DTensor
parameters, hooks, wrappers) while keeping parameter names, so a checkpoint saved under one layout
loads under any other.
"""

from __future__ import annotations

import torch
import torch.nn as nn
from torch.utils.checkpoint import CheckpointPolicy, checkpoint, create_selective_checkpoint_contexts

from kiln.model.config import AC_MODES
from kiln.parallel.config import ParallelConfig
from kiln.parallel.context import apply_context_parallel
from kiln.parallel.dims import ParallelDims
from kiln.parallel.expert import apply_expert_parallel

DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}


def apply_tensor_parallel(model: nn.Module, tp_mesh) -> None:
    """Megatron-style column/row splits with sequence parallelism and a vocabulary-parallel loss.

    Between blocks the residual stream is split along the sequence (Shard(1)): norms run on a
    sequence shard, and each attention/FFN gathers the full sequence on entry and reduce-scatters
    back on exit, which costs the same communication as plain TP's all-reduce but divides the
    activation memory of norms and residuals by the TP degree. The head's logits stay sharded over
    the vocabulary; the loss must run inside `torch.distributed.tensor.parallel.loss_parallel()`.
    Column chunks of `wqkv` are whole kv groups by the model's row layout; SwiGLU's w1 (gate) and w3
    (up) split alike, so each rank holds the gate and up rows of the same hidden units.
    """
    from torch.distributed.tensor import Replicate, Shard
    from torch.distributed.tensor.parallel import (
        ColwiseParallel,
        PrepareModuleInput,
        RowwiseParallel,
        SequenceParallel,
        parallelize_module,
    )

    top = {
        "tok_embeddings": RowwiseParallel(input_layouts=Replicate(), output_layouts=Shard(1)),
        "norm": SequenceParallel(),
        "output": ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False),
    }
    # A pipeline stage holds only some of these (the first the embedding, the last norm and head).
    top = {name: style for name, style in top.items() if getattr(model, name, None) is not None}
    if getattr(model, "is_first", True) is False:
        # A later pipeline stage receives the residual stream whole from the previous stage; its
        # first block takes a sequence shard, as it would from the embedding on the first stage.
        # (On the block, not the stage: the stage sizes the RoPE tables from the whole sequence.)
        parallelize_module(
            model.layers[0],
            tp_mesh,
            PrepareModuleInput(
                input_layouts=(Replicate(), None, None),
                desired_input_layouts=(Shard(1), None, None),
                use_local_output=True,
            ),
        )
    if getattr(model, "is_last", True) is False:
        # ... and gives the next stage a whole tensor, not a sequence shard.
        from torch.distributed.tensor.parallel import PrepareModuleOutput

        parallelize_module(
            model,
            tp_mesh,
            PrepareModuleOutput(
                output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),), use_local_output=True
            ),
        )
    if top:
        parallelize_module(model, tp_mesh, top)
    for block in model.layers:
        plan = {
            "attn_norm": SequenceParallel(),
            "attn": PrepareModuleInput(
                input_layouts=(Shard(1), None, None), desired_input_layouts=(Replicate(), None, None)
            ),
            "attn.wqkv": ColwiseParallel(),
            "attn.wo": RowwiseParallel(output_layouts=Shard(1)),
            "ffn_norm": SequenceParallel(),
            "ffn": PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),)),
            "ffn.w2": RowwiseParallel(output_layouts=Shard(1)),
        }
        plan["ffn.w1"] = ColwiseParallel()
        if block.ffn.swiglu:
            plan["ffn.w3"] = ColwiseParallel()
        parallelize_module(block, tp_mesh, plan)


# Op-level selective checkpointing (torchtitan's "op" policy): inside a checkpointed block these ops'
# outputs are kept and everything else is recomputed in backward. Matmuls and attention are the
# expensive ops to redo; norms, RoPE, SiLU and products are cheap elementwise work. The attention
# entries cover every SDPA backend (CUDA flash / memory-efficient / cuDNN, the CPU flash kernel); the
# math fallback decomposes above this level and is recomputed. A reduce-scatter (tensor parallelism's
# row-parallel output) is kept so that backward does not repeat the collective.
SAVED_OPS = {
    torch.ops.aten._scaled_dot_product_flash_attention.default,
    torch.ops.aten._scaled_dot_product_efficient_attention.default,
    torch.ops.aten._scaled_dot_product_cudnn_attention.default,
    torch.ops.aten._scaled_dot_product_flash_attention_for_cpu.default,
    torch.ops._c10d_functional.reduce_scatter_tensor.default,
}
MATMUL_OPS = {torch.ops.aten.mm.default, torch.ops.aten.addmm.default}


def selective_policy(model_dim: int):
    """A fresh policy for one checkpointed call: keep attention and every matmul except those back to
    the residual width `model_dim` (wo, w2, the experts' w2). The kept ones are wqkv, w1 and w3 (the
    outputs backward reads: q/k/v, gate, up) and an MoE router's. wo is recomputed (one h x h matmul,
    for the norm input after the attention residual); w2's output is read by nothing in backward (the
    residual add keeps nothing, w2's own backward needs its input), so it is neither kept nor
    recomputed: recomputation stops at its input. In an MoE layer a routed expert's w2 output is
    recomputed for the router weights' gradient. Keeping every matmul would keep two more width-h
    values per token (wo's and w2's outputs) to spare the one wo matmul. (torchtitan keeps every
    other matmul; with separate w1 and w3 that would recompute w3 and keep w2's unread output.)
    A matmul whose other width happens to equal model_dim is recomputed too: correct, only slower."""

    def policy(ctx, func, *args, **kwargs):
        if func in MATMUL_OPS:
            keep = args[-1].shape[-1] != model_dim  # mm(a, b) and addmm(bias, a, b): out width is b's
        else:
            keep = func in SAVED_OPS
        return CheckpointPolicy.MUST_SAVE if keep else CheckpointPolicy.PREFER_RECOMPUTE

    return policy


def apply_activation_checkpointing(model: torch.nn.Module, mode: str = "full") -> None:
    """Recompute each block's activations in backward instead of storing them: all of them ("full",
    only the block input is kept) or all but the outputs selective_policy keeps ("selective").

    Done by replacing each block's forward on the instance, so parameter names (and therefore
    checkpoints) stay the same as without it. Non-reentrant checkpointing supports keyword
    arguments and inputs that do not require grad.
    """
    if mode not in AC_MODES:
        raise ValueError(f"activation checkpointing mode must be one of {', '.join(AC_MODES)}, got {mode!r}")
    if mode == "none":
        return
    extra = {}
    if mode == "selective":
        dim = model.cfg.dim  # every Kiln model and pipeline stage carries its config
        extra = {"context_fn": lambda: create_selective_checkpoint_contexts(selective_policy(dim))}
    for block in model.layers:

        def forward(*args, _block_forward=block.forward, **kwargs):
            return checkpoint(_block_forward, *args, use_reentrant=False, **extra, **kwargs)

        block.forward = forward


def apply_compile(model: nn.Module) -> None:
    """Compile each block on its own: the graphs are small and identical, so one compilation
    serves every layer, and FSDP's per-block hooks stay outside the compiled regions."""
    for i, block in enumerate(model.layers):
        model.layers[i] = torch.compile(block)


def apply_fsdp(model: nn.Module, mesh, cfg: ParallelConfig, param_dtype: torch.dtype, experts_mesh=None) -> None:
    """FSDP2 per block, then the root (embeddings, final norm, head).

    With bf16 compute the parameters are all-gathered in bf16 while the sharded master copy stays
    fp32; gradients are reduce-scattered in reduce_dtype (fp32 by default, so low precision never
    accumulates in the update; bf16 halves the bytes sent, under any compute precision).
    On a 2-D (replicate, shard) mesh this is HSDP: shards within a group, replicas across groups.
    """
    from torch.distributed.fsdp import CPUOffloadPolicy, MixedPrecisionPolicy, fully_shard

    mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=DTYPES[cfg.reduce_dtype])
    # Pinned host memory makes the copies to the GPU asynchronous; it needs an accelerator, and
    # without one it fails at wrap time (tests wrap CPU models on a gloo mesh).
    offload = CPUOffloadPolicy(pin_memory=mesh.device_type == "cuda") if cfg.offload else None
    kwargs = {"mesh": mesh, "mp_policy": mp}
    if offload is not None:
        kwargs["offload_policy"] = offload
    last = len(model.layers) - 1
    for i, block in enumerate(model.layers):
        experts = getattr(getattr(block, "ffn", None), "experts", None)
        block_kwargs = kwargs
        if experts is not None and experts_mesh is not None and not isinstance(experts_mesh, _NoMesh):
            # Expert weights are already split over the ep ranks; FSDP shards them further only over
            # the data-parallel ranks outside the ep group (a block-level wrap would meet their
            # ep DTensors). Their gradients keep FSDP's default averaging, matching the all-to-all's.
            fully_shard(experts, reshard_after_forward=cfg.reshard_after_forward, **{**kwargs, "mesh": experts_mesh})
        elif experts is not None and isinstance(experts_mesh, _NoMesh):
            # Every data-parallel rank is in the ep group: each expert lives on one rank and its
            # gradient already sums every rank's tokens (the all-to-all), so FSDP leaves it alone.
            block_kwargs = {**kwargs, "ignored_params": set(experts.parameters())}
        # The last block's parameters are needed again at once by backward, so keeping them
        # unsharded after forward saves one all-gather.
        fully_shard(block, reshard_after_forward=cfg.reshard_after_forward and i < last, **block_kwargs)
    fully_shard(model, reshard_after_forward=cfg.reshard_after_forward, **kwargs)


class _NoMesh:
    """Expert parallelism covers every data-parallel rank: no mesh is left to shard experts over."""


def apply_ddp(model: nn.Module, dp_mesh) -> nn.Module:
    from torch.nn.parallel import DistributedDataParallel

    return DistributedDataParallel(model, process_group=dp_mesh.get_group() if dp_mesh is not None else None)


def parallelize(
    model: nn.Module,
    dims: ParallelDims,
    mesh,
    cfg: ParallelConfig,
    *,
    compute_dtype: torch.dtype,
    activation_checkpointing: str,
    compile_blocks: bool,
) -> nn.Module:
    """Apply every configured parallelism except pipelining to `model` (the whole model, or one
    pipeline stage) in place; returns the module to call for training (it, or its DDP wrapper)."""
    if dims.tp > 1:
        apply_tensor_parallel(model, dims.submesh(mesh, "tp"))
    if dims.ep > 1:
        apply_expert_parallel(model, dims.submesh(mesh, "ep"))
    if dims.cp > 1:
        apply_context_parallel(
            model, dims.submesh(mesh, "cp"), load_balance=cfg.cp_load_balance, backend=cfg.cp_backend
        )
    apply_activation_checkpointing(model, activation_checkpointing)
    if compile_blocks:
        apply_compile(model)
    # One process with offload shards over a one-rank mesh: FSDP2 then only moves parameters.
    if dims.fsdp or (dims.world_size == 1 and cfg.offload):
        shard_mesh = dims.submesh(mesh, "dp_shard_cp")
        if dims.dp_replicate > 1:  # HSDP: a 2-D (replicate, shard) mesh
            shard_mesh = mesh[("dp_replicate", shard_mesh.mesh_dim_names[0])]
        experts_mesh = None
        if dims.ep > 1:
            outside = [n for n in ("dp_replicate", "dp_shard_mod_ep", "cp") if n in mesh.mesh_dim_names]
            experts_mesh = mesh[tuple(outside)] if outside else _NoMesh()
        apply_fsdp(model, shard_mesh, cfg, compute_dtype, experts_mesh)
        return model
    # Under DiLoCo the replicas step on their own gradients; kiln.parallel.diloco averages weights.
    if dims.dp_replicate > 1 and not (dims.tp > 1 or dims.pp > 1) and cfg.outer == "none":
        return apply_ddp(model, dims.submesh(mesh, "dp_replicate"))
    return model
