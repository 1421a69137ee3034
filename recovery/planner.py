"""Choose TP/PP/CP/EP/DP, the micro-batch and the ranks per node for the GPUs that survive.

Pure functions: no I/O, no clock, the same answer for the same input (on every node).

**Validity.** A layout is valid when Megatron-LM accepts it (every rule of ``layout_rules``,
each citing Megatron's source), its TP groups stay inside nodes, it keeps the optimisation
(the global batch, or one within ``global_batch_tolerance_pct`` of it; the micro-batch is the
largest divisor of the per-replica batch that is at most the original), and, given a GPU
memory size, ``memory_estimate`` says it fits. Without a memory size nothing is checked, but a
plan whose estimate exceeds the original layout's by more than 25% (and 1 GiB) says so in its
``warnings``.

**Nodes.** The input is the schedulable GPUs of each node in node-rank order. A node runs a
multiple of TP ranks (0: it stands by as a spare). For a layout of W ranks the nodes that can
host the most ranks are filled first (ties: lower node rank first) and the last one filled
gets the remainder: whole healthy nodes are used before partly failed ones, the fewest nodes
take part (fewer machines whose loss stops the job), and the rest stay whole spares for the
next failure. Ranks are contiguous per node, in node-rank order. The answer depends only on
the list, so every node computes the same plan; equal nodes in another order give the same
layout. ``plan_layout(gpus, gpus_per_node)`` is the case of equal nodes (plus one partial).

**Ranking** (mode ``closest``, the default):

1. *Hot spare*: when the original layout (the command's TP/PP/CP/EP, micro-batch and batch
   at ``original_world_size`` GPUs) is valid on these nodes, it wins unchanged.
2. Otherwise layouts are compared by ``cost_model``'s estimated throughput (samples per
   second). Estimates within ``THROUGHPUT_TIE`` (2%) of the best are equal, as the model is
   not more accurate than that; among them the least disruptive wins, in this order: the
   original global batch (a changed one must buy throughput); more GPUs used; the smallest
   change of layout, ``|log2 TP/TP0| + |log2 PP/PP0| + |log2 CP/CP0| + |log2 EP/EP0|``
   (halving is as large a change as doubling); the global batch closest to the original; the
   larger micro-batch; the larger TP x PP (less memory per GPU); the larger TP (a smaller
   bubble). Fewer GPUs win only when they are estimably faster (a deeper pipeline with few
   micro-batches, or gradient traffic across nodes).

Mode ``paper`` follows section III.E of the paper (the largest TP, then PP) among the same
valid layouts: more GPUs used, then the larger TP, then the larger PP (no hot-spare rule).

**Global-batch tolerance.** With ``global_batch_tolerance_pct`` > 0 any global batch within
that many percent of the original may be chosen (never with a step schedule); the rewritten
command carries it and ends at the same sample count (``batch_schedule``). With the exact
rule (0), a plan that leaves more than 10% of the GPUs idle gets a one-line warning naming
the tolerance that would fix it.

**Search.** For each model split (TP, CP, PP, EP) the data-parallel sizes are tried from the
largest the nodes allow downwards. An upper bound on a split's throughput at a DP (compute
plus bubble with a one-sample micro-batch and no communication) grows with DP, so once it
falls below the best estimate found minus the tie band, no smaller DP of that split can
enter the ranking and the split is left; splits are visited in order of their bound. A split
is also left at the first DP where even micro-batch 1 with one distributed-optimizer instance
does not fit: memory only grows as DP shrinks (larger optimizer shards, more micro-batches in
flight; a smaller DP may run fewer instances, never shard wider). Paper mode keeps the largest
DP of each split. This keeps 131,072 GPUs under 0.1 s (``benchmarks/planner_speed.py``).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import asdict, dataclass, field, replace
from functools import cache
from typing import Callable, Iterator, Sequence

from .cost_model import Hardware, SplitCost, StepEstimate, calibrated, estimate_step, split_cost
from .layout_rules import (ModelSplit, context_sizes, data_parallel_allows, divisors,
                           expert_sizes, interleaving_allows, model_splits,
                           optimizer_instances_for, pipeline_split, sequence_parallel_allows,
                           tensor_sizes)
from .megatron_args import (ScriptFacts, keep_checkpoint_lr_schedule, read_script_args,
                            rewrite_argv, set_optimizer_instances)
from .memory_estimate import (ASSUMED_VOCAB_SIZE, GIB, RESERVE_GIB, StageMemory,
                              memory_warnings, peak_bytes, stage_memories)

MODES = ("closest", "paper")
HOT_SPARE = "the original layout fits (hot spare)"
"""The plan's reason when it is the command's own layout, unchanged (mode ``closest``)."""
THROUGHPUT_TIE = 0.02
IDLE_WARNING_FRACTION = 0.10
TOLERANCE_LADDER_PCT = (0.5, 1.0, 2.0, 5.0, 10.0)
"""The tolerances the idle warning tries, smallest first: a small job's batch moves in large
steps (16 to 15 on 3 GPUs is 6.25%)."""
MAX_TOLERANCE_PCT = 50.0
UNCHECKED_MEMORY_GROWTH = 0.25
"""Without a memory size, a plan needing this much (and 1 GiB) more memory than the original
layout is flagged."""


class PlanError(ValueError):
    """No layout fits; the message names the constraint that ruled them out."""


@dataclass(frozen=True)
class Layout:
    """One way to split the job: what the planner ranks."""

    tensor_model_parallel_size: int
    """TP."""
    pipeline_model_parallel_size: int
    """PP."""
    data_parallel_size: int
    """world / (TP x PP x CP)."""
    micro_batch_size: int
    """The training micro-batch."""
    global_batch_size: int
    """The global batch (the original, or within the tolerance)."""
    context_parallel_size: int = 1
    """CP."""
    expert_model_parallel_size: int = 1
    """EP."""
    virtual_pipeline_size: int = 1
    """The interleaving degree (1: none)."""
    eval_micro_batch_size: int | None = None
    """Set only when the evaluation micro-batch must be rewritten for this DP."""

    @property
    def num_gpus(self) -> int:
        return (self.tensor_model_parallel_size * self.pipeline_model_parallel_size
                * self.context_parallel_size * self.data_parallel_size)


@dataclass(frozen=True)
class Plan:
    """The layout to relaunch with, where its ranks go, and the rewritten training command."""

    tensor_model_parallel_size: int
    """TP."""
    pipeline_model_parallel_size: int
    """PP."""
    data_parallel_size: int
    """world / (TP x PP x CP), as Megatron-LM computes it."""
    micro_batch_size: int
    """The training micro-batch."""
    global_batch_size: int
    """The global batch the relaunch runs (the batch in effect, with a step schedule)."""
    num_gpus_used: int
    """TP x PP x CP x DP: the ranks of the relaunch; at most the GPUs available."""
    command: tuple[str, ...]
    """``(SCRIPT, *rewritten args)``."""
    context_parallel_size: int = 1
    """CP."""
    expert_model_parallel_size: int = 1
    """EP."""
    virtual_pipeline_model_parallel_size: int | None = None
    """The interleaving degree; None without interleaving (Megatron's convention)."""
    ranks_per_node: tuple[int, ...] = ()
    """Ranks each node runs, in node-rank order (each a multiple of TP; 0: a spare)."""
    idle_gpus: int = 0
    """Schedulable GPUs the plan leaves unused."""
    original_global_batch_size: int | None = None
    """The command's global batch (differs from ``global_batch_size`` only with a tolerance)."""
    estimated_step_seconds: float | None = None
    """The cost model's step time (calibrated when a measured one was given)."""
    throughput_vs_original: float | None = None
    """Estimated samples/s over the original layout's, when the original GPU count is known."""
    estimated_memory_gib: float | None = None
    """Peak allocated memory estimate of the busiest rank (without the reserve)."""
    reason: str = ""
    """Why this layout won, in a few words."""
    warnings: tuple[str, ...] = ()
    """Flags only approximated, idle GPUs, and other things the user should know."""

    def as_json(self) -> dict:
        """The object ``ftmaster plan --json`` prints (DESIGN's contract plus extras)."""
        return {**asdict(self), "command": list(self.command),
                "ranks_per_node": list(self.ranks_per_node), "warnings": list(self.warnings)}

    def layout(self) -> tuple:
        """What sets the step time: the degrees, the batches and where the ranks go; not the
        estimates, which a calibrated plan of the same layout gives anew."""
        return (self.tensor_model_parallel_size, self.pipeline_model_parallel_size,
                self.data_parallel_size, self.context_parallel_size,
                self.expert_model_parallel_size, self.virtual_pipeline_model_parallel_size,
                self.micro_batch_size, self.global_batch_size, self.ranks_per_node)


@dataclass(frozen=True)
class PlanRequest:
    """What the caller knows besides the command."""

    node_gpus: tuple[int, ...]
    """Schedulable GPUs of each node, in node-rank order."""
    mode: str = "closest"
    """``closest`` (throughput, ties to the original) or ``paper``."""
    gpu_memory_gb: float | None = None
    """Per-GPU memory in GiB; None: memory is not checked."""
    original_world_size: int | None = None
    """GPUs of the original launch: the hot-spare rule, the throughput ratio and a global
    batch derived by Megatron need it."""
    global_batch_tolerance_pct: float = 0.0
    """How far (percent) the global batch may move; 0: it is kept exactly."""
    consumed_samples: int | None = None
    """The resume point: samples consumed so far (places the run in a step schedule)."""
    measured_step_s: float | None = None
    """Measured step time of the original layout; calibrates the cost model."""
    hardware: Hardware = field(default_factory=Hardware)
    """The cost model's rates."""

    def __post_init__(self) -> None:
        if self.mode not in MODES:
            raise ValueError(f"mode must be one of {', '.join(MODES)}, got {self.mode!r}")
        if any(gpus < 0 for gpus in self.node_gpus):
            raise ValueError(f"GPUs per node cannot be negative, got {list(self.node_gpus)}")
        if self.gpu_memory_gb is not None and self.gpu_memory_gb <= 0:
            raise ValueError(f"GPU memory must be positive, got {self.gpu_memory_gb:g} GiB")
        if not 0 <= self.global_batch_tolerance_pct <= MAX_TOLERANCE_PCT:
            raise ValueError(f"the global batch tolerance must be within 0 and "
                             f"{MAX_TOLERANCE_PCT:g} percent, got {self.global_batch_tolerance_pct:g}")
        if self.consumed_samples is not None and self.consumed_samples < 0:
            raise ValueError(f"consumed samples cannot be negative, got {self.consumed_samples}")
        if self.measured_step_s is not None and self.original_world_size is None:
            raise ValueError(f"--measured-step-s {self.measured_step_s:g} needs --original-gpus N, "
                             "the GPU count that step was measured on")


@dataclass(frozen=True)
class _Batches:
    """The global batches a layout may run."""

    original: int
    """The command's global batch (the one in effect, with a step schedule)."""
    low: int
    """The smallest allowed global batch."""
    high: int
    """The largest allowed global batch."""
    divides: int
    """Every DP must divide this (the evaluation batch, the schedule's batches); 0: none."""
    schedule: tuple[int, ...] = ()
    """Batches of a step schedule still to come: each must divide by micro-batch x DP."""

    def for_data_parallel(self, dp: int) -> list[int]:
        """Multiples of DP in range, the closest to the original first."""
        first = -(-self.low // dp) * dp
        return sorted(range(first, self.high + 1, dp), key=lambda b: (abs(b - self.original), b))


@dataclass(frozen=True)
class _SplitModel:
    """A model split with its precomputed costs and memory coefficients."""

    split: ModelSplit
    """TP, CP, PP, EP."""
    cost: SplitCost
    """Its per-sample costs."""
    stages: tuple[StageMemory, ...]
    """Its stages' memory coefficients."""


@dataclass(frozen=True)
class _Candidate:
    """A valid layout with its estimates."""

    layout: Layout
    """What the plan will say."""
    split: ModelSplit
    """The model split behind it."""
    step: StepEstimate
    """The modelled step."""
    throughput: float
    """Samples per second."""
    memory_bytes: float
    """Peak allocated memory of the busiest rank."""


@dataclass(frozen=True)
class _Problem:
    """Everything the search needs, derived once per plan."""

    facts: ScriptFacts
    """What the command says."""
    request: PlanRequest
    """What the caller says."""
    hardware: Hardware
    """The cost model's rates (calibrated when a step time was measured)."""
    capacity: Callable[[int], int]
    """The most ranks the nodes can run for a TP."""
    node_size: int | None
    """GPUs of the largest node across several nodes; None: one node."""
    vocab: Callable[[int], int]
    """The padded vocabulary for a TP."""
    memory_limit: float | None
    """Bytes a rank may allocate (the GPU memory less the reserve); None: not checked."""


# -- nodes ------------------------------------------------------------------------------------

def uniform_nodes(gpus: int, gpus_per_node: int | None) -> tuple[int, ...]:
    """``gpus`` in nodes of ``gpus_per_node`` (the last one partial); None: one node."""
    if gpus_per_node is None:
        return (gpus,)
    if gpus_per_node < 1:
        raise ValueError(f"GPUs per node must be a positive integer, got {gpus_per_node}")
    full, rest = divmod(max(gpus, 0), gpus_per_node)
    return (gpus_per_node,) * full + ((rest,) if rest else ())


def _capacity_function(node_gpus: Sequence[int]) -> Callable[[int], int]:
    """The most ranks the nodes can run when each runs a multiple of TP."""
    counts = Counter(node_gpus)

    @cache
    def capacity(tp: int) -> int:
        return sum(count * (gpus // tp) * tp for gpus, count in counts.items())
    return capacity


def assign_ranks(node_gpus: Sequence[int], tp: int, world: int) -> tuple[int, ...]:
    """Ranks per node for ``world`` ranks: the fullest nodes first (see the module docstring)."""
    order = sorted(range(len(node_gpus)), key=lambda node: (-(node_gpus[node] // tp), node))
    ranks, left = [0] * len(node_gpus), world
    for node in order:
        ranks[node] = min(node_gpus[node] // tp * tp, left)
        left -= ranks[node]
    if left:
        raise PlanError(f"{world} ranks do not fit the nodes at TP {tp}")
    return tuple(ranks)


# -- batches ----------------------------------------------------------------------------------

def _batches(facts: ScriptFacts, request: PlanRequest, tolerance_pct: float) -> _Batches:
    original = facts.original
    required = [original.eval_global_batch_size or 0]
    schedule: tuple[int, ...] = ()
    if facts.step_schedule is not None:
        schedule = facts.step_schedule.batches_from(request.consumed_samples or 0)
        required += schedule
        tolerance_pct = 0.0
    if facts.phase_transitions:
        tolerance_pct = 0.0  # check_checkpoint_args compares the global batch with the checkpoint's
    gbs = original.global_batch_size
    slack = math.floor(gbs * tolerance_pct / 100)
    return _Batches(gbs, max(1, gbs - slack), gbs + slack, math.gcd(*required), schedule)


def _data_parallel_sizes(batches: _Batches, dp_max: int) -> Iterator[int]:
    """DP sizes from the largest down that some allowed global batch divides by."""
    if batches.low == batches.high:
        limit = math.gcd(batches.original, batches.divides)
        yield from (dp for dp in reversed(divisors(limit)) if dp <= dp_max)
        return
    for dp in range(min(dp_max, batches.high), 0, -1):  # a larger DP divides no batch
        if batches.divides % dp == 0 and batches.high // dp * dp >= batches.low:
            yield dp


# -- one candidate ----------------------------------------------------------------------------

def _descending_divisors(n: int, limit: int) -> list[int]:
    return [d for d in reversed(divisors(n)) if d <= limit]


def _eval_micro_batch(problem: _Problem, pp: int, vpp: int, dp: int, micro_batch: int,
                      batch: int) -> tuple[bool, int | None]:
    """(possible, the value to write or None) for ``--eval-micro-batch-size`` (validate_args;
    the interleaved schedule's rule applies to evaluation too)."""
    original = problem.facts.original
    # The eval batch defaults to Megatron's global batch, which with a step schedule (no
    # --global-batch-size allowed) is micro-batch x DP, not the scheduled batch.
    global_batch = micro_batch * dp if problem.facts.step_schedule is not None else batch
    eval_batch = original.eval_global_batch_size or global_batch
    default = original.eval_micro_batch_size or micro_batch
    if eval_batch % dp:
        return False, None
    for value in _descending_divisors(eval_batch // dp, default):
        if interleaving_allows(problem.facts.pipeline, pp, vpp, [eval_batch // dp // value]):
            return True, None if value == default else value
    return False, None


def _memory(problem: _Problem, model: _SplitModel, dp: int, vpp: int, micro_batch: int,
            micro_batches: int) -> float:
    split = model.split
    expert_dp = split.tensor * split.context * dp // (split.expert_tensor * split.expert)
    group = problem.facts.pipeline.microbatch_group_size
    return max(peak_bytes(stage, problem.facts.memory, split, dp=dp, expert_dp=expert_dp,
                          vpp=vpp, group=group, micro_batch=micro_batch,
                          micro_batches=micro_batches) for stage in model.stages)


def _virtual_options(model: _SplitModel) -> tuple[int, ...]:
    pipeline = model.split.pipeline
    if pipeline.virtual_size > 1 and pipeline.can_stop_interleaving:
        return pipeline.virtual_size, 1
    return (pipeline.virtual_size,)


def _evaluate(problem: _Problem, model: _SplitModel, dp: int, batch: int, batches: _Batches,
              *, micro_batch_cap: int | None = None, memory_limit: float | None = None
              ) -> _Candidate | None:
    """The layout of ``model`` at this DP and batch with the largest valid micro-batch."""
    split, facts = model.split, problem.facts
    pp = split.pipeline.size
    per_replica = batch // dp
    cap = micro_batch_cap or facts.original.micro_batch_size
    for micro_batch in _descending_divisors(per_replica, cap):
        if any(later % (micro_batch * dp) for later in batches.schedule):
            continue
        micro_batches = per_replica // micro_batch
        # each batch still to come in a step schedule runs the interleaved schedule too
        counts = [micro_batches, *(later // (micro_batch * dp) for later in batches.schedule)]
        for vpp in _virtual_options(model):
            if not interleaving_allows(facts.pipeline, pp, vpp, counts):
                continue
            possible, eval_micro_batch = _eval_micro_batch(problem, pp, vpp, dp, micro_batch, batch)
            if not possible:
                continue
            memory = _memory(problem, model, dp, vpp, micro_batch, micro_batches)
            if memory_limit is not None and memory > memory_limit:
                continue
            step = estimate_step(model.cost, split, problem.hardware, dp=dp, vpp=vpp,
                                 micro_batch=micro_batch, micro_batches=micro_batches,
                                 node_size=problem.node_size,
                                 overlap_grad_reduce=facts.overlap_grad_reduce)
            layout = Layout(split.tensor, pp, dp, micro_batch, batch, split.context,
                            split.expert, vpp, eval_micro_batch)
            return _Candidate(layout, split, step, batch / step.seconds, memory)
    return None


# -- the search -------------------------------------------------------------------------------

def _never_fits(problem: _Problem, model: _SplitModel, dp: int, batches: _Batches) -> bool:
    """Whether even micro-batch 1 exceeds the memory at this DP with one distributed-optimizer
    instance. Memory then exceeds it at every smaller DP too: the optimizer shards grow and
    more micro-batches are in flight. One instance, because a smaller DP may run fewer
    instances than this one (they must divide it), and so shard wider than this DP does."""
    if problem.memory_limit is None:
        return False
    memory = replace(problem.facts.memory, optimizer_instances=1)
    widest = replace(problem, facts=replace(problem.facts, memory=memory))
    vpp = min(_virtual_options(model))
    micro_batches = min(batches.for_data_parallel(dp)) // dp  # the fewest in flight
    return _memory(widest, model, dp, vpp, 1, micro_batches) > problem.memory_limit


def _split_model(problem: _Problem, split: ModelSplit) -> _SplitModel:
    facts, vocab = problem.facts, problem.vocab(split.tensor)
    return _SplitModel(split,
                       split_cost(facts.shape, facts.memory, split, vocab),
                       stage_memories(facts.shape, facts.memory, split, vocab))


def _upper_bound(problem: _Problem, model: _SplitModel, dp: int, batches: _Batches) -> float:
    """Samples/s no layout of this split at this DP can exceed (compute and bubble only)."""
    sample_seconds = model.cost.stage_flops / problem.hardware.flops
    pipeline = model.split.pipeline
    bubble = (pipeline.size - 1) / max(pipeline.virtual_size, 1)
    return batches.high / ((batches.low / dp + bubble) * sample_seconds)


def _dp_max(problem: _Problem, split: ModelSplit) -> int:
    return problem.capacity(split.tensor) // split.model_parallel


def _search(problem: _Problem, batches: _Batches) -> list[_Candidate]:
    """Every candidate that can rank (see the module docstring on pruning)."""
    facts, mode = problem.facts, problem.request.mode
    models = [_split_model(problem, split) for split in model_splits(
        facts.shape, facts.original, facts.pipeline, facts.rules, problem.capacity)]
    models = [model for model in models if _dp_max(problem, model.split) > 0]
    models.sort(key=lambda m: -_upper_bound(problem, m, _dp_max(problem, m.split), batches))
    found, best = [], 0.0
    for model in models:
        for dp in _data_parallel_sizes(batches, _dp_max(problem, model.split)):
            if not data_parallel_allows(model.split, facts.rules, dp):
                continue
            if mode == "closest" and _upper_bound(problem, model, dp, batches) < best * (1 - THROUGHPUT_TIE):
                break
            made = [candidate for batch in batches.for_data_parallel(dp)
                    if (candidate := _evaluate(problem, model, dp, batch, batches,
                                               memory_limit=problem.memory_limit))]
            if not made and _never_fits(problem, model, dp, batches):
                break
            found += made
            best = max([best] + [candidate.throughput for candidate in made])
            if made and mode == "paper":
                break  # a smaller DP of this split only loses GPUs
    return found


def _change(layout: Layout, facts: ScriptFacts) -> float:
    original = facts.original
    pairs = ((layout.tensor_model_parallel_size, original.tensor_model_parallel_size),
             (layout.pipeline_model_parallel_size, original.pipeline_model_parallel_size),
             (layout.context_parallel_size, original.context_parallel_size),
             (layout.expert_model_parallel_size, original.expert_model_parallel_size))
    return round(sum(abs(math.log2(new / old)) for new, old in pairs), 9)


def _closest_key(facts: ScriptFacts):
    def key(candidate: _Candidate):
        layout = candidate.layout
        tp, pp = layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size
        batch_change = abs(layout.global_batch_size - facts.original.global_batch_size)
        return (batch_change > 0, -layout.num_gpus, _change(layout, facts), batch_change,
                -layout.micro_batch_size, -tp * pp, -tp, layout.context_parallel_size,
                layout.expert_model_parallel_size, layout.global_batch_size)
    return key


def _paper_key(candidate: _Candidate):
    layout = candidate.layout
    return (-layout.num_gpus, -layout.tensor_model_parallel_size,
            -layout.pipeline_model_parallel_size, -layout.micro_batch_size,
            layout.context_parallel_size, layout.expert_model_parallel_size)


def _choose(problem: _Problem, candidates: list[_Candidate]) -> tuple[_Candidate, str]:
    if problem.request.mode == "paper":
        return min(candidates, key=_paper_key), "the paper's rule: most GPUs, then TP, then PP"
    best = max(candidate.throughput for candidate in candidates)
    band = [c for c in candidates if c.throughput >= best * (1 - THROUGHPUT_TIE)]
    chosen = min(band, key=_closest_key(problem.facts))
    if chosen.throughput == best:
        return chosen, "the highest estimated throughput"
    return chosen, (f"within {THROUGHPUT_TIE:.0%} of the highest estimated throughput, "
                    "and the least change from the original")


# -- the original layout ----------------------------------------------------------------------

def _original_model(problem: _Problem, world: int | None) -> tuple[_SplitModel, int] | None:
    """The command's own split and DP on ``world`` GPUs, when Megatron accepts them."""
    facts = problem.facts
    original = facts.original
    if world is None or world % original.model_parallel_size:
        return None
    tp, cp = original.tensor_model_parallel_size, original.context_parallel_size
    pipeline = pipeline_split(facts.shape, facts.pipeline, original.pipeline_model_parallel_size)
    if (pipeline is None or tp not in tensor_sizes(facts.shape, original, facts.rules)
            or cp not in context_sizes(facts.shape, original, facts.rules)
            or not sequence_parallel_allows(facts.shape, facts.rules, tp, cp)
            or original.expert_model_parallel_size not in expert_sizes(facts.shape, facts.rules)):
        return None
    split = ModelSplit(tp, cp, pipeline, original.expert_model_parallel_size,
                       original.expert_tensor_parallel_size or tp)
    dp = world // original.model_parallel_size
    if not data_parallel_allows(split, facts.rules, dp):
        return None
    return _split_model(problem, split), dp


def _original_candidate(problem: _Problem, batches: _Batches,
                        world: int | None = None) -> _Candidate | None:
    """The original layout on ``world`` GPUs (default: the original count), evaluated
    whatever the GPUs available now."""
    found = _original_model(problem, world or problem.request.original_world_size)
    if found is None:
        return None
    model, dp = found
    batch = problem.facts.original.global_batch_size
    if batch % dp:
        return None
    return _evaluate(problem, model, dp, batch, batches)


def _is_hot_spare(problem: _Problem, original: _Candidate | None) -> bool:
    """The original layout, unchanged, on these nodes."""
    if original is None or problem.request.mode != "closest":
        return False
    layout, facts = original.layout, problem.facts
    unchanged = (layout.micro_batch_size == facts.original.micro_batch_size
                 and layout.virtual_pipeline_size == original.split.pipeline.virtual_size
                 and layout.eval_micro_batch_size is None)
    fits = problem.memory_limit is None or original.memory_bytes <= problem.memory_limit
    return unchanged and fits and layout.num_gpus <= problem.capacity(layout.tensor_model_parallel_size)


# -- messages ---------------------------------------------------------------------------------

def _limits(problem: _Problem) -> str:
    shape = problem.facts.shape
    sizes = ",".join(map(str, tensor_sizes(shape, problem.facts.original, problem.facts.rules)))
    return (f"{shape.num_attention_heads} attention heads, {shape.num_query_groups} query "
            f"groups, FFN {shape.ffn_hidden_size} allow TP in {{{sizes}}}")


def _no_layout_message(problem: _Problem, batches: _Batches) -> str:
    gpus = sum(problem.request.node_gpus)
    head = f"no layout fits {gpus} GPUs"
    if gpus < 1:
        return f"{head}: at least one GPU is needed"
    if problem.memory_limit is not None:
        unlimited = _search(replace(problem, memory_limit=None), batches)
        if unlimited:
            return _memory_message(problem, unlimited, batches, head)
    return (f"{head}: no split of the model ({_limits(problem)}, {problem.facts.shape.num_layers} "
            f"layers) and of global batch {batches.original} fits these nodes "
            f"({list(problem.request.node_gpus)[:8]}{'...' if len(problem.request.node_gpus) > 8 else ''})")


def _memory_message(problem: _Problem, candidates: list[_Candidate], batches: _Batches,
                    head: str) -> str:
    def smallest(candidate: _Candidate) -> tuple[float, Layout]:
        layout = candidate.layout
        at_one = _evaluate(problem, _split_model(problem, candidate.split),
                           layout.data_parallel_size, layout.global_batch_size, batches,
                           micro_batch_cap=1)
        return (at_one or candidate).memory_bytes, layout
    estimate, layout = min((smallest(c) for c in candidates), key=lambda pair: pair[0])
    return (f"{head} in {problem.request.gpu_memory_gb:g} GiB per GPU: the smallest memory "
            f"estimate is {estimate / GIB:.4g} GiB (+{RESERVE_GIB:g} GiB reserve) at "
            f"TP{layout.tensor_model_parallel_size} PP{layout.pipeline_model_parallel_size} "
            f"DP{layout.data_parallel_size} micro-batch 1 ({_limits(problem)}); "
            f"add GPUs or memory per GPU")


def _idle_warning(problem: _Problem, chosen: _Candidate, batches: _Batches) -> str | None:
    """With the exact batch, name the tolerance that would put at least 90% of GPUs to work."""
    gpus = sum(problem.request.node_gpus)
    idle = gpus - chosen.layout.num_gpus
    if idle <= IDLE_WARNING_FRACTION * gpus or batches.low != batches.high or batches.schedule:
        return None
    advice = f"no tolerance up to {TOLERANCE_LADDER_PCT[-1]:g}% would fix it"
    for pct in TOLERANCE_LADDER_PCT:
        wider = _batches(problem.facts, problem.request, pct)
        candidates = _search(problem, wider)
        if candidates:
            better, _ = _choose(problem, candidates)
            if gpus - better.layout.num_gpus <= IDLE_WARNING_FRACTION * gpus:
                advice = (f"--global-batch-tolerance {pct:g} would use {better.layout.num_gpus} "
                          f"with global batch {better.layout.global_batch_size}")
                break
    return (f"the exact global batch {batches.original} leaves {idle} of {gpus} GPUs "
            f"({idle / gpus:.1%}) idle; {advice}")


# -- planning ---------------------------------------------------------------------------------

def _problem(facts: ScriptFacts, request: PlanRequest) -> _Problem:
    memory = None
    if request.gpu_memory_gb is not None:
        memory = (request.gpu_memory_gb - RESERVE_GIB) * GIB
    nodes = [gpus for gpus in request.node_gpus if gpus]
    node_size = max(nodes) if len(nodes) > 1 else None
    return _Problem(facts, request, request.hardware, _capacity_function(request.node_gpus),
                    node_size, cache(lambda tp: facts.shape.padded_vocab_size(tp, ASSUMED_VOCAB_SIZE)),
                    memory)


def _calibrate(problem: _Problem, batches: _Batches) -> _Problem:
    measured = problem.request.measured_step_s
    if measured is None:
        return problem
    original = _original_candidate(replace(problem, memory_limit=None), batches)
    if original is None:
        raise ValueError(f"--measured-step-s {measured:g} is a step of the command's "
                         f"{problem.facts.original.describe()}, which Megatron would not run on "
                         f"--original-gpus {problem.request.original_world_size}: give the GPU "
                         "count that step was measured on")
    return replace(problem, hardware=calibrated(problem.hardware, original.step, measured))


def _warnings(facts: ScriptFacts, request: PlanRequest, args: Sequence[str]) -> list[str]:
    warnings = list(facts.warnings)
    if request.gpu_memory_gb is not None:
        warnings += memory_warnings(args)
        if facts.shape.vocab_size is None:  # a tokenizer file: 128256 tokens cost GiBs more
            warnings.append(f"the vocabulary size is not known from the command (a tokenizer "
                            f"file): the memory estimate assumes {ASSUMED_VOCAB_SIZE} tokens; give "
                            "--vocab-size for the tokenizer's own")
    if facts.step_schedule is not None and request.global_batch_tolerance_pct:
        warnings.append("--global-batch-tolerance is not applied with --step-batch-size-schedule")
    if facts.phase_transitions and request.global_batch_tolerance_pct:
        warnings.append("--global-batch-tolerance is not applied with --phase-transition-iterations "
                        "(Megatron-LM then loads only a checkpoint of the same global batch)")
    return warnings


def plan_nodes(command: Sequence[str], node_gpus: Sequence[int], *, mode: str = "closest",
               gpu_memory_gb: float | None = None, original_world_size: int | None = None,
               global_batch_tolerance_pct: float = 0.0, consumed_samples: int | None = None,
               measured_step_s: float | None = None, hardware: Hardware | None = None) -> Plan:
    """Plan a relaunch of ``command`` (``[SCRIPT, *args]``) on nodes with ``node_gpus``
    schedulable GPUs each, in node-rank order. See the module docstring for the rules.

    Raises ValueError for bad arguments (one line), PlanError when nothing fits.
    """
    if not command:
        raise ValueError("the training command is empty: give SCRIPT and its arguments")
    request = PlanRequest(tuple(node_gpus), mode, gpu_memory_gb, original_world_size,
                          global_batch_tolerance_pct, consumed_samples, measured_step_s,
                          hardware or Hardware())
    script, *args = command
    facts = read_script_args(args, original_world_size, consumed_samples=consumed_samples)
    batches = _batches(facts, request, global_batch_tolerance_pct)
    problem = _calibrate(_problem(facts, request), batches)
    original = _original_candidate(problem, batches)
    warnings = _warnings(facts, request, args)
    if _is_hot_spare(problem, original):
        chosen, reason = original, HOT_SPARE
    else:
        candidates = _search(problem, batches)
        if not candidates:
            raise PlanError(_no_layout_message(problem, batches))
        chosen, reason = _choose(problem, candidates)
        idle = _idle_warning(problem, chosen, batches)
        warnings += [idle] if idle else []
    return _plan(problem, batches, script, args, chosen, original, reason, tuple(warnings))


def _unchecked_memory_warning(problem: _Problem, chosen: _Candidate,
                              original: _Candidate | None, batches: _Batches) -> str | None:
    """Without a memory size, say so when the plan needs much more memory than the original
    layout (which ran, so fits). With the original GPU count unknown, the original layout at
    DP 1 (its most memory per GPU) is the yardstick."""
    if problem.memory_limit is not None:
        return None
    yardstick = original or _original_candidate(
        problem, batches, problem.facts.original.model_parallel_size)
    if yardstick is None:
        return (f"memory is not checked: the estimate is {chosen.memory_bytes / GIB:.1f} GiB "
                "per GPU; give --gpu-memory-gb")
    growth = chosen.memory_bytes - yardstick.memory_bytes
    if growth <= yardstick.memory_bytes * UNCHECKED_MEMORY_GROWTH or growth <= GIB:
        return None
    return (f"memory is not checked: the estimate is {chosen.memory_bytes / GIB:.1f} GiB per GPU, "
            f"{chosen.memory_bytes / yardstick.memory_bytes:.1f}x the original layout's "
            f"{yardstick.memory_bytes / GIB:.1f} GiB; give --gpu-memory-gb")


def _rounded(value: float, digits: int) -> float:
    """``round(value, digits)``, but a positive value too small for ``digits`` keeps two
    significant digits: a tiny model's step (under 0.5 us) or memory (under 5 MiB) read as
    0, no time or memory at all."""
    rounded = round(value, digits)
    return rounded if rounded or value <= 0 else float(f"{value:.2g}")


def _samples_per_step(layout: Layout) -> int:
    return layout.micro_batch_size * layout.data_parallel_size


def _original_samples_per_step(problem: _Problem) -> int | None:
    """Micro-batch x DP of the command's layout; None when its GPU count is not known."""
    original, world = problem.facts.original, problem.request.original_world_size
    if world is None:
        return None
    return original.micro_batch_size * (world // original.model_parallel_size)


def _plan(problem: _Problem, batches: _Batches, script: str, args: Sequence[str],
          chosen: _Candidate, original: _Candidate | None, reason: str,
          warnings: tuple[str, ...]) -> Plan:
    layout = chosen.layout
    unchecked = _unchecked_memory_warning(problem, chosen, original, batches)
    warnings += (unchecked,) if unchecked else ()
    world = layout.num_gpus
    rewritten = rewrite_argv(args, layout,
                             original_global_batch=problem.facts.original.global_batch_size,
                             batch_may_change=batches.low != batches.high)
    rewritten, instances = set_optimizer_instances(
        rewritten, optimizer_instances_for(chosen.split, problem.facts.rules, layout.data_parallel_size))
    warnings += (instances,) if instances else ()
    rewritten, kept_schedule = keep_checkpoint_lr_schedule(
        rewritten, _samples_per_step(layout) == _original_samples_per_step(problem))
    warnings += (kept_schedule,) if kept_schedule else ()
    vpp = layout.virtual_pipeline_size
    return Plan(
        layout.tensor_model_parallel_size, layout.pipeline_model_parallel_size,
        layout.data_parallel_size, layout.micro_batch_size, layout.global_batch_size,
        num_gpus_used=world, command=(script, *rewritten),
        context_parallel_size=layout.context_parallel_size,
        expert_model_parallel_size=layout.expert_model_parallel_size,
        virtual_pipeline_model_parallel_size=vpp if vpp > 1 else None,
        ranks_per_node=assign_ranks(problem.request.node_gpus, layout.tensor_model_parallel_size,
                                    world),
        idle_gpus=sum(problem.request.node_gpus) - world,
        original_global_batch_size=problem.facts.original.global_batch_size,
        estimated_step_seconds=_rounded(chosen.step.seconds, 6),
        throughput_vs_original=(None if original is None
                                else round(chosen.throughput / original.throughput, 4)),
        estimated_memory_gib=_rounded(chosen.memory_bytes / GIB, 2),
        reason=reason, warnings=warnings)


def plan_layout(command: Sequence[str], gpus_available: int,
                gpus_per_node: int | None = None, **options) -> Plan:
    """``plan_nodes`` for ``gpus_available`` GPUs in nodes of ``gpus_per_node`` (None: one
    node); the keyword options are ``plan_nodes``'s."""
    return plan_nodes(command, uniform_nodes(gpus_available, gpus_per_node), **options)
