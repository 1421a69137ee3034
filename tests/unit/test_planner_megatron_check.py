"""The "46-case" check: plans for real model shapes pass an independent re-implementation of
Megatron-LM's rules, and no plan is smaller than the best valid layout.

``megatron_problems`` below is written from Megatron-LM's source (NVIDIA/Megatron-LM main,
commit d98e8a6, August 2026), not from the planner: it parses the rewritten command on its
own and applies, in Megatron's order, ``megatron/training/arguments.py validate_args``,
``megatron/core/transformer/transformer_config.py TransformerConfig.__post_init__``,
``megatron/core/parallel_state.py initialize_model_parallel``, the model-build divisions
(``tensor_parallel/layers.py`` Column/RowParallelLinear ``divide``,
``transformer_block.get_num_layers_to_build``, ``tensor_parallel/mappings.py
_split_along_first_dim``), ``num_microbatches_calculator`` and
``pipeline_parallel/schedules.py forward_backward_pipelining_with_interleaving``.

Model shapes are the published configs of Llama-2 7B/13B/70B, Llama-3 8B/70B/405B, Qwen2
7B/72B, GPT-3 175B, StarCoder (MQA), ChatGLM2-6B (2 query groups), Gemma-7B (--kv-channels)
and Mixtral 8x7B (MoE).
"""

from __future__ import annotations

import itertools
import re

import pytest

from ftmaster.recovery.planner import THROUGHPUT_TIE, plan_nodes

STORE_TRUE = {"--swiglu", "--group-query-attention", "--sequence-parallel",
              "--untie-embeddings-and-output-weights", "--disable-bias-linear",
              "--use-distributed-optimizer", "--bf16", "--account-for-embedding-in-pipeline-split",
              "--account-for-loss-in-pipeline-split", "--no-overlap-p2p-communication",
              "--overlap-grad-reduce", "--overlap-moe-expert-parallel-comm",
              "--use-checkpoint-opt-param-scheduler", "--override-opt-param-scheduler"}


# -- an independent reading of the command ---------------------------------------------------

def parse(argv: list[str]) -> dict[str, str | bool]:
    """argparse-like: ``--flag value``, ``--flag=value``, store_true flags; the last wins."""
    flags, index = {}, 0
    while index < len(argv):
        token = argv[index]
        if "=" in token:
            key, value = token.split("=", 1)
            flags[key] = value
        elif token in STORE_TRUE:
            flags[token] = True
        elif token.startswith("--"):
            flags[token] = argv[index + 1]
            index += 1
        index += 1
    return flags


def number(flags, name, default=None):
    value = flags.get(name)
    return default if value is None else int(value)


def tokens(text: str) -> int:
    """StepBatchsizeNumMicroBatchesCalculator._parse_numeric_value: K, M, B, T suffixes."""
    scale = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}.get(text[-1].upper(), 1)
    return int(float(text[:-1] if scale > 1 else text) * scale)


def expand_layout(text: str) -> list[str]:
    text = text.replace(",", "")
    text = re.sub(r"\(([^)]+)\)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    text = re.sub(r"(.)\*(\d+)", lambda m: m.group(1) * int(m.group(2)), text)
    return text.split("|")


def megatron_problems(argv: list[str], world: int, ranks_per_node=None,
                      consumed_samples: int = 0) -> list[str]:
    """What Megatron-LM would refuse about ``argv`` on ``world`` ranks (empty: it runs)."""
    f = parse(argv)
    problems = []
    tp, pp, cp = number(f, "--tensor-model-parallel-size", 1), number(f, "--pipeline-model-parallel-size", 1), number(f, "--context-parallel-size", 1)
    ep = number(f, "--expert-model-parallel-size", 1)
    etp = number(f, "--expert-tensor-parallel-size", tp)
    layers, hidden, heads = number(f, "--num-layers"), number(f, "--hidden-size"), number(f, "--num-attention-heads")
    groups = number(f, "--num-query-groups") if f.get("--group-query-attention") else heads
    seq, mbs = number(f, "--seq-length"), number(f, "--micro-batch-size")
    experts = number(f, "--num-experts")
    # validate_args: world and DP.
    if world % (tp * pp * cp):
        return [f"world {world} % TP*PP*CP {tp * pp * cp}"]
    dp = world // (tp * pp * cp)
    schedule = f.get("--step-batch-size-schedule")
    if schedule and "--global-batch-size" in f:
        problems.append("both --step-batch-size-schedule and --global-batch-size")
    gbs = number(f, "--global-batch-size", mbs * dp)
    eval_gbs, eval_mbs = number(f, "--eval-global-batch-size", gbs), number(f, "--eval-micro-batch-size", mbs)
    if eval_gbs % (eval_mbs * dp):
        problems.append("eval_global_batch_size % (eval_micro_batch_size * DP)")
    # validate_args: virtual pipeline forms.
    n_form, v_form, layout = (number(f, "--num-layers-per-virtual-pipeline-stage"),
                              number(f, "--num-virtual-stages-per-pipeline-rank"),
                              f.get("--pipeline-model-parallel-layout"))
    first, last = number(f, "--decoder-first-pipeline-num-layers"), number(f, "--decoder-last-pipeline-num-layers")
    extra = bool(f.get("--account-for-embedding-in-pipeline-split")) + bool(f.get("--account-for-loss-in-pipeline-split"))
    if sum(x is not None for x in (n_form, v_form, layout)) > 1:
        problems.append("more than one VPP form")
    vpp = None
    if layout is not None:
        stages = expand_layout(layout)
        if len(stages) % pp:
            return problems + ["layout stages % PP"]
        vpp = len(stages) // pp
        if "".join(stages).count("t") != layers:
            problems.append("layout decoder layers != num_layers")
    elif n_form is not None:
        if first is not None or last is not None:
            problems.append("N-form VPP with uneven stages")
        if (layers + extra) % pp:
            return problems + ["(layers + embedding/loss) % PP (VPP)"]
        if (layers + extra) // pp % n_form:
            return problems + ["layers per stage % layers per virtual stage"]
        vpp = (layers + extra) // pp // n_form
    elif v_form is not None:
        vpp = v_form
    elif first is None and last is None and (layers + extra) % pp:
        return problems + ["(layers + embedding/loss) % PP"]
    vpp = None if vpp == 1 else vpp
    if vpp is not None:
        if pp <= 1 or (pp <= 2 and f.get("--no-overlap-p2p-communication")):
            problems.append("interleaving needs PP > 1 (> 2 without p2p overlap)")
    sp = bool(f.get("--sequence-parallel")) and tp > 1
    ffn = number(f, "--ffn-hidden-size") or (int((4 * hidden * 2 / 3) / 64) * 64 if f.get("--swiglu") else 4 * hidden)
    kv = number(f, "--kv-channels")
    if kv is None:
        if hidden % heads:
            problems.append("hidden % heads without --kv-channels")
        kv = hidden // heads
    if cp > 1 and seq % (2 * cp):
        problems.append("seq % (2*CP)")
    if ep > 1 and (not experts or experts % ep):
        problems.append("experts % EP")
    # TransformerConfig.__post_init__
    if heads % tp:
        problems.append("heads % TP")
    if groups % tp and tp % groups:
        problems.append("query groups neither a multiple nor a divisor of TP")
    if first is not None or last is not None:
        if extra:
            problems.append("uneven stages with account-for-*")
        rest_layers, rest_stages = layers - (first or 0) - (last or 0), pp - (first is not None) - (last is not None)
        if bool(rest_layers) != bool(rest_stages) or rest_stages < 0:
            return problems + ["uneven: middle layers vs middle stages"]
        if rest_stages and rest_layers % rest_stages:
            problems.append("uneven: middle layers % middle stages")
        if vpp:
            for count in (first, last, rest_layers // rest_stages if rest_stages else None):
                if count is not None and count % vpp:
                    problems.append("uneven stage layers % VPP")
    elif layout is None:  # transformer_block.get_num_layers_to_build
        if (layers + extra) % pp:
            problems.append("(layers + embedding/loss) % PP at model build")
        elif vpp and (layers + extra) // pp % vpp:
            problems.append("layers per rank % VPP")
    # parallel_state.initialize_model_parallel
    if world % (etp * ep * pp):
        problems.append("world % (ETP*EP*PP)")
    # model build
    if kv * (heads + 2 * groups) % tp:
        problems.append("QKV width % TP")
    if ffn % tp:
        problems.append("ffn % TP")
    if experts:
        moe_ffn = number(f, "--moe-ffn-hidden-size", ffn)
        if moe_ffn % etp:
            problems.append("moe ffn % ETP")
        if not f.get("--disable-bias-linear") and etp != 1:
            problems.append("MoE bias with ETP > 1")
    if sp and (seq // cp) % tp:
        problems.append("(seq/CP) % TP with sequence parallelism")
    if f.get("--overlap-moe-expert-parallel-comm") and (ep == 1 or pp > 1 and not vpp):
        problems.append("the expert a2a overlap needs EP > 1, and VPP at PP > 1")
    # num_microbatches_calculator
    batches = [gbs]
    if schedule:
        entries = sorted((tokens(t) // seq, tokens(b)) for t, b in (e.split(":") for e in schedule.split()))
        current = [b for t, b in entries if consumed_samples >= t][-1]
        batches = [current] + [b for t, b in entries if t > consumed_samples]
    for batch in batches:
        if batch % (mbs * dp):
            problems.append(f"global batch {batch} % (micro_batch * DP)")
    # forward_backward_pipelining_with_interleaving
    if vpp:
        group = number(f, "--microbatch-group-size-per-virtual-pipeline-stage", pp)
        for m in (*(batch // (mbs * dp) for batch in batches), eval_gbs // (eval_mbs * dp)):
            if not (pp <= group <= m) or 0 < m % group < pp:
                problems.append(f"interleaved schedule with {m} micro-batches")
    if ranks_per_node is not None:
        if sum(ranks_per_node) != world or any(r % tp for r in ranks_per_node):
            problems.append("ranks per node not multiples of TP summing to the world")
    return problems


# -- the cases ------------------------------------------------------------------------------

def command(*, layers, hidden, heads, ffn, seq, vocab, tp, pp, mbs, gbs, groups=None,
            swiglu=True, untied=True, extra=()):
    args = ["pretrain_gpt.py", "--num-layers", str(layers), "--hidden-size", str(hidden),
            "--num-attention-heads", str(heads), "--ffn-hidden-size", str(ffn),
            "--seq-length", str(seq), "--max-position-embeddings", str(seq),
            "--vocab-size", str(vocab), "--tensor-model-parallel-size", str(tp),
            "--pipeline-model-parallel-size", str(pp), "--micro-batch-size", str(mbs),
            "--bf16", "--use-distributed-optimizer", "--disable-bias-linear",
            "--position-embedding-type", "rope", "--train-iters", "1000"]
    if gbs is not None:
        args += ["--global-batch-size", str(gbs)]
    if groups is not None:
        args += ["--group-query-attention", "--num-query-groups", str(groups)]
    if swiglu:
        args.append("--swiglu")
    if untied:
        args.append("--untie-embeddings-and-output-weights")
    return args + list(extra)


LLAMA2_7B = dict(layers=32, hidden=4096, heads=32, ffn=11008, seq=4096, vocab=32000)
LLAMA2_13B = dict(layers=40, hidden=5120, heads=40, ffn=13824, seq=4096, vocab=32000)
LLAMA2_70B = dict(layers=80, hidden=8192, heads=64, groups=8, ffn=28672, seq=4096, vocab=32000)
LLAMA3_8B = dict(layers=32, hidden=4096, heads=32, groups=8, ffn=14336, seq=8192, vocab=128256)
LLAMA3_70B = dict(layers=80, hidden=8192, heads=64, groups=8, ffn=28672, seq=8192, vocab=128256)
LLAMA3_405B = dict(layers=126, hidden=16384, heads=128, groups=8, ffn=53248, seq=8192, vocab=128256)
QWEN2_7B = dict(layers=28, hidden=3584, heads=28, groups=4, ffn=18944, seq=4096, vocab=152064)
QWEN2_72B = dict(layers=80, hidden=8192, heads=64, groups=8, ffn=29568, seq=4096, vocab=152064)
GPT3_175B = dict(layers=96, hidden=12288, heads=96, ffn=49152, seq=2048, vocab=50257,
                 swiglu=False, untied=False)
STARCODER = dict(layers=40, hidden=6144, heads=48, groups=1, ffn=24576, seq=8192, vocab=49152,
                 swiglu=False, untied=False)
CHATGLM2_6B = dict(layers=28, hidden=4096, heads=32, groups=2, ffn=13696, seq=4096, vocab=65024)
GEMMA_7B = dict(layers=28, hidden=3072, heads=16, ffn=24576, seq=8192, vocab=256000,
                extra=("--kv-channels", "256"))
MIXTRAL_8X7B = dict(layers=32, hidden=4096, heads=32, groups=8, ffn=14336, seq=4096,
                    vocab=32000, extra=("--num-experts", "8", "--moe-router-topk", "2",
                                        "--expert-model-parallel-size", "8",
                                        "--sequence-parallel"))


def case(shape, *, tp, pp, mbs, gbs, nodes, world, extra=(), tolerance=0.0, consumed=None):
    shape = dict(shape)
    more = tuple(shape.pop("extra", ())) + tuple(extra)
    return dict(argv=command(**shape, tp=tp, pp=pp, mbs=mbs, gbs=gbs, extra=more),
                nodes=nodes, world=world, tolerance=tolerance, consumed=consumed)


SP = ("--sequence-parallel",)
CASES = {
    "llama2-7b-8-to-7": case(LLAMA2_7B, tp=1, pp=1, mbs=1, gbs=128, nodes=(7,), world=8),
    "llama2-7b-tp2-16-to-15": case(LLAMA2_7B, tp=2, pp=1, mbs=2, gbs=256, nodes=(8, 7), world=16, extra=SP),
    "llama2-13b-vpp10-16-to-14": case(LLAMA2_13B, tp=1, pp=4, mbs=1, gbs=128, nodes=(8, 6), world=16,
                                      extra=("--num-layers-per-virtual-pipeline-stage", "1")),
    "llama2-13b-vpp-v-form": case(LLAMA2_13B, tp=2, pp=4, mbs=1, gbs=128, nodes=(8, 8, 8), world=32,
                                  extra=("--num-virtual-stages-per-pipeline-rank", "5", *SP)),
    "llama2-70b-tp4-pp4-vp20": case(LLAMA2_70B, tp=4, pp=4, mbs=1, gbs=128, nodes=(8,) * 7 + (5,), world=64,
                                    extra=("--num-layers-per-virtual-pipeline-stage", "1", *SP)),
    "llama3-8b-cp2-8-to-6": case(LLAMA3_8B, tp=1, pp=1, mbs=1, gbs=128, nodes=(6,), world=8,
                                 extra=("--context-parallel-size", "2")),
    "llama3-8b-eval-batches": case(LLAMA3_8B, tp=2, pp=2, mbs=2, gbs=96, nodes=(8, 4), world=16,
                                   extra=("--eval-micro-batch-size", "4", "--eval-global-batch-size", "64", *SP)),
    "llama3-8b-step-schedule": case(LLAMA3_8B, tp=2, pp=1, mbs=1, gbs=None, nodes=(8, 8, 5), world=24,
                                    extra=("--step-batch-size-schedule", "0:96 100M:192", *SP), consumed=0),
    "llama3-70b-tp4-pp4-cp2-vp5": case(LLAMA3_70B, tp=4, pp=4, mbs=1, gbs=128, nodes=(8,) * 7 + (7,), world=64,
                                       extra=("--context-parallel-size", "2", "--num-layers-per-virtual-pipeline-stage", "5", *SP)),
    "llama3-70b-tp8-pp8-1-node-lost": case(LLAMA3_70B, tp=8, pp=8, mbs=1, gbs=2048, nodes=(8,) * 2047, world=16384, extra=SP),
    "llama3-70b-tolerance-1": case(LLAMA3_70B, tp=8, pp=8, mbs=1, gbs=2048, nodes=(8,) * 2047, world=16384, extra=SP, tolerance=1.0),
    "llama3-70b-embedding-loss-in-split": case(LLAMA3_70B, tp=8, pp=2, mbs=1, gbs=64, nodes=(8,) * 15, world=128,
                                               extra=("--account-for-embedding-in-pipeline-split", "--account-for-loss-in-pipeline-split", *SP)),
    "llama3-405b-uneven-stages": case(LLAMA3_405B, tp=8, pp=16, mbs=1, gbs=512, nodes=(8,) * 127 + (3,), world=1024,
                                      extra=("--decoder-first-pipeline-num-layers", "7", "--decoder-last-pipeline-num-layers", "7", *SP)),
    "llama3-405b-uneven-vpp": case(LLAMA3_405B, tp=8, pp=8, mbs=1, gbs=256, nodes=(8,) * 63 + (4,), world=512,
                                   extra=("--decoder-first-pipeline-num-layers", "12", "--decoder-last-pipeline-num-layers", "18",
                                          "--num-virtual-stages-per-pipeline-rank", "2", *SP)),
    "llama3-405b-layout": case(LLAMA3_405B, tp=8, pp=4, mbs=1, gbs=64, nodes=(8,) * 31 + (6,), world=256,
                               extra=("--pipeline-model-parallel-layout", "Et*15|(t*16|)*6t*15L", *SP)),
    "qwen2-7b-28-heads": case(QWEN2_7B, tp=4, pp=1, mbs=1, gbs=64, nodes=(8, 8, 6), world=32),
    "qwen2-72b-tp8": case(QWEN2_72B, tp=8, pp=4, mbs=1, gbs=256, nodes=(8,) * 30, world=256, extra=SP),
    "gpt3-175b-1024-to-1016": case(GPT3_175B, tp=8, pp=8, mbs=1, gbs=1536, nodes=(8,) * 127, world=1024),
    "gpt3-175b-no-p2p-overlap-vpp": case(GPT3_175B, tp=8, pp=8, mbs=1, gbs=512, nodes=(8,) * 60, world=512,
                                         extra=("--num-layers-per-virtual-pipeline-stage", "6", "--no-overlap-p2p-communication")),
    "starcoder-mqa": case(STARCODER, tp=4, pp=1, mbs=1, gbs=64, nodes=(8, 8, 7), world=32),
    "starcoder-mqa-sp": case(STARCODER, tp=8, pp=2, mbs=1, gbs=96, nodes=(8,) * 5, world=48, extra=SP),
    "chatglm2-2-groups": case(CHATGLM2_6B, tp=2, pp=1, mbs=2, gbs=64, nodes=(8, 7), world=16),
    "gemma-7b-kv-channels": case(GEMMA_7B, tp=4, pp=1, mbs=1, gbs=64, nodes=(8, 8, 5), world=32, extra=SP),
    "mixtral-8x7b-ep8": case(MIXTRAL_8X7B, tp=2, pp=4, mbs=1, gbs=256, nodes=(8,) * 7 + (6,), world=64),
    "mixtral-8x7b-etp1": case(MIXTRAL_8X7B, tp=4, pp=2, mbs=1, gbs=128, nodes=(8,) * 3 + (2,), world=32,
                              extra=("--expert-tensor-parallel-size", "1")),
}


def plan_case(spec, **options):
    return plan_nodes(spec["argv"], spec["nodes"], original_world_size=spec["world"],
                      global_batch_tolerance_pct=spec["tolerance"],
                      consumed_samples=spec["consumed"], **options)


@pytest.mark.parametrize("name", CASES)
def test_every_plan_passes_megatron_lms_rules(name):
    spec = CASES[name]
    for mode in ("closest", "paper"):
        plan = plan_case(spec, mode=mode)
        assert megatron_problems(list(plan.command[1:]), plan.num_gpus_used, plan.ranks_per_node,
                                 spec["consumed"] or 0) == [], (mode, plan)
        assert plan.num_gpus_used <= sum(spec["nodes"])


def test_the_original_commands_are_valid_megatron_commands():
    for name, spec in CASES.items():
        assert megatron_problems(spec["argv"][1:], spec["world"], consumed_samples=0) == [], name


# -- the best valid layout, by brute force ---------------------------------------------------

def _rewritten(argv, tp, pp, cp, ep, mbs, vpp_flag, eval_mbs):
    """An independent rewrite for the brute force: set the layout flags, drop uneven stages
    at PP 1, and set the VPP flag to ``vpp_flag`` (None: keep)."""
    flags = parse(argv)
    out, index = [], 0
    names = {"--tensor-model-parallel-size": tp, "--pipeline-model-parallel-size": pp,
             "--micro-batch-size": mbs}
    while index < len(argv):
        token = argv[index]
        if token in names:
            out += [token, str(names.pop(token))]
            index += 2
            continue
        if pp == 1 and token in ("--decoder-first-pipeline-num-layers", "--decoder-last-pipeline-num-layers"):
            index += 2
            continue
        out.append(token)
        index += 1
    for name, value in (("--context-parallel-size", cp), ("--expert-model-parallel-size", ep)):
        if value != 1 or name in flags:
            out += [name, str(value)]
    if vpp_flag is not None:
        out += list(vpp_flag)
    if eval_mbs is not None:
        out += ["--eval-micro-batch-size", str(eval_mbs)]
    return out


def _vpp_flag_options(flags, pp, layers):
    if "--num-layers-per-virtual-pipeline-stage" in flags:
        extra = bool(flags.get("--account-for-embedding-in-pipeline-split")) + bool(flags.get("--account-for-loss-in-pipeline-split"))
        per_rank = (layers + extra) // pp if (layers + extra) % pp == 0 else 1
        return [("--num-layers-per-virtual-pipeline-stage", str(n)) for n in range(1, per_rank + 1) if per_rank % n == 0]
    if "--num-virtual-stages-per-pipeline-rank" in flags:
        return [("--num-virtual-stages-per-pipeline-rank", str(v)) for v in range(1, 9)]
    return [None]


def most_gpus_megatron_accepts(spec) -> int:
    """The largest world any layout of this command reaches, by brute force over TP, PP, CP,
    EP, DP, the micro-batch, the VPP flag and the evaluation micro-batch."""
    argv, nodes = spec["argv"][1:], spec["nodes"]
    f = parse(argv)
    layers, heads = number(f, "--num-layers"), number(f, "--num-attention-heads")
    cp0, experts = number(f, "--context-parallel-size", 1), number(f, "--num-experts", 0)
    mbs0, gbs = number(f, "--micro-batch-size"), number(f, "--global-batch-size")
    eval_mbs0 = number(f, "--eval-micro-batch-size")
    batch_for_dp = gbs or 96  # the step-schedule case starts at 96
    best = 0
    for tp, pp, cp, ep in itertools.product(
            [t for t in range(1, heads + 1) if heads % t == 0], range(1, layers + 3),
            [c for c in range(1, cp0 + 1) if cp0 % c == 0],
            [e for e in range(1, (experts or 1) + 1) if (experts or 1) % e == 0]):
        capacity = sum(n // tp * tp for n in nodes)
        dps = [d for d in range(capacity // (tp * pp * cp), 0, -1) if batch_for_dp % d == 0]
        for dp in dps:
            world = tp * pp * cp * dp
            if world <= best:
                break
            if any(not megatron_problems(_rewritten(argv, tp, pp, cp, ep, mbs, vpp, e), world)
                   for mbs in range(1, mbs0 + 1) for vpp in _vpp_flag_options(f, pp, layers)
                   for e in ([None] if eval_mbs0 is None else range(1, eval_mbs0 + 1))):
                best = world
                break
    return best


BRUTE_FORCE_CASES = [name for name, spec in CASES.items()
                     if sum(spec["nodes"]) <= 1024 and spec["tolerance"] == 0]


@pytest.mark.parametrize("name", BRUTE_FORCE_CASES)
def test_no_plan_is_smaller_than_the_best_valid_layout(name):
    spec = CASES[name]
    best = most_gpus_megatron_accepts(spec)
    paper = plan_case(spec, mode="paper")
    closest = plan_case(spec)
    assert paper.num_gpus_used == best  # the search misses no valid layout
    if closest.num_gpus_used < best:  # fewer GPUs only when the cost model says faster
        def speed(plan):
            return plan.global_batch_size / plan.estimated_step_seconds
        assert speed(closest) >= speed(paper) * (1 - THROUGHPUT_TIE), (closest, paper)


def test_the_case_list_is_as_large_as_the_issues():
    scenarios = len(CASES) * 2  # each planned in both modes
    assert scenarios >= 46 and len(BRUTE_FORCE_CASES) >= 15
