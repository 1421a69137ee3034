"""The distributed optimizer's state handed to the plain optimizer's Adam, with its step
where that Adam counts it."""

from types import SimpleNamespace

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
