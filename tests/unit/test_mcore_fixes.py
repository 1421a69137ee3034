"""The fix of megatron-core's fully reshardable distributed optimizer state: applied where the
installed method hands a parameter another one's state, and only there (megatron-core with
upstream's own fix, or one the check does not recognise, is left as it is)."""

import subprocess
import sys
from dataclasses import replace

import pytest
import torch
from megatron.core.dist_checkpointing.dict_utils import nested_values
from megatron.core.optimizer import distrib_optimizer

from helpers.trainer import REPO
from megatron.training import mcore_fixes

Optimizer = distrib_optimizer.DistributedOptimizer


def upstream_fixed(self, model_sharded_state_dict, is_loading=False, metadata=None):
    """megatron-core after NVIDIA/Megatron-LM#5077, as that change describes itself: the world
    tensors stay packed, and each slice skips the end padding of the buckets before its own."""
    state = self.get_parameter_state_dp_zero(empty_data=is_loading, return_on_all_ranks=True)
    of_param = {shard.data: shard for shard in nested_values(model_sharded_state_dict)}
    result = {}
    for buffer_index, buffer in enumerate(self.buffers):
        world = state[buffer_index][torch.float32]
        for param, (start, end, bucket) in buffer.param_index_map.items():
            skipped = buffer.buckets[bucket].offset - sum(
                earlier.numel_unpadded for earlier in buffer.buckets[:bucket])
            shard = of_param[param]
            result[len(result)] = {
                key: replace(shard, key=f"optimizer.state.{key}.{shard.key}",
                             data=world[key][start - skipped:end - skipped].reshape(shard.data.shape))
                for key in ("param", "exp_avg", "exp_avg_sq")}
    return result


def unrecognised(self, model_sharded_state_dict, is_loading=False, metadata=None):
    raise AttributeError("'_TwoBuckets' object has no attribute 'something_new'")


@pytest.fixture
def fresh_apply(monkeypatch):
    """``apply`` as at a process's start; every method it may replace is given back after."""
    monkeypatch.setattr(mcore_fixes, "_applied", False)
    for name in ("sharded_param_state_fully_reshardable", "state_dict",
                 "_set_main_param_and_optimizer_states", "load_state_dict"):
        monkeypatch.setattr(Optimizer, name, getattr(Optimizer, name))
    from megatron.core.transformer.torch_norm import WrappedTorchNorm
    monkeypatch.setattr(WrappedTorchNorm, "__new__", WrappedTorchNorm.__dict__["__new__"])


def printed_in_a_fresh_interpreter(code: str) -> list[str]:
    """What ``code`` prints, word by word, run where no test has applied any fix."""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                            cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
    return result.stdout.split()


def test_the_installed_megatron_core_misplaces_the_state_and_gets_the_fix():
    """In a fresh interpreter: the method as megatron-core 0.16.1 ships it."""
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "from megatron.core.optimizer import distrib_optimizer\n"
        "from megatron.training import mcore_fixes\n"
        "installed = distrib_optimizer.DistributedOptimizer.sharded_param_state_fully_reshardable\n"
        "print(mcore_fixes._reshards_correctly(installed))\n"
        "mcore_fixes.apply()\n"
        "fixed = distrib_optimizer.DistributedOptimizer.sharded_param_state_fully_reshardable\n"
        "print(fixed is not installed, mcore_fixes._reshards_correctly(fixed))\n")
    assert printed_in_a_fresh_interpreter(code) == ["False", "True", "True"]


def test_a_megatron_core_with_upstream_s_fix_is_left_as_it_is(fresh_apply, capsys):
    assert mcore_fixes._reshards_correctly(upstream_fixed)
    # The re-layout on top of upstream's fix would misplace the state again.
    assert not mcore_fixes._reshards_correctly(
        mcore_fixes._with_world_tensors_at_buffer_offsets(upstream_fixed))
    Optimizer.sharded_param_state_fully_reshardable = upstream_fixed
    mcore_fixes.apply()
    assert Optimizer.sharded_param_state_fully_reshardable is upstream_fixed
    assert "warning" not in capsys.readouterr().out


def test_a_megatron_core_the_check_does_not_recognise_is_left_as_it_is_with_a_warning(
        fresh_apply, capsys):
    Optimizer.sharded_param_state_fully_reshardable = unrecognised
    mcore_fixes.apply()
    assert Optimizer.sharded_param_state_fully_reshardable is unrecognised
    out = capsys.readouterr().out
    assert "warning" in out and "something_new" in out


def test_the_torch_norm_takes_sequence_parallel_without_the_cpu_adaptations():
    """In a fresh interpreter, as on CUDA (no cpu_compat): the local spec's torch norm
    asserted "sequence parallel not supported by torch LayerNorm" at the model's build with
    --sequence-parallel (--transformer-impl local, or CUDA without Transformer Engine)."""
    code = (
        "import warnings; warnings.simplefilter('ignore')\n"
        "from megatron.core.transformer import TransformerConfig\n"
        "from megatron.core.transformer.torch_norm import WrappedTorchNorm\n"
        "from megatron.training import mcore_fixes\n"
        "config = TransformerConfig(num_layers=1, hidden_size=8, num_attention_heads=2,\n"
        "    tensor_model_parallel_size=2, sequence_parallel=True, use_cpu_initialization=True)\n"
        "try:\n"
        "    WrappedTorchNorm(config, 8)\n"
        "except AssertionError:\n"
        "    print('refused')\n"
        "mcore_fixes.apply()\n"
        "norm = WrappedTorchNorm(config, 8)\n"
        "print(all(p.sequence_parallel for p in norm.parameters()))\n")
    assert printed_in_a_fresh_interpreter(code) == ["refused", "True"]
