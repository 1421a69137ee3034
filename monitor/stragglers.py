"""Stragglers: the rank whose compute holds every other rank to its speed.

Each rank times its own compute per iteration: from the start of the iteration until it
enters the gradient reduction, so the time its peers then spend waiting for it is not counted
(``megatron.training.step_timing``). The figures of every rank travel in the heartbeat.

The detector is a pure function of the figures and a :class:`StragglerConfig`
(:func:`assess`): a rank's slowdown is the least of its last ``window`` compute times over
the median of its peers' medians over the same iterations (peers: the ranks of the same
pipeline stage, whose work is the same), and its drift that least time over its own earlier
median. The least, not the median: a straggler is slow at every iteration, while a healthy
rank on a busy host is slow at some. On the project's 2-core machine (4 ranks) single
iterations of a healthy rank reach 1.5-2x its peers' median many times in 100 iterations,
and a CI run held one at 1.3x or more for 5 iterations in a row: with a window of 4 and 4
iterations, an event needs 7 in a row, and a rank slowed 2x from iteration 8 is reported at
iteration 14. A straggler's own figure dips now and then (in 13 runs of that case on this
machine, 5 of them with twice its micro-batches, 1 of a 2x straggler's 364 figures read
1.44x its peers and the rest 1.56x or more; a CI run named it at 18, its run broken for the
window's 4 iterations), so the lowest figure of a window under both its neighbours is raised
to the lesser of them (:func:`own_window`), and the newest, with no neighbour after it yet,
holds the run until the next tells whether it was a dip. A lone dip from iteration 9 to 13
leaves it named at 14 (one at 14: at 15); a healthy rank still needs 7 slow iterations in a
row, but one fast among every 4 of them no longer stops it (a rank slow 3 iterations in 4 is
named, one slow every other iteration is not; of 200 simulated runs of 100 iterations, a
rank 1.6-2x slower at a random 20% of its iterations is named in 12, at 30% in 68, against 0
and 2 before: such a rank costs the job a sixth to a quarter of its speed;
``benchmarks/stragglers.py``). The ratio is 1.5, not 1.3: another CI run held a healthy
rank's least at 1.42x its peers for 7 iterations (by CPU time: this virtual machine's cores
run at speeds that differ for seconds at a time), while a rank slowed 2x read 1.55-2.32x
when named (7 runs at ratio 1.3; 1.70-2.06x held over iterations 11-14 in the 4 replayed).
NVIDIA's straggler detection flags a relative score under 0.7 (1.43x).
:class:`StragglerTracker` keeps the figures per iteration (heartbeats are polled, so some
iterations arrive together and some twice) and reports a rank once its slowdown has stayed
at or above ``ratio`` for ``iterations`` iterations in a row (one whose newest figure alone
was fast counts if the next is slow); it re-arms once the rank's own figure has stayed below
the ratio as long (a straggler that dips for an iteration is the same straggler).
Missing figures are unknown, never fast: an iteration without a rank's figure leaves its
run of slow iterations as it was; a rank without one over the ``window + iterations - 1``
iterations a naming rests on is unknown, neither slow nor still a straggler, and judged
afresh once its figures are back. So is a figure that is no time (not a finite number above
0: a NaN compared as slow for every rank it was a peer of), and a rank whose pipeline stage is
unknown has no peers. A peer with no figure over the iterations of a rank's window is no
peer of it there.

On CUDA a rank's compute holds what it waits for inside its model replica (the ranks of its
data-parallel index): its tensor-parallel partners' all-reduces in every layer, its neighbouring
stages' activations and gradients. A slow GPU therefore slows its replica mates' figures too,
as much as its own under tensor parallelism (4 CPU ranks while their figures were still clock
time, one slowed in every forward: its TP partner was named 1.43x within an iteration of it at TP2 x DP2, the next stage's rank of its
pipeline 1.48x at PP2 x DP2). A straggler named while a replica mate is slow too is therefore
ambiguous (:attr:`Straggler.slow_mates`): either may hold the other up.
"""

from __future__ import annotations

import bisect
import math
import statistics
from collections import OrderedDict
from dataclasses import dataclass


@dataclass(frozen=True)
class StragglerConfig:
    """When a slow rank is a straggler."""

    ratio: float = 1.5
    """Slowdown (the rank's least compute over its peers' median) that counts as slow."""
    iterations: int = 4
    """Consecutive slow iterations before the rank is reported."""
    window: int = 4
    """Iterations whose least compute time stands for a rank (a slow iteration or three, a
    busy host, are noise)."""
    history: int = 64
    """Iterations kept per rank, for its own earlier median (its drift)."""

    def __post_init__(self) -> None:
        if not self.ratio > 1.0:
            raise ValueError(f"the straggler ratio must be above 1, got {self.ratio}")
        for name in ("iterations", "window"):
            if getattr(self, name) < 1:
                raise ValueError(f"straggler {name} must be at least 1, got {getattr(self, name)}")
        if self.history < 2 * self.window:
            raise ValueError(f"straggler history ({self.history}) must hold at least two "
                             f"windows ({2 * self.window})")

    @property
    def naming_span(self) -> int:
        """The iterations a naming rests on: a window, then ``iterations`` judgments."""
        return self.window + self.iterations - 1


@dataclass(frozen=True)
class Assessment:
    """One rank at one iteration."""

    rank: int
    slowdown: float
    """Its least recent compute (its window's lowest dip raised: :func:`own_window`) over its
    peers' recent medians (1: as fast as they are)."""
    drift: float | None
    """Its least recent compute over its own earlier median; None until it has one."""
    latest: float
    """Its newest compute over its peers' recent medians: whether it is slow at this
    iteration alone."""
    before: float
    """Its slowdown over its window less the newest figure (0 for a window of 1): at or
    above the ratio while ``slowdown`` is under it, the newest figure alone is fast, and the
    next one tells whether that was a dip."""


@dataclass(frozen=True)
class Straggler:
    """A rank reported: slow for ``config.iterations`` iterations up to ``iteration``."""

    rank: int
    iteration: int
    since: int
    """The first iteration it was slow at, as far as the window tells."""
    slowdown: float
    drift: float | None
    compute_ms: float
    """Its least recent compute time, as ``slowdown`` counts it."""
    peers_ms: float
    """Its peers' recent median compute time."""
    typical_ms: float | None = None
    """Its median recent compute time: what it costs an iteration (the least, above, is the
    robust sign that it is slow at every iteration, and understates that cost)."""
    slow_mates: tuple[int, ...] = ()
    """The ranks of its model replica slow too when it was named: then the figures cannot
    tell which one holds the others up (see the module docstring)."""


def positive_figure(value) -> float | None:
    """A compute time or a time of day as a heartbeat carries it, or None (unknown) for
    anything but a finite number above 0."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    try:
        ms = float(value)
    except OverflowError:  # an integer past any float
        return None
    return ms if math.isfinite(ms) and ms > 0 else None


def has_peers(stages: dict[int, int]) -> bool:
    """Whether two ranks share a pipeline stage. Without (TP1 x DP1: one rank a stage) no rank
    has a peer to be compared with, and no straggler can be named."""
    return len(set(stages.values())) < len(stages)


def assess(figures: dict[int, dict[int, float]], stages: dict[int, int],
           config: StragglerConfig) -> list[Assessment]:
    """Every rank with a full window and at least one peer with a figure within it.
    ``figures``: iteration -> {rank: compute ms}; ``stages``: per rank, its pipeline stage
    (ranks of different stages do different work and are never compared; a rank of unknown
    stage is compared with none). A peer stands by its figures of the iterations the rank's
    window spans: its older ones, from before a hot room slowed every rank, would make the
    rank look slow."""
    series = _series(figures)
    spans = {rank: (times[-config.window][0], times[-1][0]) for rank, times in series.items()
             if len(times) >= config.window and rank in stages}
    medians: dict[tuple[int, int], tuple[dict[int, float], dict[int, list[float]]]] = {}
    assessments = []
    for rank, span in sorted(spans.items()):
        if span not in medians:
            within = _medians_within(series, span)
            medians[span] = within, _sorted_by_stage(within, stages)
        within, by_stage = medians[span]
        # Sorted once per span and stage, each rank's peers are read by index: comparing every
        # rank with every other took 0.8 s per iteration at 2048 ranks, in the supervisor's poll.
        stage_medians = by_stage.get(stages[rank], [])
        if len(stage_medians) < 2:
            continue
        times = [ms for _, ms in series[rank]]
        own = own_window(times, config.window)
        mine, earlier = min(own), times[:-config.window]
        drift = mine / statistics.median(earlier) if len(earlier) >= config.window else None
        peers_ms = _median_without(stage_medians, within[rank])
        before = min(own[:-1], default=0.0) / peers_ms
        assessments.append(Assessment(rank, mine / peers_ms, drift, times[-1] / peers_ms, before))
    return assessments


def own_window(times: list[float], window: int) -> list[float]:
    """A rank's last ``window`` compute times, the lowest of those under both their
    neighbours raised to the lesser of them: one dip is the host's noise, while a step (a
    slowdown starting or ending) stays where it is, and a second dip is a rank slow at some
    iterations only. The newest has no neighbour after it yet, and stays as it is
    (:meth:`StragglerTracker._count_slow` holds it until the next)."""
    kept = times[-window - 1:]
    own, first = kept[-window:], len(kept) - window
    dips = [k for k in range(max(first, 1), len(kept) - 1)
            if kept[k] < min(kept[k - 1], kept[k + 1])]
    if dips:
        lowest = min(dips, key=kept.__getitem__)
        own[lowest - first] = min(kept[lowest - 1], kept[lowest + 1])
    return own


def _sorted_by_stage(medians: dict[int, float], stages: dict[int, int]) -> dict[int, list[float]]:
    """Per pipeline stage, its ranks' ``medians`` in order (ranks of unknown stage left out)."""
    grouped: dict[int, list[float]] = {}
    for rank, value in medians.items():
        if rank in stages:
            grouped.setdefault(stages[rank], []).append(value)
    for values in grouped.values():
        values.sort()
    return grouped


def _median_without(ordered: list[float], value: float) -> float:
    """The median of ``ordered`` (sorted, holding ``value``) with one ``value`` taken out."""
    gone = bisect.bisect_left(ordered, value)
    count = len(ordered) - 1

    def rest(k: int) -> float:
        return ordered[k if k < gone else k + 1]

    middle = count // 2
    return rest(middle) if count % 2 else (rest(middle - 1) + rest(middle)) / 2


def known_figures(row: dict) -> dict[int, float]:
    """One iteration's figures (rank -> compute ms), the unknown ones left out."""
    return {rank: ms for rank, value in row.items() if (ms := positive_figure(value)) is not None}


def heard_lately(known_rows: list[dict[int, float]], config: StragglerConfig) -> set[int]:
    """The ranks with a figure in the last :attr:`StragglerConfig.naming_span` of
    ``known_rows`` (:func:`known_figures` per iteration, in order): one silent that long is
    unknown, neither slow nor fast, and is judged afresh when its figures are back."""
    return set().union(*known_rows[-config.naming_span:])


def held_slowdowns(figures: dict[int, dict[int, float]], stages: dict[int, int],
                   config: StragglerConfig) -> dict[int, float]:
    """Per rank, the highest slowdown it held for ``config.iterations`` of its judged
    iterations in a row, as the figures arrive in iteration order: the highest ratio at which
    these figures would have named it. A healthy run's margin is the ratio over the highest."""
    seen: dict[int, dict[int, float]] = {}
    recent: dict[int, list[float]] = {}
    held: dict[int, float] = {}
    waiting: dict[int, Assessment] = {}

    def count(rank: int, slowdown: float) -> None:
        run = recent.setdefault(rank, [])
        run[:] = (run + [slowdown])[-config.iterations:]
        if len(run) == config.iterations:
            held[rank] = max(held.get(rank, 0.0), min(run))

    for iteration in sorted(figures):
        seen[iteration] = known_figures(figures[iteration])
        heard = heard_lately(list(seen.values()), config)  # as the tracker forgets the silent
        for rank in waiting.keys() - heard:
            count(rank, waiting.pop(rank).slowdown)
        for rank in recent.keys() - heard:
            del recent[rank]
        for judged in assess(seen, stages, config):
            if judged.rank not in seen[iteration]:
                continue  # unknown at this iteration: its run stays, as the tracker's does
            if (last := waiting.pop(judged.rank, None)) is not None:
                # slow at a ratio if it was, or if only its newest figure was fast then and
                # this judgment is slow: a dip (StragglerTracker._count_slow)
                count(judged.rank, max(last.slowdown, min(last.before, judged.slowdown)))
            waiting[judged.rank] = judged
    for last in waiting.values():
        count(last.rank, last.slowdown)
    return held


def _series(figures: dict[int, dict[int, float]]) -> dict[int, list[tuple[int, float]]]:
    """Per rank, its (iteration, compute ms) pairs in iteration order, unknown figures left
    out."""
    series: dict[int, list[tuple[int, float]]] = {}
    for iteration in sorted(figures):
        for rank, value in figures[iteration].items():
            if (ms := positive_figure(value)) is not None:
                series.setdefault(rank, []).append((iteration, ms))
    return series


def _medians_within(series: dict[int, list[tuple[int, float]]],
                    span: tuple[int, int]) -> dict[int, float]:
    """Per rank with a figure in ``span`` (first and last iteration), their median."""
    first, last = span
    within = {rank: [ms for iteration, ms in times if first <= iteration <= last]
              for rank, times in series.items()}
    return {rank: statistics.median(values) for rank, values in within.items() if values}


class StragglerTracker:
    """The figures per iteration and the run of slow iterations per rank."""

    def __init__(self, config: StragglerConfig | None = None) -> None:
        self.config = config or StragglerConfig()
        self._figures: OrderedDict[int, dict[int, float]] = OrderedDict()
        self._stages: dict[int, int] = {}
        self._replicas: dict[int, int] = {}
        self._slowdown: dict[int, float] = {}
        """Each rank's slowdown at the last iteration it had a figure."""
        self._slow_run: dict[int, int] = {}
        self._slow_since: dict[int, int] = {}
        """Per rank in a run of slow iterations, the iteration its slowdown shows from: its
        window's first figure where the run began."""
        self._dipped: dict[int, int] = {}
        """Per rank, the iteration whose newest figure alone was fast, until the next one
        tells whether that was a dip (:meth:`_count_slow`)."""
        self._fast_run: dict[int, int] = {}
        self._reported: set[int] = set()
        self._silent_since_named: set[int] = set()
        """Ranks named, then silent (:meth:`_forget_the_silent`), and not fast for
        ``iterations`` in a row since: unknown, so not known to be fast."""

    def observe(self, figures: dict[int, dict[int, float]], stages: dict[int, int],
                replicas: dict[int, int] | None = None) -> list[Straggler]:
        """``figures``: iteration -> {rank: compute ms}, iterations already seen ignored;
        ``replicas``: per rank, its model replica (its data-parallel index), where known.
        Returns the ranks that became stragglers."""
        self._stages.update(stages)
        self._replicas.update(replicas or {})
        found = []
        for iteration in sorted(i for i in figures if not self._figures or i > next(reversed(self._figures))):
            self._figures[iteration] = known_figures(figures[iteration])
            while len(self._figures) > self.config.history:
                self._figures.popitem(last=False)
            found += self._judge(iteration)
        return found

    def still_slow(self, rank: int) -> bool:
        """Whether ``rank``, once named, has not been fast for ``iterations`` in a row since."""
        return rank in self._reported

    def not_known_fast(self, rank: int) -> bool:
        """Whether ``rank``, once named, is still slow or has been unknown since (silent,
        then back and not yet named anew nor fast for ``iterations`` in a row): what a drain
        of another straggler must count as still slow, never as healthy."""
        return rank in self._reported or rank in self._silent_since_named

    def slow_mates(self, rank: int) -> tuple[int, ...]:
        """The other ranks of ``rank``'s model replica that are slow now: named and not fast
        again since, or at or above the ratio at their last figure."""
        replica = self._replicas.get(rank)
        if replica is None:
            return ()
        return tuple(sorted(other for other, theirs in self._replicas.items()
                            if theirs == replica and other != rank
                            and (other in self._reported
                                 or self._slowdown.get(other, 0.0) >= self.config.ratio)))

    def _forget_the_silent(self) -> None:
        """A rank not :func:`heard_lately` is unknown now: named, it stayed still slow for
        the rest of the attempt, a slow mate of any straggler of its replica. Neither still
        slow nor known fast, it is kept as such (:meth:`not_known_fast`)."""
        heard = heard_lately(list(self._figures.values()), self.config)
        for state in (self._slowdown, self._slow_run, self._slow_since, self._dipped,
                      self._fast_run):
            for rank in state.keys() - heard:
                del state[rank]
        self._silent_since_named |= self._reported - heard
        self._reported &= heard

    def _judge(self, iteration: int) -> list[Straggler]:
        self._forget_the_silent()
        found = []
        judged_now = [judged for judged in assess(self._figures, self._stages, self.config)
                      if judged.rank in self._figures[iteration]]  # unknown: its run stays
        self._slowdown.update((judged.rank, judged.slowdown) for judged in judged_now)
        for judged in judged_now:
            self._count_fast(judged)
            if not self._count_slow(judged, iteration):
                continue
            if self._slow_run[judged.rank] >= self.config.iterations and judged.rank not in self._reported:
                self._reported.add(judged.rank)
                window = own_window([ms for _, ms in _series(self._figures)[judged.rank]],
                                    self.config.window)
                mine = min(window)
                found.append(Straggler(judged.rank, iteration, self._slow_since[judged.rank],
                                       round(judged.slowdown, 3),
                                       None if judged.drift is None else round(judged.drift, 3),
                                       round(mine, 3), round(mine / judged.slowdown, 3),
                                       round(statistics.median(window), 3),
                                       self.slow_mates(judged.rank)))
        return found

    def _count_slow(self, judged: Assessment, iteration: int) -> bool:
        """Whether ``judged`` is slow, its run of slow iterations counted. An iteration whose
        newest figure alone was fast is held until the next: if that one is slow, the figure
        was a dip (:func:`own_window` has raised it by then) and both count; otherwise the run
        breaks (:func:`held_slowdowns` replays the same)."""
        rank, ratio = judged.rank, self.config.ratio
        dipped = self._dipped.pop(rank, None)
        if judged.slowdown < ratio:
            if dipped is not None or judged.before < ratio:
                self._slow_run[rank] = 0
            if judged.before >= ratio:
                self._dipped[rank] = iteration  # its run stays until the next figure
            return False
        if not self._slow_run.get(rank):
            began = iteration if dipped is None else dipped
            self._slow_since[rank] = self._window_start(rank, began)
        self._slow_run[rank] = self._slow_run.get(rank, 0) + (1 if dipped is None else 2)
        return True

    def _window_start(self, rank: int, iteration: int) -> int:
        """The iteration of the first figure in ``rank``'s window that ends at ``iteration``:
        with unknown figures between, it spans more iterations than it holds figures."""
        mine = [seen for seen, row in self._figures.items() if seen <= iteration and rank in row]
        return mine[-self.config.window:][0]

    def _count_fast(self, judged: Assessment) -> None:
        """A named rank is let go once its own figure stayed under the ratio ``iterations``
        in a row, and never on one alone: :meth:`_count_slow` holds a lone fast figure as a
        dip until the next (with ``--straggler-iterations 1`` one let it go, and the next slow
        figure named the same slowdown again). Not its window's least: two fast iterations
        in a row keep that under the ratio for ``window`` iterations and more (before lone
        dips were raised, one did, and a straggler slow 7 iterations in 8 was named anew
        every 8)."""
        fast = judged.latest < self.config.ratio
        self._fast_run[judged.rank] = self._fast_run.get(judged.rank, 0) + 1 if fast else 0
        if self._fast_run[judged.rank] >= max(self.config.iterations, 2):
            self._reported.discard(judged.rank)
            self._silent_since_named.discard(judged.rank)
