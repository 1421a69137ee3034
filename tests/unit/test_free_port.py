"""The tests' own port picker (``helpers.trainer.free_port``): xdist workers never pick one
port, and a worker never picks one twice, since a picked port stays unbound for the seconds
its torchrun takes to import torch."""

from helpers import trainer


def ports_of(monkeypatch, worker: int, workers: int, count: int) -> list[int]:
    monkeypatch.setenv("PYTEST_XDIST_WORKER", f"gw{worker}")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", str(workers))
    monkeypatch.setattr(trainer, "_HANDED_OUT", set())
    return [trainer.free_port() for _ in range(count)]


def test_workers_pick_from_disjoint_shares_and_never_the_same_port_twice(monkeypatch):
    picked = [ports_of(monkeypatch, worker, 3, 300) for worker in range(3)]
    for ports in picked:
        assert len(set(ports)) == len(ports)
        assert all(port < trainer._ephemeral_ports()[0] for port in ports)
    assert not set(picked[0]) & set(picked[1]) and not set(picked[1]) & set(picked[2]) \
        and not set(picked[0]) & set(picked[2])


def test_without_xdist_the_whole_range_is_ours(monkeypatch):
    monkeypatch.delenv("PYTEST_XDIST_WORKER", raising=False)
    assert trainer._worker_slot() == (0, 1)
    monkeypatch.setenv("PYTEST_XDIST_WORKER", "gw5")
    monkeypatch.setenv("PYTEST_XDIST_WORKER_COUNT", "3")  # inconsistent: not trusted
    assert trainer._worker_slot() == (0, 1)
