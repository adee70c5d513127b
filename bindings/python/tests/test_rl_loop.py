# SPDX-License-Identifier: Apache-2.0
"""examples/rl_loop.py, short: a trainer and two replica processes over disk://. Checks which
version produced each rollout, that every applied version was bit-exact, and that the reward
goes up; durations are reported, never asserted."""
import json
import subprocess
import sys

from conftest import REPO_ROOT, child_env

SCRIPT = REPO_ROOT / "examples" / "rl_loop.py"


def _run(tmp_path, *args):
    out = tmp_path / "rl.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--json", str(out), *args],
                          env=child_env(), capture_output=True, text=True, timeout=540)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "replica versions bit-exact" in proc.stdout
    return json.loads(out.read_text()), proc.stdout


def test_on_policy_loop_learns_and_every_version_is_bit_exact(tmp_path):
    steps = 8
    result, stdout = _run(tmp_path, "--steps", str(steps), "--max-lag", "0", "--lr", "1e-3")
    print(stdout)
    assert result["bit_exact"]
    rows = [r for r in result["steps"] if r["step"] > 0]
    assert [r["step"] for r in rows] == list(range(1, steps + 1))
    for row in rows:
        # max-lag 0: step s trains on rollouts that version s (its own weights) generated.
        assert row["rollout_versions"] == [row["step"], row["step"]]
        assert row["lags"] == [0, 0]
        assert row["version"] == row["step"] + 1
        assert all(c != "skip" for c in row["replica_ms"])
    # Each replica applied every version, in order, each one matching the trainer's bytes.
    for replica in (0, 1):
        applied = [m for m in result["applied"] if m["replica"] == replica]
        assert [m["version"] for m in applied] == list(range(1, steps + 2))
        for m in applied:
            assert m["digest"] == result["published_digest"][str(m["version"])]
    rewards = result["rewards"]
    assert sum(rewards[-3:]) / 3 > sum(rewards[:3]) / 3 + 0.1, rewards


def test_overlapped_loop_keeps_lag_within_bound(tmp_path):
    steps = 5
    result, _ = _run(tmp_path, "--steps", str(steps), "--max-lag", "1")
    assert result["bit_exact"]
    previous = 0
    for row in (r for r in result["steps"] if r["step"] > 0):
        assert all(0 <= lag <= 1 for lag in row["lags"]), row
        assert all(v == row["step"] - lag for v, lag in zip(row["rollout_versions"],
                                                             row["lags"]))
        assert min(row["rollout_versions"]) >= previous  # versions never go back
        previous = min(row["rollout_versions"])
    for m in result["applied"]:
        assert m["digest"] == result["published_digest"][str(m["version"])]
