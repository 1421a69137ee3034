"""Warm workers against cold starts: RTO from the fault to the first resumed iteration, phase by
phase, on the real trainer (CPU + gloo).

    .venv/bin/python benchmarks/warm_recovery.py [--scenario gpu|replica|node ...] [--repeats 3]
        [--iterations 80]

Each repeat runs the same job twice, ``--cold-restart`` and warm (the default), one after the
other, so both see the same machine:

- **gpu**: the demo's failure: 4 ranks at TP2 x PP2, a checkpoint every 5 iterations, GPU 1
  killed at iteration 12 (warm: once the warm set is ready, ``after=warm_ready``) (``--inject fail:gpu=1,at=iter:12``), the relaunch on 3 ranks;
- **replica**: 4 ranks at TP1 x PP2 x DP2 with ``--replica-recovery`` (no checkpoint before
  the fault), GPU 1 killed at iteration 16, the relaunch on 3 from the survivors' merge;
- **node**: two ftmaster nodes on loopback (tuned rendezvous: keep-alive 1 s, last call 2 s),
  2 ranks each at TP2, node 1 SIGKILLed after iteration 10, the relaunch on node 0 alone.

Phases, from ftmaster's events: detection (fault -> ``failure``), to plan (-> ``plan``: the
dump and merge of replica recovery, a rendezvous round), plan -> ``launch``, and the
relaunch's ``startup`` event (launch -> first iteration, in the trainer's start-up phases,
each ending when its last rank ends it), then the supervisor seeing it (-> ``resumed``). Medians over the
repeats; the last column is warm / cold.
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from ftmaster import runfiles  # noqa: E402
from helpers.launch import run_launch, train_args  # noqa: E402
from multinode_recovery import kill_node_1  # noqa: E402

STARTUP_PHASES = ("launch", "interpreter", "imports", "process-group", "model-and-optimizer-setup",
                  "train/valid/test-data-iterators-setup", "checkpoint-search",
                  "checkpoint-verify", "checkpoint-read", "first-iteration")
COLD = "--cold-restart"
ITERATIONS = 80
"""Long enough for the warm set to be ready before the run ends: beside 4 ranks that keep both
cores busy, workers importing at SCHED_IDLE were ready 18 s after the launch here (about
iteration 50 at 0.23 s an iteration), and a run of 30 ended first (2026-11-28). On a slower
machine (the trainer's imports twice as long) they were ready only at 67 s, with 80
iterations done: ``--iterations``."""


def first_after(events: list[dict], name: str, after: float) -> dict:
    found = next((e for e in events if e["event"] == name and e["time"] >= after), None)
    if found is None:
        raise SystemExit(f"no {name} event after {after}: the run did not recover as expected")
    return found


def phases(events: list[dict], fault_at: float) -> dict[str, float]:
    failure = first_after(events, "failure", fault_at)
    plan = first_after(events, "plan", failure["time"])
    launch = first_after(events, "launch", plan["time"])
    startup = first_after(events, "startup", launch["time"])
    resumed = first_after(events, "resumed", launch["time"])
    timings = {"detection": failure["time"] - fault_at, "to plan": plan["time"] - failure["time"],
               "plan -> launch": launch["time"] - plan["time"]}
    timings.update({f"  {name}": startup["phases"][name] for name in STARTUP_PHASES})
    timings["launch -> first iteration"] = startup["seconds"]
    timings["RTO from the fault"] = resumed["time"] - fault_at
    timings["warm"] = float(bool(startup.get("warm")))
    merge = next((e for e in events if e["event"] == "replica_merge"), None)
    if merge is not None:
        timings["replica merge (within to plan)"] = merge["seconds"]
    return timings


def after_warm_ready(options: tuple[str, ...]) -> str:
    """Warm runs fail once their first set of warm workers is ready: the steady state of a
    long run (here training keeps both cores busy, so workers importing at SCHED_IDLE can take
    longer than the 12-16 iterations before the fault)."""
    return "" if COLD in options else ",after=warm_ready"


def fault_time(events: list[dict], iterations: int) -> float:
    """When the injected fault fired. A run that ended first (its warm set was not ready in
    time, on a slower machine) says so, and when its warm set was ready."""
    fault = next((e for e in events if e["event"] == "fault_injected"), None)
    if fault is not None:
        return fault["time"]
    started = events[0]["time"]
    at = {e["event"]: f"at {e['time'] - started:.0f} s" for e in reversed(events)}
    raise SystemExit(f"the fault never fired: the run's {iterations} iterations ended "
                     f"{at.get('complete', 'early')} from the launch and its warm set was "
                     f"{'ready ' + at['warm_ready'] if 'warm_ready' in at else 'never ready'}; "
                     f"try a longer run (--iterations)")


def gpu_loss(root: Path, iterations: int, *options: str) -> dict[str, float]:
    run_dir = root / "run"
    result = run_launch(run_dir, 4, train_args(root / "ckpt", iterations, 2, 2, 5), *options,
                        "--inject", f"fail:gpu=1,at=iter:12{after_warm_ready(options)}")
    assert result.returncode == 0, result.stdout[-3000:]
    events = runfiles.read_events(run_dir)
    return phases(events, fault_time(events, iterations))


def replica_loss(root: Path, iterations: int, *options: str) -> dict[str, float]:
    extra = ["--non-persistent-ckpt-type", "global", "--non-persistent-global-ckpt-dir",
             str(root / "memory"), "--replica-recovery", "--seed", "4"]
    run_dir = root / "run"
    result = run_launch(run_dir, 4, train_args(root / "ckpt", iterations, 1, 2, 100, *extra,
                                                 global_batch=8),
                        *options, "--inject", f"fail:gpu=1,at=iter:16{after_warm_ready(options)}")
    assert result.returncode == 0, result.stdout[-3000:]
    events = runfiles.read_events(run_dir)
    return phases(events, fault_time(events, iterations))


def node_loss(root: Path, iterations: int, *options: str) -> dict[str, float]:
    """Its own length (``multinode_recovery``'s): the kill waits for the warm set."""
    warm = bool(after_warm_ready(options))
    events, fault_at = kill_node_1(root, 1, *options,
                                   ready=lambda nodes: not warm or nodes.events(0, "warm_ready"))
    return phases(events, fault_at)


SCENARIOS = {"gpu": gpu_loss, "replica": replica_loss, "node": node_loss}


def report(name: str, cold: list[dict], warm: list[dict]) -> None:
    print(f"\n== {name}: medians of {len(cold)} (warm attempts: "
          f"{sum(r['warm'] for r in warm):.0f}/{len(warm)}, cold: {sum(r['warm'] for r in cold):.0f} warm)")
    print(f"{'phase (s)':40s} {'cold':>8s} {'warm':>8s} {'warm/cold':>10s}")
    for phase in cold[0]:
        if phase == "warm":
            continue
        c, w = statistics.median(r[phase] for r in cold), statistics.median(r[phase] for r in warm)
        ratio = f"{w / c:10.2f}" if c > 0.005 else f"{'-':>10s}"
        print(f"{phase:40s} {c:8.2f} {w:8.2f} {ratio}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--scenario", choices=sorted(SCENARIOS), action="append")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--iterations", type=int, default=ITERATIONS,
                        help="the gpu and replica runs' length (default %(default)s)")
    options = parser.parse_args()
    if options.iterations <= 16:
        parser.error(f"--iterations must be above 16, the replica run's fault, got {options.iterations}")
    for name in options.scenario or ["gpu", "replica", "node"]:
        runs: dict[str, list] = {"cold": [], "warm": []}
        with tempfile.TemporaryDirectory(prefix="ftmaster-warm-") as tmp:
            for repeat in range(options.repeats):
                for how, extra in (("cold", (COLD,)), ("warm", ())):
                    runs[how].append(SCENARIOS[name](Path(tmp) / f"{how}{repeat}",
                                                     options.iterations, *extra))
                    print(f"{name} repeat {repeat + 1} {how}: RTO from the fault "
                          f"{runs[how][-1]['RTO from the fault']:.2f} s", flush=True)
        report(name, runs["cold"], runs["warm"])


if __name__ == "__main__":
    main()
