"""bf16 parameters with fp32 master weights (`trainer.bf16_params`): the model computes in bf16 with no autocast,
the optimizer steps fp32 copies.

Under bf16 autocast the model's parameters are fp32 and autocast casts each weight to bf16 in every batch's
forward, casts each weight's gradient back in every backward, and casts the activations between its fp32 ops
(LayerNorm, the residual stream) and its bf16 matmuls (the counts: docs/gpu.md, from benchmarks/recipe_efficiency.py). With bf16 parameters there is no cast in the
forward or the backward; the update adds two multi-tensor copies: the gradients into the fp32 masters before
clipping, the masters back into the model after the step.

What stays fp32: the optimizer's parameters (the masters: the fp32 `nn.Parameter`s the model had, which the
optimizer was built over and a checkpoint restored into) and its moments, the gradients it steps with (their norm
and clipping too), the model's buffers, the loss (`marge.model.losses`: fp32 log-softmax), and DDP's all-reduce
(`reduce_in_fp32`: a bucket is summed in fp32, then cast back). What is bf16: the weights the forward reads, the
activations (LayerNorm's and the residual stream's included: LayerNorm still accumulates in fp32 inside its kernel)
and the gradients a rank accumulates over its micro-batches before the update.

Every `state_dict` of the model or of any of its modules holds the fp32 masters under the parameters' names, so
checkpoints, snapshots and restores read and write fp32 exactly as without this setting (a restore writes into the
masters in place; `MasterWeights.publish` then refreshes the bf16 copies)."""

from __future__ import annotations

from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch import Tensor, nn

MASTERS = "master_weights"
"""The attribute of an optimizer whose parameters are `MasterWeights`' masters."""
MASTER = "fp32_master"
"""The attribute of a bf16 copy that holds its master (`full_precision`)."""


class MasterWeights:
    """The model's parameters as bf16 copies of the fp32 masters the optimizer steps."""

    def __init__(self, model: nn.Module, optimizer: torch.optim.Optimizer):
        stepped = {id(p) for group in optimizer.param_groups for p in group["params"]}
        self.masters: list[Tensor] = []  # fp32 nn.Parameters the optimizer steps
        self.copies: list[Tensor] = []  # their bf16 nn.Parameters, the model's
        self.pairs: list[tuple[Tensor, Tensor]] = []  # every (master, copy), frozen ones (beta untrained) too
        copy_of: dict[int, nn.Parameter] = {}
        for module in model.modules():
            for name, master in list(module._parameters.items()):
                if master is None or not master.is_floating_point():
                    continue
                if id(master) not in copy_of:  # a tied parameter is one master and one copy
                    if master.dtype != torch.float32:
                        raise ValueError(f"trainer.bf16_params: parameter {name} is {master.dtype}, not float32")
                    copy = nn.Parameter(master.detach().to(torch.bfloat16), requires_grad=master.requires_grad)
                    copy_of[id(master)] = copy
                    setattr(copy, MASTER, master)  # an attribute on a Parameter object, which its type does not declare
                    self.pairs.append((master, copy))
                    if id(master) in stepped:
                        self.masters.append(master)
                        self.copies.append(copy)
                module._parameters[name] = copy_of[id(master)]
            # functions, not bound methods: torch marks the hooks it is given with an attribute
            module.register_state_dict_post_hook(lambda *args: self._masters_in_state(*args))
            module.register_load_state_dict_pre_hook(lambda *args: self._load_into_masters(*args))
        setattr(optimizer, MASTERS, self)
        # what a checkpoint names the optimizer's state by (`marge.model.checkpoint.param_names`)
        setattr(optimizer, "parameter_names", {id(full_precision(copy)): name for name, copy in model.named_parameters()})
        optimizer.register_step_post_hook(lambda *_: self.publish())

    @staticmethod
    def _own(module: nn.Module, prefix: str) -> Iterator[tuple[str, Tensor]]:
        for name, copy in module._parameters.items():
            if copy is not None and hasattr(copy, MASTER):
                yield prefix + name, full_precision(copy)

    def _masters_in_state(self, module: nn.Module, state: dict, prefix: str, _metadata) -> None:
        for key, master in self._own(module, prefix):
            if key in state:
                state[key] = master.detach()  # the master's storage: a restore that writes into it writes the master

    def _load_into_masters(self, module: nn.Module, state: dict, prefix: str, *_) -> None:
        with torch.no_grad():
            for key, master in self._own(module, prefix):
                if key in state and state[key].shape == master.shape:
                    master.copy_(state[key])

    @torch.no_grad()
    def gradients_to_masters(self) -> list[Tensor]:
        """Each trained copy's gradient into its master's (fp32, one multi-tensor copy), the copies' gradients
        unset (as `optimizer.zero_grad` unsets a model's own: the next backward starts from none); the masters that
        have a gradient."""
        have = [k for k, c in enumerate(self.copies) if c.grad is not None]
        if not have:
            return []
        into: list[Tensor] = []
        for k in have:  # made for this update: the update's `zero_grad` frees them, so they hold no memory while
            # the next forward's activations do
            buffer = torch.empty_like(self.masters[k])
            self.masters[k].grad = buffer
            into.append(buffer)
        torch._foreach_copy_(into, [g for k in have if (g := self.copies[k].grad) is not None])
        for k in have:
            self.copies[k].grad = None
        return [self.masters[k] for k in have]

    @torch.no_grad()
    def publish(self) -> None:
        """The masters into the model's bf16 copies (one multi-tensor copy): after every step, and after a restore
        wrote the masters."""
        torch._foreach_copy_([c for _, c in self.pairs], [m for m, _ in self.pairs])


def bf16_parameters(model: nn.Module, optimizer: torch.optim.Optimizer) -> MasterWeights:
    """Turn `model`'s parameters into bf16 copies of the fp32 ones `optimizer` holds (built over them, and restored
    if the run resumes: call this after the restore, before DDP wraps the model)."""
    return MasterWeights(model, optimizer)


def master_weights(optimizer: torch.optim.Optimizer) -> MasterWeights | None:
    return getattr(optimizer, MASTERS, None)


def full_precision(parameter: Tensor) -> Tensor:
    """A parameter's value as the optimizer holds it: a bf16 copy's fp32 master, or the parameter itself (what a
    figure such as beta reports, so that it is the checkpoint's and not rounded to bf16)."""
    return getattr(parameter, MASTER, parameter)


def check_precision(bf16_params: bool, optimizer: torch.optim.Optimizer) -> None:
    """Refuses an update whose model is not what `trainer.bf16_params` says: with it on, a model left fp32 would
    train in fp32 without autocast, silently."""
    converted = master_weights(optimizer) is not None
    if bf16_params != converted:
        raise ValueError("trainer.bf16_params is " + ("on, but the model's parameters are not bf16 copies of the "
                         "optimizer's: call services.trainer.precision.bf16_parameters(model, optimizer) after any "
                         "restore and before DDP wraps the model" if bf16_params else
                         "off, but the model's parameters were made bf16 copies (bf16_parameters)"))


def stepped_gradients(model: nn.Module, optimizer: torch.optim.Optimizer | None = None) -> list[Tensor]:
    """The parameters whose gradients the optimizer steps with: the model's own (those with a gradient) or, with
    bf16 parameters, their fp32 masters, the model's bf16 gradients copied into them first."""
    weights = master_weights(optimizer) if optimizer is not None else None
    if weights is not None:
        return weights.gradients_to_masters()
    return [p for p in model.parameters() if p.grad is not None]


def reduce_in_fp32(process_group: dist.ProcessGroup | None, bucket: dist.GradBucket) -> torch.futures.Future[Tensor]:
    """A DDP communication hook: the bucket's mean over the ranks summed in fp32 and cast back, so that bf16
    gradients are not rounded at every step of the all-reduce (`DistributedDataParallel.register_comm_hook`)."""
    group = process_group if process_group is not None else dist.group.WORLD
    buffer = bucket.buffer()
    wide = buffer.to(torch.float32).div_(dist.get_world_size(group))
    future = dist.all_reduce(wide, group=group, async_op=True).get_future()

    def narrow(done: torch.futures.Future) -> Tensor:
        buffer.copy_(done.value()[0])
        return buffer

    return future.then(narrow)


# DDP checks a hook's annotations against the objects themselves, and this module's are strings (postponed
# evaluation): the same annotations, evaluated (where torch has its distributed package)
if dist.is_available():
    reduce_in_fp32.__annotations__ = {"process_group": dist.ProcessGroup | None, "bucket": dist.GradBucket,
                                      "return": torch.futures.Future[Tensor]}
