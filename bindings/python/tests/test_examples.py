# SPDX-License-Identifier: Apache-2.0
"""The framework examples (examples/verl_checkpoint_engine.py, trl_callback.py,
openrlhf_broadcast.py) run as a user runs them, each in a fresh interpreter: each checks every
tensor its replicas received bit for bit and exits 0 only then."""
import subprocess
import sys

import pytest

from conftest import REPO_ROOT, child_env


@pytest.mark.parametrize("example, ok", [
    ("verl_checkpoint_engine", "verl_checkpoint_engine: 3 steps, 2 rollout workers"),
    ("trl_callback", "trl_callback: 4 steps published and applied on 2 workers"),
    ("openrlhf_broadcast", "openrlhf_broadcast: 3 steps on 2 engines x 2 workers"),
])
def test_framework_example_runs(example, ok):
    done = subprocess.run([sys.executable, str(REPO_ROOT / "examples" / f"{example}.py")],
                          env=child_env(), capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout + done.stderr
    assert done.stdout.startswith(ok) and done.stdout.rstrip().endswith("OK"), done.stdout
