# SPDX-License-Identifier: Apache-2.0
"""The parity check fails when an API surface drifts: each test feeds api_parity.py a copy of a
header, of the mapping or of the Python package with one change and expects the exit status 1
and the line that names the change (CTest `api_parity_selftest`; the real tree is CTest
`api_parity` and `ctypes_layout`).

Environment (CTest sets these): LIBWEIGHTBUS_PATH, the library the package loads, and
WB_API_LAYOUT, the api_layout program built from weightbus.h.
"""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
ROOT = HERE.parents[1]
SCRIPT = HERE / "api_parity.py"
INCLUDE = ROOT / "include" / "weightbus"
CPP_HEADERS = ["weightbus.hpp", "manifest.hpp", "types.hpp"]


def run(*args, cpp=None, c=None, mapping=None, python_path=None):
    """Runs api_parity.py with the given replacements; returns (exit status, output)."""
    cmd = [sys.executable, str(SCRIPT), *args]
    for header in cpp or [INCLUDE / h for h in CPP_HEADERS]:
        cmd += ["--cpp-header", str(header)]
    if c:
        cmd += ["--c-header", str(c)]
    if mapping:
        cmd += ["--mapping", str(mapping)]
    if python_path:
        cmd += ["--python-path", str(python_path)]
    result = subprocess.run(cmd, capture_output=True, text=True, timeout=120,
                            env=dict(os.environ, PYTHONDONTWRITEBYTECODE="1"))
    return result.returncode, result.stdout + result.stderr


def edited(tmp_path, source: Path, old: str, new: str) -> Path:
    """A copy of `source` in tmp_path with the first `old` replaced by `new`."""
    text = source.read_text()
    assert old in text, f"{source.name} no longer contains {old!r}: update this test"
    out = tmp_path / source.name
    out.write_text(text.replace(old, new, 1))
    return out


def cpp_with(tmp_path, header, old, new):
    changed = edited(tmp_path, INCLUDE / header, old, new)
    return [changed if h == header else INCLUDE / h for h in CPP_HEADERS]


def package_with(tmp_path, module, old, new) -> Path:
    """A copy of the Python package with one edit in `module`."""
    root = tmp_path / "python"
    shutil.copytree(ROOT / "bindings" / "python" / "weightbus", root / "weightbus",
                    ignore=shutil.ignore_patterns("__pycache__"))
    target = root / "weightbus" / module
    text = target.read_text()
    assert old in text, f"{module} no longer contains {old!r}: update this test"
    target.write_text(text.replace(old, new, 1))
    return root


def layout_output() -> str:
    binary = os.environ.get("WB_API_LAYOUT")
    if not binary:
        pytest.fail("WB_API_LAYOUT (the api_layout program) is not set; CTest sets it")
    return subprocess.run([binary], check=True, capture_output=True, text=True).stdout


def test_the_tree_is_in_step():
    status, out = run("check")
    assert status == 0 and "api_parity check: OK" in out, out


# Each case: what is edited ("cpp:<header>", "c", "mapping" or "package:<module>"), the text
# replaced and its replacement, and a part of each line the check must print, one per line
# (empty: it must pass).
CASES = {
    "public C++ method without C counterpart": (
        "cpp:weightbus.hpp", "  void Cancel();\n",
        "  void Cancel();\n  absl::Status Flush(absl::Duration timeout);\n",
        ["C++ Publisher::Flush (absl::Status Flush(absl::Duration timeout)) has no C "
         "counterpart"]),
    "private members and deleted functions do not count": (
        "cpp:weightbus.hpp", " private:\n  explicit Publisher(std::unique_ptr<Impl> impl);\n",
        " private:\n  explicit Publisher(std::unique_ptr<Impl> impl);\n"
        "  absl::Status Flush();\n  int flushes_ = 0;\n"
        " public:\n  Publisher(Publisher&&) = delete;\n private:\n", []),
    "a new overload needs its own entry": (
        "cpp:weightbus.hpp", "  void Cancel();\n\n  // The version of the last Update",
        "  void Cancel();\n  absl::StatusOr<std::unique_ptr<Update>> Poll(\n"
        "      uint64_t min_version);\n\n  // The version of the last Update",
        ["C++ Subscriber::Poll/1", "C++ Subscriber::Poll/2",
         "mapping entry Subscriber::Poll names no public C++ function"]),
    "stats field without C counterpart": (
        "cpp:weightbus.hpp", "  absl::Duration encode;",
        "  absl::Duration queue;\n  absl::Duration encode;",
        ["C++ field PublishStats.queue (absl::Duration queue) has no C counterpart in the fields "
         "of wb_publish_stats_t"]),
    "a manifest field crosses in the JSON": (
        "cpp:manifest.hpp", "  Metadata metadata;\n",
        "  Metadata metadata;\n  int64_t received_unix_ns = 0;\n", []),
    "a new dtype needs a C enumerator": (
        "cpp:types.hpp", "  kF6E3M2,\n};", "  kF6E3M2,\n  kF8E3M4,\n};",
        ["C++ DType::kF8E3M4 has no enumerator in wb_dtype_t"]),
    "C function without Python counterpart": (
        "c", "WB_EXPORT wb_status_t wb_publisher_uri(",
        "WB_EXPORT wb_status_t wb_publisher_flush(wb_publisher_t* publisher,\n"
        "                                         int64_t timeout_ms);\n"
        "WB_EXPORT wb_status_t wb_publisher_uri(",
        ["C wb_publisher_flush has no ctypes declaration in weightbus._lib._SIGNATURES",
         "C wb_publisher_flush has no Python counterpart"]),
    "C struct field without ctypes field": (
        "c", "  uint64_t wire_bytes; /* bytes the transport carried",
        "  int64_t queue_ns;\n  uint64_t wire_bytes; /* bytes the transport carried",
        ["ctypes wb_publish_stats_t fields",
         "C field wb_publish_stats_t.queue_ns has no Python counterpart in PublishStats"]),
    "ctypes parameter of the wrong type": (
        "package:_lib.py",
        '"wb_publisher_wait_for_receivers": (_status, [c_void_p, c_uint64, c_int, c_int64]),',
        '"wb_publisher_wait_for_receivers": (_status, [c_void_p, c_uint64, c_int, c_int]),',
        ["ctypes wb_publisher_wait_for_receivers: parameter 3 (timeout_ms, int64_t) is c_int"]),
    "a Python stats field goes missing": (
        "package:_api.py", "    encode: float = 0.0", "    encoded: float = 0.0",
        ["C field wb_publish_stats_t.encode_ns has no Python counterpart in PublishStats"]),
    "a mapped Python counterpart must call the C function": (
        "mapping", 'wb_publisher_publish = "Publisher.publish"',
        'wb_publisher_publish = "Publisher.latest_version"',
        ["[c_to_python] wb_publisher_publish: Publisher.latest_version does not call "
         "wb_publisher_publish"]),
    "stale mapping entries": (
        "mapping", "[cpp_to_c]\n", '[cpp_to_c]\n"Publisher::Flush" = "wb_publisher_flush"\n',
        ["[cpp_to_c] Publisher::Flush names wb_publisher_flush, which weightbus.h does not "
         "declare", "mapping entry Publisher::Flush names no public C++ function or field"]),
}


@pytest.mark.parametrize("case", CASES)
def test_drift_fails_the_check(case, tmp_path):
    target, old, new, expected = CASES[case]
    kind, _, name = target.partition(":")
    replaced = {}
    if kind == "cpp":
        replaced["cpp"] = cpp_with(tmp_path, name, old, new)
    elif kind == "c":
        replaced["c"] = edited(tmp_path, INCLUDE / "weightbus.h", old, new)
    elif kind == "mapping":
        replaced["mapping"] = edited(tmp_path, HERE / "mapping.toml", old, new)
    else:
        replaced["python_path"] = package_with(tmp_path, name, old, new)
    status, out = run("check", **replaced)
    assert status == (1 if expected else 0), out
    problems = [line for line in out.splitlines() if line.startswith("api_parity: ")]
    assert len(problems) == len(expected), out  # the edit, and nothing else
    for line in expected:
        assert line in out, out


def test_the_ctypes_layout_matches_the_compiled_c():
    out_file = Path(os.environ.get("TMPDIR", "/tmp")) / f"api_layout.{os.getpid()}.txt"
    out_file.write_text(layout_output())
    try:
        status, out = run("check-layout", "--layout-output", str(out_file))
    finally:
        out_file.unlink()
    assert status == 0 and "api_parity check-layout: OK" in out, out


def test_a_size_or_offset_that_differs_fails(tmp_path):
    real = layout_output()
    lines = real.splitlines()
    size_line = next(l for l in lines if l.startswith("struct wb_publish_stats_t "))
    offset_line = next(l for l in lines if l.startswith("field wb_tensor_info_t has_shard "))
    _, _, size, align = size_line.split()
    _, struct, name, offset, fsize = offset_line.split()
    changed = real.replace(size_line, f"struct wb_publish_stats_t {int(size) + 8} {align}")
    changed = changed.replace(offset_line, f"field {struct} {name} {int(offset) + 4} {fsize}")
    saved = tmp_path / "layout.txt"
    saved.write_text(changed)
    status, out = run("check-layout", "--layout-output", str(saved))
    assert status == 1, out
    assert f"wb_publish_stats_t: C sizeof {int(size) + 8}" in out, out
    assert f"wb_tensor_info_t.has_shard: C offset {int(offset) + 4}" in out, out


def test_ctypes_fields_in_another_order_fail_the_layout(tmp_path):
    package = package_with(tmp_path, "_lib.py",
                           '("dtype", c_int), ("ndim", c_int),',
                           '("ndim", c_int), ("dtype", c_int),')
    saved = tmp_path / "layout.txt"
    saved.write_text(layout_output())
    status, out = run("check-layout", "--layout-output", str(saved), python_path=package)
    assert status == 1, out
    assert "wb_tensor_info_t.ndim: C offset" in out and "wb_tensor_info_t.dtype: C offset" in out
