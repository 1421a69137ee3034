"""Two real ranks on gloo agree on keeping a save's plan: when one rank's structure changes,
every rank plans afresh."""

import subprocess
import sys
import textwrap
from pathlib import Path

RANK_SCRIPT = textwrap.dedent("""
    import os, sys, torch
    sys.path.insert(0, sys.argv[3])
    from helpers.structure import sharded_state
    from megatron.training.save_structure import SaveStructure
    rank = int(sys.argv[1])
    store = torch.distributed.FileStore(sys.argv[2], 2)
    torch.distributed.init_process_group("gloo", store=store, rank=rank, world_size=2)
    structure = SaveStructure(object, torch.distributed.group.WORLD, assume_constant=False)
    kept = [structure.strategy_for(sharded_state(extra=(rank == 1 and save == 2)))[1]
            for save in range(4)]
    print(kept, flush=True)
    # Both leave together, without the interpreter's teardown: tearing gloo's threads down
    # can end in std::terminate (SIGABRT), seen in clean runs even after a barrier and
    # destroy_process_group (the trainer leaves the same way, pretrain_gpt.leave_now).
    torch.distributed.barrier()
    os._exit(0)
""")


def test_one_rank_changing_makes_every_rank_plan_afresh(tmp_path):
    """Only rank 1's state gains an optimizer state at the third save and loses it at the
    fourth; both ranks start afresh at both."""
    script = tmp_path / "rank.py"
    script.write_text(RANK_SCRIPT)
    tests = Path(__file__).resolve().parents[1]
    ranks = [subprocess.Popen([sys.executable, str(script), str(rank), str(tmp_path / "store"),
                               str(tests)], stdout=subprocess.PIPE, text=True) for rank in (0, 1)]
    outputs = [rank.communicate(timeout=300)[0].strip().splitlines()[-1] for rank in ranks]
    assert [rank.returncode for rank in ranks] == [0, 0]
    assert outputs == ["[False, True, False, False]"] * 2
