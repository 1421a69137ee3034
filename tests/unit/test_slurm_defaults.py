"""ftmaster launch's defaults under SLURM: which environment gives which option, node lists
with and without scontrol, and explicit options winning. The environments are the ones SLURM
22.05.8 gave in tests/e2e/test_slurm.py's cluster."""

import shutil
import subprocess

import pytest

from ftmaster.launch import _with_store_host
from ftmaster.slurm import (SlurmDefaults, SlurmStepError, expand_nodelist, scontrol_hostnames,
                            slurm_defaults, with_explicit_options)

# srun -N2 --ntasks-per-node=1 inside sbatch -N2, as node n2 sees it.
STEP_ON_TWO_NODES = {
    "SLURM_JOB_ID": "6", "SLURM_JOBID": "6", "SLURM_JOB_NODELIST": "n[1-2]",
    "SLURM_NODELIST": "n[1-2]", "SLURM_JOB_NUM_NODES": "2", "SLURM_NNODES": "2",
    "SLURM_STEP_ID": "0", "SLURM_STEPID": "0", "SLURM_STEP_NODELIST": "n[1-2]",
    "SLURM_STEP_NUM_NODES": "2", "SLURM_STEP_NUM_TASKS": "2", "SLURM_NTASKS": "2",
    "SLURM_NODEID": "1", "SLURM_PROCID": "1", "SLURM_LOCALID": "0",
}
# srun -N1 -w n2 inside sbatch -N2: the step's node list and counts, not the job's.
STEP_ON_PART_OF_THE_JOB = {
    **STEP_ON_TWO_NODES, "SLURM_STEP_NODELIST": "n2", "SLURM_STEP_NUM_NODES": "1",
    "SLURM_NNODES": "1", "SLURM_STEP_NUM_TASKS": "1", "SLURM_NTASKS": "1", "SLURM_NODEID": "0",
}
# The batch script itself: no step variables.
BATCH_SCRIPT = {key: value for key, value in STEP_ON_TWO_NODES.items()
                if not key.startswith(("SLURM_STEP", "SLURM_NTASKS"))} | {"SLURM_NODEID": "0"}


def first_of(nodelist):
    return {"n[1-2]": ["n1", "n2"], "n2": ["n2"]}[nodelist]


@pytest.mark.parametrize("environ, expected", [
    ({}, SlurmDefaults()),
    ({"PATH": "/usr/bin"}, SlurmDefaults()),
    (STEP_ON_TWO_NODES, SlurmDefaults("6", 1, "n1:29400", "1:2", store_host=False)),
    (STEP_ON_PART_OF_THE_JOB, SlurmDefaults("6", 0, "n2:29400", None, store_host=True)),
    (BATCH_SCRIPT, SlurmDefaults("6", 0, "n1:29400", None)),
    ({**STEP_ON_TWO_NODES, "SLURM_RESTART_COUNT": "2"},
     SlurmDefaults("6-r2", 1, "n1:29400", "1:2", store_host=False)),
    ({**STEP_ON_TWO_NODES, "SLURM_RESTART_COUNT": "0"},
     SlurmDefaults("6", 1, "n1:29400", "1:2", store_host=False)),
])
def test_defaults_from_each_kind_of_slurm_environment(environ, expected):
    assert slurm_defaults(environ, first_of) == expected


def test_older_variable_names_are_read_too():
    environ = {"SLURM_JOBID": "9", "SLURM_STEPID": "0", "SLURM_NODELIST": "n[1-2]",
               "SLURM_NNODES": "2", "SLURM_NTASKS": "2", "SLURM_NODEID": "0"}
    assert slurm_defaults(environ, first_of) == SlurmDefaults("9", 0, "n1:29400", "1:2", store_host=True)


def test_the_step_node_list_is_expanded_not_the_jobs():
    asked = []
    slurm_defaults(STEP_ON_PART_OF_THE_JOB, lambda nodelist: asked.append(nodelist) or ["n2"])
    assert asked == ["n2"]


@pytest.mark.parametrize("change, field", [
    ({"SLURM_NODEID": "one"}, "node_rank"),
    ({"SLURM_NODEID": "-1"}, "node_rank"),
    ({"SLURM_STEP_NODELIST": "n[2-1]"}, "rdzv_endpoint"),
    ({"SLURM_STEP_NUM_NODES": "many", "SLURM_NNODES": "many"}, "nnodes"),
])
def test_a_value_slurm_gives_that_cannot_be_read_is_unknown(change, field):
    defaults = slurm_defaults({**STEP_ON_TWO_NODES, **change}, expand_nodelist)
    assert getattr(defaults, field) is None
    assert defaults.rdzv_id == "6"


@pytest.mark.parametrize("nodelist, hostnames, problem", [
    ("n[1-", expand_nodelist, "node list 'n[1-': unbalanced brackets"),
    ("n[1-2]", lambda nodelist: [], "node list 'n[1-2]' names no host"),
])
def test_a_node_list_that_gives_no_endpoint_says_why(nodelist, hostnames, problem):
    defaults = slurm_defaults({**STEP_ON_TWO_NODES, "SLURM_STEP_NODELIST": nodelist}, hostnames)
    assert defaults.rdzv_endpoint is None and defaults.nodelist_problem == problem


def test_the_largest_node_list_expands_and_a_larger_one_gives_no_endpoint():
    assert len(expand_nodelist("n[1-65536]")) == 65536
    environ = {**STEP_ON_TWO_NODES, "SLURM_STEP_NODELIST": "n[1-99999999999]"}
    assert slurm_defaults(environ, expand_nodelist).rdzv_endpoint is None


def test_a_node_list_that_expands_to_nothing_gives_no_endpoint():
    assert slurm_defaults(STEP_ON_TWO_NODES, lambda nodelist: []).rdzv_endpoint is None


def test_several_ftmasters_on_a_node_are_refused_in_one_line():
    environ = {**STEP_ON_TWO_NODES, "SLURM_STEP_NUM_TASKS": "4", "SLURM_NTASKS": "4"}
    with pytest.raises(SlurmStepError, match=r"^this SLURM step runs 4 tasks on 2 node\(s\); "
                       r"ftmaster needs one per node: srun --ntasks-per-node=1"):
        slurm_defaults(environ, first_of)


def test_explicit_options_win_and_each_replaced_slurm_value_is_told():
    slurm = SlurmDefaults("6", 1, "n1:29400", "1:2")
    chosen, notes = with_explicit_options(slurm, rdzv_id=None, node_rank=3,
                                          rdzv_endpoint="n1:29400", nnodes="2:2")
    assert chosen == SlurmDefaults("6", 3, "n1:29400", "2:2")
    assert notes == ("--node-rank 3 given: SLURM's 1 is not used",
                     "--nnodes 2:2 given: SLURM's 1:2 is not used")


def test_the_steps_first_node_alone_serves_the_store_unless_an_endpoint_is_given():
    """Left to torch, a node whose endpoint names itself and finds the port taken joins the
    store that holds it: on shared nodes, another job's (checked in torch 2.13's
    ``_create_tcp_store``: an ``is_host`` given is never dropped for a client)."""
    first = slurm_defaults({**STEP_ON_TWO_NODES, "SLURM_NODEID": "0"}, first_of)
    assert (first.store_host, slurm_defaults(STEP_ON_TWO_NODES, first_of).store_host) == (True, False)
    chosen, _ = with_explicit_options(first, rdzv_endpoint="n1:29511")
    assert chosen.store_host is None
    assert _with_store_host({}, {"store_host": True, "rdzv_backend": "c10d"}) == {"is_host": "1"}
    assert _with_store_host({}, {"store_host": False, "rdzv_backend": "c10d"}) == {"is_host": "0"}
    assert _with_store_host({"is_host": "1"}, {"store_host": False, "rdzv_backend": "c10d"}) == \
        {"is_host": "1"}
    assert _with_store_host({}, {"store_host": True, "rdzv_backend": "etcd-v2"}) == {}


def test_explicit_options_without_slurm_are_taken_as_they_are():
    chosen, notes = with_explicit_options(SlurmDefaults(), rdzv_endpoint="host:1234", node_rank=0)
    assert (chosen, notes) == (SlurmDefaults(None, 0, "host:1234", None), ())


def test_a_name_that_is_not_a_rendezvous_option_is_a_programming_error():
    with pytest.raises(TypeError):
        with_explicit_options(SlurmDefaults(), local_addr="10.0.0.1")


def test_a_negative_node_rank_is_refused():
    with pytest.raises(ValueError, match="--node-rank must be >= 0, got -1"):
        SlurmDefaults(node_rank=-1)


NODELISTS = [
    ("n1", ["n1"]),
    ("n[1-3,5]", ["n1", "n2", "n3", "n5"]),
    ("gpu-[01-04]", ["gpu-01", "gpu-02", "gpu-03", "gpu-04"]),
    ("a1,b2", ["a1", "b2"]),
    ("n[8-10]", ["n8", "n9", "n10"]),
    ("n[001-3]", ["n001", "n002", "n003"]),
    ("n[1-2],m", ["n1", "n2", "m"]),
    ("r[1-2]-n[1-2]", ["r1-n1", "r1-n2", "r2-n1", "r2-n2"]),
    ("dgx[7],dgx[09-10]", ["dgx7", "dgx09", "dgx10"]),
    ("a,,b", ["a", "b"]),
    ("node[01-03,07],gpu-a[1-2]", ["node01", "node02", "node03", "node07", "gpu-a1", "gpu-a2"]),
    ("n[1-2]-ib", ["n1-ib", "n2-ib"]),
    ("n[08-10]", ["n08", "n09", "n10"]),
]


@pytest.mark.parametrize("nodelist, hosts", NODELISTS)
def test_node_lists_expand_without_scontrol(nodelist, hosts):
    assert expand_nodelist(nodelist) == hosts


@pytest.mark.parametrize("nodelist, message", [
    ("", "names no host"),
    (",", "names no host"),
    ("n[1", "unbalanced brackets"),
    ("n1]", "unbalanced brackets"),
    ("n[[1]]", "unbalanced brackets"),
    ("n[]", "cannot read the range ''"),
    ("n[5-3]", "cannot read the range '5-3'"),
    ("n[1-4:2]", "cannot read the range '1-4:2'"),
    ("n[a-c]", "cannot read the range 'a-c'"),
    ("n[\u0663]", "cannot read the range"),  # a digit, but not one SLURM reads
    ("n[1-123456789012345678901]", "cannot read the range"),
    # SLURM expands at most 65536 hosts from a range; listing 10^11 took all the memory
    ("n[1-99999999999]", "names more than 65536 hosts"),
    ("n[0-65536]", "names more than 65536 hosts"),
    ("a[1-300]-b[1-300]", "names more than 65536 hosts"),
    ("n[1-60000],m[1-60000]", "names more than 65536 hosts"),
])
def test_node_lists_it_cannot_read_are_refused_rather_than_guessed(nodelist, message):
    with pytest.raises(ValueError, match=message):
        expand_nodelist(nodelist)


@pytest.mark.skipif(shutil.which("scontrol") is None, reason="scontrol is not installed")
@pytest.mark.parametrize("nodelist, hosts", NODELISTS)
def test_the_expansion_matches_scontrols(nodelist, hosts, tmp_path, monkeypatch):
    # scontrol reads a slurm.conf even to expand a host list; it needs no controller.
    (tmp_path / "slurm.conf").write_text("ClusterName=unit\nSlurmctldHost=localhost\n")
    monkeypatch.setenv("SLURM_CONF", str(tmp_path / "slurm.conf"))
    listed = subprocess.run(["scontrol", "show", "hostnames", nodelist], capture_output=True,
                            text=True, timeout=10, check=True).stdout.split()
    assert listed == hosts


def fake_scontrol(tmp_path, monkeypatch, body):
    (tmp_path / "scontrol").write_text(f"#!/bin/sh\n{body}\n")
    (tmp_path / "scontrol").chmod(0o755)
    monkeypatch.setenv("PATH", str(tmp_path))


@pytest.mark.parametrize("body", [
    None,  # not installed
    "exit 1",  # no slurm.conf, say
    f"exec {shutil.which('sleep')} 5",  # a wedged one (PATH holds only the fake)
])
def test_without_an_answer_from_scontrol_the_list_is_expanded_here(body, tmp_path, monkeypatch):
    if body is None:
        monkeypatch.setenv("PATH", str(tmp_path))
    else:
        fake_scontrol(tmp_path, monkeypatch, body)
    assert scontrol_hostnames("gpu-[01-02]", timeout_s=0.5) == ["gpu-01", "gpu-02"]


def test_scontrols_answer_is_used_when_there_is_one(tmp_path, monkeypatch):
    fake_scontrol(tmp_path, monkeypatch, 'test "$3" = "n[1-2]" && printf "n1\\nn2\\n"')
    assert scontrol_hostnames("n[1-2]") == ["n1", "n2"]


def test_a_list_scontrol_rejects_is_refused(tmp_path, monkeypatch):
    # scontrol prints nothing for an invalid list and still exits 0.
    fake_scontrol(tmp_path, monkeypatch, "exit 0")
    with pytest.raises(ValueError, match="scontrol cannot expand it"):
        scontrol_hostnames("rack1-[1-2]x")
