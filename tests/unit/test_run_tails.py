import json

from helpers.run_tails import run_tails


def test_a_failed_runs_tails_name_each_file_and_leave_checkpoints_out(tmp_path):
    node = tmp_path / "run" / "node_0"
    (node / "logs").mkdir(parents=True)
    (tmp_path / "node0.out").write_text("".join(f"line {i}\n" for i in range(100)))
    (node / "logs" / "attempt_1.log").write_text("iteration 7 | loss 3.1\n")
    events = [{"event": "launch", "time": 100.0},
              {"event": "periodic_save", "time": 102.5, "iteration": 8, "tier": "memory", "bytes": 9}]
    (node / "events.jsonl").write_text("".join(json.dumps(e) + "\n" for e in events) + '{"torn\n')
    (tmp_path / "ckpt" / "iter_0000008").mkdir(parents=True)
    (tmp_path / "ckpt" / "iter_0000008" / "writer.log").write_text("not wanted\n")

    tails = run_tails(tmp_path)

    assert "--- node0.out" in tails and "line 99" in tails and "line 74" not in tails
    assert "--- run/node_0/logs/attempt_1.log" in tails and "loss 3.1" in tails
    assert "2.50 s periodic_save {'iteration': 8, 'tier': 'memory'}" in tails
    assert '(torn) {"torn' in tails
    assert "not wanted" not in tails


def test_tails_past_the_limit_are_cut(tmp_path):
    (tmp_path / "a.out").write_text("x" * 500 + "\n")
    assert run_tails(tmp_path, limit=100).endswith("\n(cut)")
    assert len(run_tails(tmp_path, limit=100)) == 100 + len("\n(cut)")
