"""The distributed optimizer's state handed to the plain optimizer's Adam, with its step
where that Adam counts it."""

from types import SimpleNamespace

import pytest
import torch

from megatron.training.optimizer_from_distributed import KEY, apply

STEP = 7


class GroupStepAdam(torch.optim.Optimizer):
    """Keeps its state as Transformer Engine's and apex's FusedAdam do (megatron-core's Adam
    on CUDA): the step in each param group, the moments per parameter; TE's ``state_dict``
    takes every per-parameter entry for a moment (``name_to_dtype_map[name]``)."""

    MOMENTS = ("exp_avg", "exp_avg_sq", "master_param")

    def __init__(self, params):
        super().__init__(params, {"lr": 0.1})

    def state_dict(self):
        for state in self.state.values():
            for name in state:
                if name not in self.MOMENTS:
                    raise KeyError(name)
        return super().state_dict()


def loaded_into(adam_class):
    param = torch.nn.Parameter(torch.zeros(2, 3))
    adam = adam_class([param])
    saved = {name: torch.full((2, 3), value)
             for name, value in (("param", 1.0), ("exp_avg", 0.5), ("exp_avg_sq", 0.25))}
    apply(SimpleNamespace(optimizer=adam), {KEY: {0: saved}}, float(STEP))
    return adam, param


def test_torchs_adam_gets_the_step_per_parameter():
    adam, param = loaded_into(torch.optim.AdamW)
    assert torch.equal(param.detach(), torch.ones(2, 3))
    assert adam.state[param]["step"] == STEP
    assert torch.equal(adam.state[param]["exp_avg"], torch.full((2, 3), 0.5))


def test_a_fused_adam_gets_the_step_in_its_param_groups_and_can_still_be_saved():
    adam, param = loaded_into(GroupStepAdam)
    assert [group["step"] for group in adam.param_groups] == [STEP]
    assert set(adam.state[param]) == {"exp_avg", "exp_avg_sq"}
    adam.state_dict()  # what every later save calls


@pytest.mark.parametrize("chained", [True, False])
def test_an_fp16_loss_scale_is_taken_from_the_checkpoint(chained):
    """Resumed by the plain optimizer, a distributed optimizer's fp16 run went back to the
    initial scale (2^32) and skipped tens of steps finding its level again. megatron-core's
    get_megatron_optimizer returns a ChainedOptimizer, with no scaler of its own: the scale
    was looked for there, and never loaded."""
    from megatron.core.optimizer.grad_scaler import DynamicGradScaler
    from megatron.core.optimizer.optimizer import ChainedOptimizer
    from megatron.training import cpu_compat

    cpu_compat.apply()  # megatron-core's scaler keeps its scale on the GPU

    def scaler():
        return DynamicGradScaler(initial_scale=2.0 ** 32, min_scale=1.0, growth_factor=2.0,
                                 backoff_factor=0.5, growth_interval=1000, hysteresis=2)
    saved = scaler()
    for _ in range(20):
        saved.update(found_inf=True)
    param = torch.nn.Parameter(torch.zeros(2, 3))
    resumed = SimpleNamespace(optimizer=torch.optim.AdamW([param]), grad_scaler=scaler(),
                              config=None)
    state = {name: torch.zeros(2, 3) for name in ("param", "exp_avg", "exp_avg_sq")}
    apply(ChainedOptimizer([resumed]) if chained else resumed,
          {KEY: {0: state}, "optimizer": {"grad_scaler": saved.state_dict()}}, 1.0)
    assert resumed.grad_scaler.scale.item() == saved.scale.item() < 2.0 ** 32


@pytest.mark.parametrize("groups, step", [
    ([{"step": 7}, {"step": 7.0}], 7.0),
    ([{"lr": 1e-3}, {"lr": 1e-3}], 0.0),  # a fused Adam that never stepped saves no step
])
def test_the_saved_step_is_the_param_groups_one_or_0_before_any(groups, step):
    from megatron.training.optimizer_from_distributed import saved_step

    assert saved_step({"optimizer": {"param_groups": groups}}) == step


@pytest.mark.parametrize("groups", [[], [{"step": 7}, {"step": 8}]])
def test_no_groups_or_two_steps_are_no_step(groups):
    from megatron.training.optimizer_from_distributed import saved_step

    with pytest.raises(ValueError, match="holds no single step"):
        saved_step({"optimizer": {"param_groups": groups}})
