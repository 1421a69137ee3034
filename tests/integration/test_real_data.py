"""A text file goes through tools/preprocess_data.py into training, and the loss falls."""

import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from helpers.trainer import REPO, iterations, run_trainer

pytestmark = pytest.mark.slow


@pytest.fixture
def corpus(tmp_path):
    sentences = ["the quick brown fox jumps over the lazy dog.",
                 "pack my box with five dozen liquor jugs.",
                 "how vexingly quick daft zebras jump!"]
    text = tmp_path / "corpus.txt"
    text.write_text("\n\n".join(sentences[i % 3] * 3 for i in range(300)))
    result = subprocess.run(
        [sys.executable, str(REPO / "tools" / "preprocess_data.py"), "--input", str(text),
         "--output-prefix", str(tmp_path / "data" / "corpus")],
        capture_output=True, text=True, timeout=120)
    assert result.returncode == 0, result.stderr
    prefix = result.stdout.strip()
    assert prefix.endswith("corpus_text_document")
    return prefix


def test_loss_falls_on_a_repetitive_corpus(corpus, tmp_path):
    result = run_trainer(2, [
        "--pipeline-model-parallel-size", "2", "--num-layers", "2", "--hidden-size", "64",
        "--num-attention-heads", "4", "--seq-length", "64", "--micro-batch-size", "4",
        "--global-batch-size", "8", "--train-iters", "40", "--lr", "3e-3",
        "--lr-warmup-iters", "4", "--data-path", corpus, "--split", "98,2,0",
        "--tokenizer-type", "ByteLevelTokenizer", "--log-interval", "1", "--eval-iters", "2",
        "--eval-interval", "30", "--save", str(tmp_path / "save"), "--save-interval", "100"])
    assert result.returncode == 0, result.stdout[-3000:]
    losses = [entry["loss"] for _, entry in sorted(iterations(result.stdout).items())]
    assert len(losses) == 40
    first, last = sum(losses[:3]) / 3, sum(losses[-3:]) / 3
    assert last < 0.6 * first, f"loss {first:.3f} -> {last:.3f}"
    # at --eval-interval, and once more at the end, as Megatron-LM: a run shorter than
    # --eval-interval reported no validation loss; its line carries the perplexity too
    validations = re.findall(r"validation loss at iteration (\d+) \| lm loss value: (\S+) \| "
                             r"lm loss PPL: (\S+) \|", result.stdout)
    assert [int(it) for it, _, _ in validations] == [30, 40]
    assert all(float(ppl) == pytest.approx(math.exp(float(loss)), rel=1e-5)
               for _, loss, ppl in validations)
    # saved first, as Megatron-LM's pretrain: an evaluation that fails loses no training
    out = result.stdout
    assert out.index("saved final checkpoint at iteration 40") < \
        out.index("validation loss at iteration 40")


def test_a_corrupt_corpus_is_a_data_error_named_once_never_a_gpu(corpus, tmp_path):
    """Random bytes over the corpus: token ids beyond the vocabulary, which the embedding would
    meet as an index error; a truncated index: the dataset cannot be built. Both exit 79
    (ftmaster's cause ``data``: no relaunch on any GPU reads other bytes), in one line."""
    args = ["--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
            "--seq-length", "64", "--micro-batch-size", "4", "--global-batch-size", "8",
            "--train-iters", "4", "--lr", "3e-3", "--data-path", corpus,
            "--split", "100,0,0", "--tokenizer-type", "ByteLevelTokenizer", "--log-interval", "1",
            "--eval-iters", "0"]
    data = Path(corpus + ".bin")
    data.write_bytes(b"\xff" * data.stat().st_size)
    result = run_trainer(1, args)
    assert result.returncode != 0 and "exitcode  : 79" in result.stdout, result.stdout[-3000:]
    said = [line for line in result.stdout.splitlines() if line.startswith("error: ")]
    assert said == ["error: the training data holds token id 65535, outside the tokenizer's "
                    "vocabulary of 257: the corpus is corrupt, or was made with another tokenizer"]

    index = Path(corpus + ".idx")
    index.write_bytes(index.read_bytes()[:20])
    result = run_trainer(1, args)
    assert result.returncode != 0 and "exitcode  : 79" in result.stdout, result.stdout[-3000:]
    assert f"error: cannot read the training data {corpus}: " in result.stdout
