"""A TP2xPP2 checkpoint resumes under other layouts with the same losses and samples."""

import shutil

import pytest

from helpers.trainer import (
    RESUME_LAYOUTS,
    RESUME_SCHEDULE,
    SMALL_GPT,
    iterations,
    layout_args,
    run_trainer,
)

pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """Train at TP2xPP2 to iteration 6, saving at 3 and 6."""
    save = tmp_path_factory.mktemp("ckpt") / "save"
    result = run_trainer(4, SMALL_GPT + RESUME_SCHEDULE + layout_args(2, 2) + [
        "--save", str(save), "--save-interval", "3", "--exit-interval", "6"])
    assert result.returncode == 0, result.stdout[-3000:]
    assert (save / "latest_checkpointed_iteration.txt").read_text().strip() == "6"
    return save


@pytest.fixture(scope="module")
def resumed(saved):
    """Losses and consumed samples of iterations 7-12 for every layout."""
    runs = {}
    for name, (nproc, tp, pp) in RESUME_LAYOUTS.items():
        result = run_trainer(nproc, SMALL_GPT + RESUME_SCHEDULE + layout_args(tp, pp)
                             + ["--load", str(saved)])
        assert result.returncode == 0, f"{name}:\n{result.stdout[-3000:]}"
        runs[name] = (iterations(result.stdout), result.stdout)
    return runs


@pytest.mark.parametrize("name", ["tp1pp1", "tp1pp2", "tp1pp1dp3"])
def test_resharded_resume_matches_reference(resumed, name):
    reference, _ = resumed["tp2pp2"]
    logged, log = resumed[name]
    assert min(logged) == 7, f"{name} should log iteration 7 first, got {sorted(logged)}"
    assert sorted(logged) == list(range(7, 13))
    for it in range(7, 13):
        assert logged[it]["consumed"] == reference[it]["consumed"] == it * 12
        relative = abs(logged[it]["loss"] - reference[it]["loss"]) / reference[it]["loss"]
        assert relative < 0.02, f"{name} iteration {it}: {logged[it]} vs {reference[it]}"
    assert "loaded checkpoint from" in log and "bytes" in log


def test_reference_resume_starts_at_seven(resumed):
    reference, log = resumed["tp2pp2"]
    assert min(reference) == 7 and reference[7]["consumed"] == 84
    assert "RNG state not restored" not in log  # same layout: RNG restored too


def test_tolerance_discriminates_a_fresh_start(resumed, saved):
    """Without the checkpoint the loss at iteration 7 is far outside the 2% band."""
    reference, _ = resumed["tp2pp2"]
    fresh = iterations(run_trainer(1, SMALL_GPT + RESUME_SCHEDULE + layout_args(1, 1)).stdout)
    assert abs(fresh[1]["loss"] - reference[7]["loss"]) / reference[7]["loss"] > 0.1


def test_tolerance_discriminates_a_resume_without_optimizer_state(resumed, saved):
    """Adam's moments matter: a model-only resume leaves the 2% band within a few iterations."""
    reference, _ = resumed["tp2pp2"]
    bare = iterations(run_trainer(1, SMALL_GPT + RESUME_SCHEDULE + layout_args(1, 1)
                                  + ["--load", str(saved), "--no-load-optim"]).stdout)
    worst = max(abs(bare[it]["loss"] - reference[it]["loss"]) / reference[it]["loss"]
                for it in range(7, 13))
    assert worst > 0.02, worst


def test_truncated_newest_checkpoint_falls_back(saved, tmp_path):
    save = tmp_path / "save"
    shutil.copytree(saved, save)
    shard = max((save / "iter_0000006").glob("*.distcp"), key=lambda p: p.stat().st_size)
    with open(shard, "r+b") as handle:
        handle.truncate(shard.stat().st_size // 2)
    result = run_trainer(1, SMALL_GPT + RESUME_SCHEDULE + layout_args(1, 1) + ["--load", str(save),
                                                                       "--train-iters", "12"])
    assert result.returncode == 0, result.stdout[-3000:]
    assert (f"skipping checkpoint {save / 'iter_0000006'}: {shard.name} has "
            f"{shard.stat().st_size} bytes, the manifest says") in result.stdout
    logged = iterations(result.stdout)
    assert min(logged) == 4 and logged[4]["consumed"] == 48
