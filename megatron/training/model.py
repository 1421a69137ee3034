"""The model as Megatron-LM builds it: GPTModel chunks from the recipe's flags, wrapped for
mixed precision and Megatron DDP, and the optimizer and its schedule.

One chunk per pipeline rank, or ``--num-layers-per-virtual-pipeline-stage`` /
``--num-virtual-stages-per-pipeline-rank`` chunks for the interleaved 1F1B schedule (each a
``GPTModel`` with its ``vp_stage``; the first chunk's DDP buckets its gradients, the others
do not, as Megatron-LM's ``get_model`` does).

With CUDA the defaults are those Megatron-LM users run: Transformer Engine's layers when it
imports (``--transformer-impl local`` opts out), its fused kernels, gradient accumulation
fusion, the distributed optimizer with overlapped gradient reduce and parameter gather. On
CPU the same flags build megatron-core's local layers with the unfused kernels, and the
distributed optimizer and overlap only when asked for (on two cores they buy nothing).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from megatron.core import parallel_state
from megatron.core.distributed import DistributedDataParallel, DistributedDataParallelConfig
from megatron.core.models.gpt import GPTModel
from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
from megatron.core.optimizer import OptimizerConfig, get_megatron_optimizer
from megatron.core.optimizer_param_scheduler import OptimizerParamScheduler
from megatron.core.transformer import TransformerConfig
from megatron.core.transformer.module import Float16Module

from .arguments import default_distributed_optimizer
from .console import log_rank0


def params_dtype(args) -> torch.dtype:
    return torch.bfloat16 if args.bf16 else torch.float16 if args.fp16 else torch.float32


def uses_distributed_optimizer(args) -> bool:
    """``--use-distributed-optimizer``, or its default (see ``default_distributed_optimizer``)."""
    flag = args.use_distributed_optimizer
    return default_distributed_optimizer(args) if flag is None else flag


def _overlap(args, flag: bool | None) -> bool:
    return (torch.cuda.is_available() and uses_distributed_optimizer(args)) if flag is None else flag


def _overlap_param_gather(args) -> bool:
    """Off by default under ``--replica-recovery``: overlapped, the all-gather of an update's
    parameters waits for the next forward, and a dump taken in between would hold weights
    that other shards updated and this rank has not yet received (the merge then refuses)."""
    if args.overlap_param_gather is None and getattr(args, "replica_recovery", False):
        return False
    return _overlap(args, args.overlap_param_gather)


def _transformer_engine_spec(args):
    """Transformer Engine's layers, or None where it is not there (or broken: a missing shared
    library raises OSError, a version clash anything) and the local ones must do."""
    if not torch.cuda.is_available() or args.transformer_impl != "transformer_engine":
        return None
    try:
        from megatron.core.models.gpt.gpt_layer_specs import (
            get_gpt_layer_with_transformer_engine_spec,
        )
        import transformer_engine  # noqa: F401  (only its presence matters)

        return get_gpt_layer_with_transformer_engine_spec()
    except ImportError:
        return None
    except Exception as error:
        log_rank0(f"warning: Transformer Engine does not import ({type(error).__name__}: "
                  f"{error}); using megatron-core's local layers")
        return None


def uses_transformer_engine(args) -> bool:
    return _transformer_engine_spec(args) is not None


def layer_spec(args):
    return _transformer_engine_spec(args) or get_gpt_layer_local_spec(normalization=args.normalization)


def transformer_config(args) -> TransformerConfig:
    cuda = torch.cuda.is_available()
    te = uses_transformer_engine(args)
    recompute_layers = args.recompute_num_layers or (1 if args.recompute_method else None)
    return TransformerConfig(
        num_layers=args.num_layers, hidden_size=args.hidden_size,
        ffn_hidden_size=args.ffn_hidden_size, num_attention_heads=args.num_attention_heads,
        num_query_groups=args.num_query_groups, kv_channels=args.kv_channels,
        hidden_dropout=args.hidden_dropout, attention_dropout=args.attention_dropout,
        init_method_std=args.init_method_std, normalization=args.normalization,
        layernorm_epsilon=args.norm_epsilon, add_bias_linear=args.add_bias_linear,
        gated_linear_unit=args.swiglu, activation_func=F.silu if args.swiglu else F.gelu,
        attention_softmax_in_fp32=args.attention_softmax_in_fp32,
        tensor_model_parallel_size=args.tensor_model_parallel_size,
        pipeline_model_parallel_size=args.pipeline_model_parallel_size,
        virtual_pipeline_model_parallel_size=args.virtual_pipeline_model_parallel_size,
        sequence_parallel=args.sequence_parallel,
        recompute_granularity=args.recompute_granularity, recompute_method=args.recompute_method,
        recompute_num_layers=recompute_layers if args.recompute_granularity == "full" else None,
        params_dtype=params_dtype(args), pipeline_dtype=params_dtype(args),
        bf16=args.bf16, fp16=args.fp16, use_cpu_initialization=not cuda,
        # Fused kernels are CUDA-only; their unfused forms compute the same thing.
        bias_activation_fusion=cuda and (args.bias_swiglu_fusion if args.swiglu
                                         else args.bias_gelu_fusion),
        masked_softmax_fusion=cuda and args.masked_softmax_fusion,
        bias_dropout_fusion=cuda and args.bias_dropout_fusion,
        apply_rope_fusion=te and args.rope_fusion and args.position_embedding_type == "rope",
        persist_layer_norm=False,
        # Needs the fused weight-gradient kernel Transformer Engine brings.
        gradient_accumulation_fusion=te and args.gradient_accumulation_fusion,
        # The interleaved schedule overlaps its sends; batched ones cannot be overlapped.
        overlap_p2p_comm=cuda and bool(args.virtual_pipeline_model_parallel_size),
        batch_p2p_comm=cuda and not args.virtual_pipeline_model_parallel_size,
    )


@dataclass
class Model:
    """The model chunks of this rank: Megatron DDP wrappers, and the GPTModels inside."""

    chunks: list[DistributedDataParallel]
    modules: list[GPTModel]

    def sharded_state_dict(self, metadata: dict) -> dict:
        """Megatron-LM's names: ``model``, or ``model0``, ``model1``... for virtual stages
        (only the nesting differs; the tensors' keys are global)."""
        if len(self.modules) == 1:
            return {"model": self.modules[0].sharded_state_dict(metadata=metadata)}
        return {f"model{index}": module.sharded_state_dict(metadata=metadata)
                for index, module in enumerate(self.modules)}

    def load_state_dict(self, loaded: dict) -> None:
        if len(self.modules) == 1:
            self.modules[0].load_state_dict(loaded["model"])
            return
        for index, module in enumerate(self.modules):
            module.load_state_dict(loaded[f"model{index}"])

    def sync_params(self) -> None:
        """Finish a parameter all-gather the overlap left for the next forward (before a save
        or an evaluation reads the weights)."""
        for chunk in self.chunks:
            if chunk.ddp_config.overlap_param_gather:
                chunk.start_param_sync(force_sync=True)

    def zero_grad_buffer(self) -> None:
        for chunk in self.chunks:
            chunk.zero_grad_buffer()

    def train(self, mode: bool = True) -> None:
        for chunk in self.chunks:
            chunk.train(mode)


def _chunk(args, config: TransformerConfig, vocab_size: int, vp_stage: int | None) -> GPTModel:
    first = parallel_state.is_pipeline_first_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    last = parallel_state.is_pipeline_last_stage(ignore_virtual=vp_stage is None, vp_stage=vp_stage)
    module = GPTModel(
        config=config, transformer_layer_spec=layer_spec(args), vocab_size=vocab_size,
        max_sequence_length=args.max_position_embeddings, pre_process=first, post_process=last,
        share_embeddings_and_output_weights=not args.untie_embeddings_and_output_weights,
        position_embedding_type=args.position_embedding_type, rotary_base=args.rotary_base,
        rotary_percent=args.rotary_percent, vp_stage=vp_stage)
    if torch.cuda.is_available():
        module.cuda(torch.cuda.current_device())
    return module


def build_model(args, config: TransformerConfig, vocab_size: int) -> Model:
    """This rank's GPTModel chunks, each wrapped for mixed precision and Megatron DDP."""
    virtual = args.virtual_pipeline_model_parallel_size
    stages = list(range(virtual)) if virtual else [None]
    modules = [_chunk(args, config, vocab_size, stage) for stage in stages]
    distributed = uses_distributed_optimizer(args)
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True, use_distributed_optimizer=distributed,
        overlap_grad_reduce=_overlap(args, args.overlap_grad_reduce),
        overlap_param_gather=distributed and _overlap_param_gather(args),
        num_distributed_optimizer_instances=args.num_distributed_optimizer_instances,
        check_for_nan_in_grad=False)  # the trainer's own guard agrees across ranks
    chunks = []
    for index, module in enumerate(modules):
        wrapped = Float16Module(config, module) if (args.bf16 or args.fp16) else module
        chunks.append(DistributedDataParallel(config=config, ddp_config=ddp_config, module=wrapped,
                                              disable_bucketing=index > 0))
    return Model(chunks, modules)


def connect_schedule_hooks(config: TransformerConfig, model: Model, optimizer) -> None:
    """What the pipeline schedules call: Megatron-LM's ``setup_model_and_optimizer`` wiring."""
    from megatron.core.distributed.finalize_model_grads import finalize_model_grads

    chunks = model.chunks
    pick = (lambda fns: fns[0]) if len(chunks) == 1 else (lambda fns: fns)
    config.no_sync_func = pick([chunk.no_sync for chunk in chunks])
    config.finalize_model_grads_func = finalize_model_grads
    config.grad_scale_func = optimizer.scale_loss
    if chunks[0].ddp_config.overlap_grad_reduce:
        config.grad_sync_func = pick([chunk.start_grad_sync for chunk in chunks])
    if chunks[0].ddp_config.overlap_param_gather:
        config.param_sync_func = pick([chunk.start_param_sync for chunk in chunks])


def build_optimizer(args, model: Model):
    """Megatron's optimizer over every chunk, and its LR/WD schedule counted in samples (so a
    resume at another global batch keeps it)."""
    config = OptimizerConfig(
        optimizer="adam", lr=args.lr, min_lr=args.min_lr, weight_decay=args.weight_decay,
        adam_beta1=args.adam_beta1, adam_beta2=args.adam_beta2, adam_eps=args.adam_eps,
        clip_grad=args.clip_grad, bf16=args.bf16, fp16=args.fp16,
        params_dtype=params_dtype(args), use_distributed_optimizer=uses_distributed_optimizer(args))
    optimizer = get_megatron_optimizer(config, model.chunks)
    scheduler = OptimizerParamScheduler(
        optimizer, init_lr=0.0 if args.lr_warmup_samples else args.lr, max_lr=args.lr,
        min_lr=args.min_lr, lr_warmup_steps=args.lr_warmup_samples,
        lr_decay_steps=args.lr_decay_samples, lr_decay_style=args.lr_decay_style,
        start_wd=args.weight_decay, end_wd=args.weight_decay,
        wd_incr_steps=args.train_samples, wd_incr_style="constant",
        use_checkpoint_opt_param_scheduler=args.use_checkpoint_opt_param_scheduler,
        override_opt_param_scheduler=args.override_opt_param_scheduler)
    return optimizer, scheduler


def optimizer_metadata(args) -> dict:
    """How the optimizer state is sharded in a checkpoint (Megatron-LM's ``content_metadata``):
    the distributed optimizer fully reshardable, so a checkpoint resumes under any TP/PP/DP
    (megatron-core 0.16.1's default format refuses to save, and its DP-reshardable one cannot
    change TP or PP)."""
    metadata = {"singleton_local_shards": False, "chained_optim_avoid_prefix": True}
    if uses_distributed_optimizer(args):
        metadata.update(distrib_optim_sharding_type="fully_reshardable",
                        distrib_optim_fully_reshardable_mem_efficient=bool(
                            args.distrib_optim_fully_reshardable_mem_efficient))
    return metadata


def needs_data(vp_stage: int | None = None) -> bool:
    """Whether a chunk reads batches: tokens on the first stage, labels on the last."""
    ignore = vp_stage is None
    return (parallel_state.is_pipeline_first_stage(ignore_virtual=ignore, vp_stage=vp_stage)
            or parallel_state.is_pipeline_last_stage(ignore_virtual=ignore, vp_stage=vp_stage))
