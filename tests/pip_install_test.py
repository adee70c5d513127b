#!/usr/bin/env python3
# SPDX-License-Identifier: Apache-2.0
"""`pip install --no-build-isolation .` of this checkout into a fresh virtual environment, as a
user without network does it, then, from that environment only: the package loads the
libweightbus packaged inside it, publishes and receives a version over disk:// bit for bit,
and its vllm.general_plugins entry point registers the "weightbus" engine with vLLM's
WeightTransferEngineFactory (weightbus.testing's stand-in where vLLM is not installed), which
then creates a WeightbusWeightTransferEngine.

Usage: pip_install_test.py BUILD_DIR SOURCE_DIR. The venv has --system-site-packages (torch and
numpy from the system); pip runs with --no-index (no network) and LIBWEIGHTBUS_BUILD_DIR=
BUILD_DIR, so the already built library is packaged (setup.py) instead of a fresh CMake build.
"""
import os
import subprocess
import sys
import tempfile
from pathlib import Path

# Runs inside the venv, from a directory outside the checkout, with no PYTHONPATH.
CHECK = r'''
import importlib.metadata as md
import os
import sys
from pathlib import Path

import numpy as np
import weightbus
import weightbus.vllm

venv = Path(sys.prefix).resolve()
package = Path(weightbus.__file__).resolve().parent
assert venv in package.parents, f"weightbus imported from {package}, not from the venv {venv}"
library = Path(weightbus.library_path).resolve()
assert library.parent == package, f"library {library} is not the one inside {package}"
packaged = [str(f) for f in md.files("weightbus") if f.name.startswith("libweightbus.so")]
assert packaged == ["weightbus/libweightbus.so.0"], packaged

# A publish/subscribe round trip over disk://.
channel = "disk://" + sys.argv[1] + "?fsync=false"
data = np.arange(12, dtype=np.float32).reshape(3, 4) * 0.5
with weightbus.Publisher(channel) as pub:
    pub.publish(7, {"w": data})
with weightbus.Subscriber(channel) as sub, sub.receive(7, timeout=30) as update:
    got = update.numpy("w")
    assert update.version == 7 and got.dtype == data.dtype and got.shape == data.shape
    assert got.tobytes() == data.tobytes(), (got, data)

# The entry point vLLM's load_general_plugins finds and calls.
points = [p for p in md.entry_points(group="vllm.general_plugins") if p.name == "weightbus"]
assert len(points) == 1, points
assert points[0].value == "weightbus.vllm:register_plugin", points[0].value
register = points[0].load()
assert register is weightbus.vllm.register_plugin
register()
register()  # vLLM may load plugins more than once per process
try:
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory
    from vllm.config.weight_transfer import WeightTransferConfig
except ImportError:
    from weightbus.testing.worker import WeightTransferConfig, WeightTransferEngineFactory
from weightbus.testing.worker import make_vllm_config
engine = WeightTransferEngineFactory.create_engine(
    WeightTransferConfig(backend="weightbus"), make_vllm_config(), None, None)
assert type(engine) is weightbus.vllm.WeightbusWeightTransferEngine, type(engine)
print("pip_install_test: weightbus", weightbus.__version__, "from", library)
'''


def run(command, **kwargs):
    shown = ["<CHECK>" if c is CHECK else str(c) for c in command]
    print("+", " ".join(shown), flush=True)
    return subprocess.run(command, check=True, **kwargs)


def main() -> int:
    build, source = Path(sys.argv[1]).resolve(), Path(sys.argv[2]).resolve()
    with tempfile.TemporaryDirectory(prefix="wb_pip_test.") as work:
        work = Path(work)
        venv = work / "venv"
        run([sys.executable, "-m", "venv", "--system-site-packages", str(venv)])
        python = venv / "bin" / "python"
        env = {k: v for k, v in os.environ.items()
               if k not in ("LIBWEIGHTBUS_PATH", "PYTHONPATH")}
        env.update(LIBWEIGHTBUS_BUILD_DIR=str(build), PIP_NO_INDEX="1",
                   PIP_DISABLE_PIP_VERSION_CHECK="1", PYTHONDONTWRITEBYTECODE="1")
        run([python, "-m", "pip", "install", "--no-build-isolation", "--no-deps", "--no-index",
             "--no-cache-dir", "-q", str(source)], env=env, cwd=work)
        run([python, "-c", CHECK, str(work / "channel")], env=env, cwd=work)
    print("pip_install_test: OK")
    return 0


if __name__ == "__main__":
    sys.exit(main())
