"""The trainer's replica dump thread, with the state it dumps stood in for."""

import contextlib
import threading
import time

import torch

from helpers.replicas import dump_once
from megatron.training import replicas


def test_the_dump_thread_works_on_the_gpu_of_the_thread_that_made_it(tmp_path, monkeypatch):
    """CUDA's current device is per thread, and a new thread's is GPU 0: on every rank the
    dump read "the current device" as GPU 0 (the CUDA RNG stream it saves before any update
    has committed one, megatron-core's allocations on the current device). Stood in for on
    CPU: a per-thread current device."""
    current = threading.local()
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: getattr(current, "index", 0))
    monkeypatch.setattr(torch.cuda, "set_device", lambda index: setattr(current, "index", index))
    monkeypatch.setattr(replicas, "layout_coordinates", lambda: {"rank": 3})
    torch.cuda.set_device(3)  # the training thread's GPU: local rank 3
    seen = []

    def state_dict(iteration: int, consumed: int, rng: dict | None) -> dict:
        seen.append(torch.cuda.current_device())
        raise OSError("the dump stops here")

    dump_once(tmp_path, state_dict)
    assert seen == [3]



def _agree_then(cut: replicas.Cut, state: dict, before_commit: threading.Event) -> threading.Thread:
    """The training thread: the agreement passes, then the clipping runs (until
    ``before_commit`` is set) before the update is applied."""
    def train():
        with cut.agreement():
            pass
        before_commit.wait(10)
        with cut.commit():
            state["iteration"] = 4

    thread = threading.Thread(target=train, daemon=True)
    thread.start()
    while cut._agreement != "passed":
        time.sleep(0.001)
    return thread


def _dumped_iteration(cut: replicas.Cut, state: dict) -> int | None:
    """What a dump would see; None when it refuses."""
    if not cut.acquire_whole():
        return None
    try:
        return state["iteration"]
    finally:
        cut.lock.release()


def test_a_dump_waits_for_the_update_its_rank_has_agreed_to(monkeypatch):
    """Rank 3 had passed iteration 4's agreement but was still clipping when the dump took
    the lock: it dumped iteration 3 while every other survivor dumped 4 (a shard whose only
    survivor lags this way has no complete cut at all)."""
    monkeypatch.setattr(replicas, "rng_state", dict)
    cut, state, clipping = replicas.Cut(True), {"iteration": 3}, threading.Event()
    train = _agree_then(cut, state, clipping)
    threading.Timer(0.2, clipping.set).start()
    assert _dumped_iteration(cut, state) == 4
    train.join(10)


def test_a_dump_gives_up_on_an_update_that_does_not_come(monkeypatch):
    monkeypatch.setattr(replicas, "LOCK_TIMEOUT_S", 0.3)
    monkeypatch.setattr(replicas, "rng_state", dict)
    cut, state, clipping = replicas.Cut(True), {"iteration": 3}, threading.Event()
    train = _agree_then(cut, state, clipping)
    assert _dumped_iteration(cut, state) is None
    clipping.set()
    train.join(10)
    assert _dumped_iteration(cut, state) == 4


def test_an_agreement_that_never_ends_delays_the_dump_only_briefly(monkeypatch):
    """A peer died before joining it: the rank's state is the iteration before, dumped after
    the agreement's short wait, not after the update's timeout."""
    monkeypatch.setattr(replicas, "AGREEMENT_WAIT_S", 0.2)
    cut, state = replicas.Cut(True), {"iteration": 3}
    blocked, released = threading.Event(), threading.Event()

    def blocked_in_the_agreement():
        with contextlib.suppress(RuntimeError), cut.agreement():
            blocked.set()
            released.wait(10)
            raise RuntimeError("Connection reset by peer")

    thread = threading.Thread(target=blocked_in_the_agreement, daemon=True)
    thread.start()
    blocked.wait(10)
    start = time.monotonic()
    assert _dumped_iteration(cut, state) == 3
    waited = time.monotonic() - start
    released.set()
    thread.join(10)
    assert 0.2 <= waited < replicas.LOCK_TIMEOUT_S
    start = time.monotonic()
    assert _dumped_iteration(cut, state) == 3  # a failed agreement leaves nothing pending
    assert time.monotonic() - start < 0.2


def test_the_rng_streams_a_dump_takes_before_the_first_commit_are_the_loaded_ones(monkeypatch):
    """Before the attempt's first commit a dump read the streams live, from its own thread,
    while the training thread drew from them."""
    streams = iter([{"at": "load"}, {"at": "mid-iteration"}])
    monkeypatch.setattr(replicas, "rng_state", lambda: next(streams))
    cut = replicas.Cut(True)
    cut.begin()
    assert cut.rng == {"at": "load"}


def test_the_last_stages_tied_output_weight_is_not_dumped_as_the_embeddings_optimizer_state():
    """PP > 1, tied embeddings, the distributed optimizer: the last stage's output weight is
    saved under the first stage's embedding key with replica_id (1, 0, dp). Dumped, its
    slices lay over the first stage's at other shard boundaries, and every merge refused."""
    from megatron.core.dist_checkpointing.mapping import ShardedTensor
    from megatron.core.optimizer.distrib_optimizer import Range
    from megatron.training.optimizer_shards import shard_slices

    layer, output = torch.zeros(4, 2), torch.zeros(8, 2)
    sharded = {"layer": ShardedTensor.from_rank_offsets("decoder.layer.weight", layer,
                                                        replica_id=(0, 0, 1)),
               "output": ShardedTensor.from_rank_offsets("embedding.word_embeddings.weight",
                                                         output, replica_id=(1, 0, 1))}

    class Shard:  # the last stage's DistributedOptimizer: both parameters in one bucket
        gbuf_ranges = [{torch.float32: [{"param_map": {layer: {"param": Range(2, 8)},
                                                       output: {"param": Range(0, 3)}}}]}]

        @staticmethod
        def _get_main_param_and_optimizer_states(param):
            held = 6 if param is layer else 3
            return {key: torch.arange(held, dtype=torch.float32)
                    for key in ("param", "exp_avg", "exp_avg_sq")}

    dumped = shard_slices(Shard(), sharded)
    assert {part["fqn"] for part in dumped.values()} == {
        f"optimizer.state.{key}.decoder.layer.weight" for key in ("param", "exp_avg", "exp_avg_sq")}
    assert {(part["start"], part["end"]) for part in dumped.values()} == {(2, 8)}
