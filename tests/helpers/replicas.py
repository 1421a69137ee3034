"""Replica recovery in tests: every tensor of a torch_dist checkpoint, read in one process,
and a torchrun run whose rank dies at a kill point, its survivors asked for their dumps."""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace
from typing import Callable

import psutil
import torch
from torch.distributed import checkpoint as dcp
from torch.distributed.checkpoint.metadata import TensorStorageMetadata

from ftmaster import runfiles
from ftmaster.recovery.replicas import REQUEST_FLAG, read_reports
from helpers.trainer import kill_session, start_trainer, wait_until, worker_with_local_rank


def checkpoint_tensors(path: Path) -> dict[str, torch.Tensor]:
    """Every tensor of a checkpoint, whole (its chunks put together), by key."""
    reader = dcp.FileSystemReader(path)
    metadata = reader.read_metadata()
    tensors = {fqn: torch.empty(tuple(entry.size), dtype=entry.properties.dtype)
               for fqn, entry in metadata.state_dict_metadata.items()
               if isinstance(entry, TensorStorageMetadata)}
    dcp.load(tensors, storage_reader=reader, no_dist=True)
    return tensors


def unequal_tensors(path: Path, reference: Path) -> list[str]:
    """Keys whose tensors differ (or exist in one checkpoint only); [] when all are equal."""
    ours, theirs = checkpoint_tensors(path), checkpoint_tensors(reference)
    assert ours, f"no tensor in {path}"
    return sorted(set(ours) ^ set(theirs)) + sorted(
        key for key in set(ours) & set(theirs) if not torch.equal(ours[key], theirs[key]))


def _victim(torchrun, local_rank: int):
    try:
        return worker_with_local_rank(torchrun, local_rank)
    except (AssertionError, psutil.Error):
        return None


def _gone(process: psutil.Process) -> bool:
    """Dead, reaped or not (torchrun reaps its workers only as it shuts down)."""
    try:
        return process.status() == psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return True


def dump_after_a_kill(nproc: int, args: list[str], log: Path, run_dir: Path, folder: Path,
                      victim: int, kill: str, also_lost: tuple[int, ...] = (), **env: str) -> list:
    """Train until local rank ``victim`` kills itself at ``kill`` (ITERATION:POINT); SIGKILL
    the ranks ``also_lost`` too (lost before the dump, e.g. on the same failing board), then
    do what ftmaster does: ask for the dumps, wait for every survivor's report, kill the
    rest. Returns the reports."""
    run_dir.mkdir(parents=True, exist_ok=True)
    torchrun = start_trainer(nproc, args, log, FTMASTER_RUN_DIR=str(run_dir),
                             FTMASTER_INJECT_KILL=f"{victim}:{kill}", **env)
    try:
        others = [wait_until(lambda rank=rank: _victim(torchrun, rank), 120, what="the ranks")
                  for rank in also_lost]
        dead = wait_until(lambda: _victim(torchrun, victim), 120, what="the ranks")
        wait_until(lambda: _gone(dead), 300, what=f"local rank {victim}'s death")
        for process in others:
            process.kill()
            wait_until(lambda process=process: _gone(process), 30, what="the other losses")
        runfiles.write_flag(runfiles.flags_dir(run_dir) / REQUEST_FLAG, folder=str(folder))
        wait_until(lambda: len(read_reports(folder)) >= nproc - 1 - len(also_lost), 25,
                   what="the survivors' reports")
    finally:
        kill_session(torchrun)
    return read_reports(folder)


def dump_once(run_dir: Path, state_dict: Callable) -> None:
    """A trainer's dump thread asked for one dump at iteration 5; ``state_dict`` stands in
    for the state it dumps (raise in it to stop the dump there)."""
    from megatron.training.replicas import Cut, ReplicaDumper

    dumper = ReplicaDumper(run_dir, Cut(enabled=True),
                           SimpleNamespace(iteration=5, consumed_train_samples=40), state_dict)
    flag = runfiles.flags_dir(run_dir) / REQUEST_FLAG
    flag.parent.mkdir(parents=True)
    flag.write_text(json.dumps({"folder": str(run_dir / "dumps")}))
    assert dumper.done.wait(30)
