# SPDX-License-Identifier: Apache-2.0
"""Shared fixtures of the Python tests.

Environment (CTest sets these; the defaults suit a source checkout built in ./build):
  LIBWEIGHTBUS_PATH  the library under test (default: <repo>/build/lib/libweightbus.so)
  WB_TEST_CLI        the weightbus CLI (default: <repo>/build/tools/weightbus)
  WB_TEST_FIXTURES   ../shared/fixtures (stories260K.bin)
Names do not start with WEIGHTBUS_: that prefix is the library's settings (an unknown one is
logged as a warning naming the closest setting).
"""
import ctypes
import os
import select
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

PACKAGE_ROOT = Path(__file__).resolve().parents[1]        # bindings/python
REPO_ROOT = PACKAGE_ROOT.parents[1]
sys.path.insert(0, str(PACKAGE_ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))  # llama2c_reference


def cli_path() -> Path:
    return Path(os.environ.get("WB_TEST_CLI", REPO_ROOT / "build" / "tools" / "weightbus"))


def fixtures_dir() -> Path:
    return Path(os.environ.get("WB_TEST_FIXTURES", REPO_ROOT.parent / "shared" / "fixtures"))


_IN_CLOSE_WRITE, _IN_MOVED_TO, _IN_CREATE = 0x8, 0x80, 0x100  # <sys/inotify.h>
_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC


def fail_point_reached(pause_dir: Path, name: str, timeout: float = 30.0) -> bool:
    """Waits until the library's `pause:DIR` fail point `name` is reached, i.e. until it creates
    DIR/<name>.reached (lib/core/failpoint.h), up to `timeout` s; False on timeout. Woken by
    inotify on DIR (which must exist), not by polling: the watch is in place before the file is
    first looked for, so its creation cannot be missed. Release the paused thread by creating
    DIR/<name>.release."""
    reached = Path(pause_dir) / f"{name}.reached"
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.inotify_init1(_IN_NONBLOCK | _IN_CLOEXEC)
    if fd < 0:
        raise OSError(ctypes.get_errno(), "inotify_init1")
    try:
        if libc.inotify_add_watch(fd, os.fsencode(str(pause_dir)),
                                  _IN_CREATE | _IN_MOVED_TO | _IN_CLOSE_WRITE) < 0:
            raise OSError(ctypes.get_errno(), f"inotify_add_watch {pause_dir}")
        deadline = time.monotonic() + timeout
        while not reached.exists():
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if select.select([fd], [], [], left)[0]:
                try:
                    os.read(fd, 65536)  # the events themselves do not matter: look again
                except BlockingIOError:
                    pass
        return True
    finally:
        os.close(fd)


def child_env(**extra) -> dict:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(PACKAGE_ROOT), env.get("PYTHONPATH", "")])
    env.update(extra)
    return env


def readme_snippet(marker: str) -> str:
    """The first ```python block of README.md after the text `marker`."""
    readme = (REPO_ROOT / "README.md").read_text()
    start = readme.index("```python\n", readme.index(marker)) + len("```python\n")
    return readme[start:readme.index("```", start)]


def run_python(code: str, *args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    """Runs `code` in a fresh interpreter (a real process) and returns the finished process."""
    return subprocess.run([sys.executable, "-c", code, *args], env=child_env(),
                          capture_output=True, text=True, timeout=timeout)


def publish_as_group(channel: str, version: int, parts, shards=None, timeout: float = 30,
                     **options) -> None:
    """Publishes `version` from a publisher group of len(parts) ranks, rank r (a thread of its
    own, all at once) publishing parts[r] (name -> tensor) with shards[r] (name ->
    weightbus.Shard) when given; `options` are Publisher settings. Asserts that every rank's
    publish returned (the version committed)."""
    import weightbus
    world = len(parts)
    pubs = [weightbus.Publisher(channel, rank=r, world_size=world, **options)
            for r in range(world)]
    errors = []

    def publish(rank):
        try:
            pubs[rank].publish(version, parts[rank], timeout=timeout,
                               shards=None if shards is None else shards[rank])
        except Exception as e:  # reported by the assertion below
            errors.append(e)

    threads = [threading.Thread(target=publish, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    for pub in pubs:
        pub.close()
    assert errors == []


@pytest.fixture
def channel(tmp_path) -> str:
    return f"disk://{tmp_path}/channel?fsync=false"


@pytest.fixture(scope="session")
def stories_dir(tmp_path_factory) -> Path:
    """stories260K converted to a Hugging Face directory (f32) by the weightbus CLI."""
    checkpoint = fixtures_dir() / "stories260K.bin"
    if not checkpoint.exists():
        pytest.fail(f"fixture {checkpoint} is missing (set WB_TEST_FIXTURES)")
    out = tmp_path_factory.mktemp("stories260K")
    subprocess.run([str(cli_path()), "convert-llama2c", str(checkpoint), str(out), "--dtype",
                    "f32"], check=True, capture_output=True, timeout=120)
    return out


class SliceWatch:
    """Wraps the real library's `function` (default wb_subscriber_wait_then_receive, each slice
    of Subscriber.wait(); wb_publisher_wait_for_receivers for Publisher.wait_for_receivers) to
    record each slice's status and to signal once a slice came back with an error."""

    def __init__(self, monkeypatch, module=None, function="wb_subscriber_wait_then_receive"):
        if module is None:
            from weightbus import _api as module
        self.statuses = []
        self.not_yet = threading.Event()
        real_lib = module.lib
        real = getattr(real_lib, function)
        watch = self

        def watched(*args):
            status = real(*args)
            watch.statuses.append(status)
            if status != 0:
                watch.not_yet.set()
            return status

        class Lib:
            def __getattr__(self, name):
                return getattr(real_lib, name)

        proxy = Lib()
        setattr(proxy, function, watched)
        monkeypatch.setattr(module, "lib", proxy)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def ucx_publisher(**options):
    """A weightbus.Publisher on a free loopback ucx:// port (another process may take the port
    first: retried on "in use"), or skips the test when ucx:// is not built."""
    import weightbus
    if "ucx" not in weightbus.transports():
        pytest.skip("ucx:// is not built")
    for _ in range(20):
        try:
            return weightbus.Publisher(f"ucx://127.0.0.1:{_free_port()}/test", **options)
        except weightbus.FailedPreconditionError as e:
            if "in use" not in str(e):
                raise
    pytest.fail("no free loopback port in 20 tries")


def late_uri(transport, tmp_path) -> str:
    """A channel with no publisher yet: a disk directory that does not exist, or a ucx
    rendezvous on a free loopback port (skips the test when ucx:// is not built)."""
    if transport == "disk":
        return f"disk://{tmp_path}/late?fsync=false"  # the directory does not exist yet
    uri = f"ucx://127.0.0.1:{_free_port()}/late"
    import weightbus
    try:
        weightbus.Subscriber(uri).close()
    except weightbus.UnimplementedError as e:
        pytest.skip(f"ucx:// not built: {e}")
    return uri
