"""The agreement's write results: sent in full only when they changed, and rank 0 always
writes ``.metadata`` from every rank's full results (the gather's pickling included)."""

import pickle

from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import MetadataIndex
from torch.distributed.checkpoint.storage import WriteResult

from megatron.training.checkpointing import _UNCHANGED, _RankReport, _WriteResultsRelay


def results(rank: int, length: int) -> list[WriteResult]:
    return [WriteResult(MetadataIndex(f"w{index}", (0,)), length,
                        _StorageInfo(f"__{rank}_0.distcp", index * length, length))
            for index in range(3)]


def agree(relays: list[_WriteResultsRelay], sent: list[list | None]) -> tuple[list, list]:
    """One agreement: what each rank put on the wire, and what rank 0 wrote from."""
    wire = [pickle.loads(pickle.dumps(_RankReport(None, {}, 0.0, relay.outgoing(own))))
            for relay, own in zip(relays, sent)]
    return [r.write_results for r in wire], [r.write_results for r in relays[0].incoming(wire)]


def test_unchanged_results_travel_as_a_marker_and_changed_ones_in_full():
    relays = [_WriteResultsRelay(), _WriteResultsRelay()]
    wire, written = agree(relays, [results(0, 8), results(1, 8)])
    assert wire == [results(0, 8), results(1, 8)] == written
    wire, written = agree(relays, [results(0, 8), results(1, 16)])  # rank 1's objects grew
    assert wire == [_UNCHANGED, results(1, 16)] and written == [results(0, 8), results(1, 16)]
    wire, written = agree(relays, [results(0, 8), results(1, 16)])
    assert wire == [_UNCHANGED, _UNCHANGED] and written == [results(0, 8), results(1, 16)]


def test_a_rank_with_nothing_written_sends_none_and_its_last_results_stay_known():
    relays = [_WriteResultsRelay(), _WriteResultsRelay()]
    agree(relays, [results(0, 8), results(1, 8)])
    wire, written = agree(relays, [results(0, 8), None])  # rank 1's save failed before writing
    assert wire == [_UNCHANGED, None] and written == [results(0, 8), None]
    wire, written = agree(relays, [results(0, 8), results(1, 8)])
    assert wire == [_UNCHANGED, _UNCHANGED] and written == [results(0, 8), results(1, 8)]
