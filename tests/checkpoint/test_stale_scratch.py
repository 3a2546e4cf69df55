"""Temporary folders of killed runs are removed by the next run (issue 34, class 5): a process SIGKILLed
inside ``atomic_dir`` (every ``--out``: ``data preprocess``, conversions, exports) or holding a
``.glm5-export-*`` scratch folder leaves it behind; the next ``scratch_dir`` with that prefix removes it,
and never a folder without the owner file, one whose owner still runs, or one of another host."""

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from glm5_mcore.checkpoint.atomic import OWNER, remove_stale, scratch_dir
from recipes.main import main as glm5

REPO = Path(__file__).resolve().parents[2]


def _killed_holding(code: str, parent: Path, prefix: str) -> Path:
    """Run ``code`` (which makes a scratch folder, then sleeps) in a child, SIGKILL it once the folder
    exists; returns that folder."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    proc = subprocess.Popen([sys.executable, "-c", code], env=env, start_new_session=True)
    try:
        deadline = time.time() + 120
        while not any((p / OWNER).is_file() for p in parent.glob(prefix + "*")) and time.time() < deadline:
            assert proc.poll() is None, "the child ended before making its folder"
            time.sleep(0.05)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait(timeout=30)
    assert proc.returncode == -signal.SIGKILL
    (left,) = [p for p in parent.glob(prefix + "*")]
    return left


def _rows(path):
    path.write_text("".join(json.dumps({"prompt": f"w{i} w{i + 1}", "response": f"w{i + 2}"}) + "\n" for i in range(8)))
    return path


@pytest.mark.slow
def test_a_killed_preprocess_temporary_is_removed_by_the_next_run(tiny_dir, tmp_path, capsys):
    """The issue's case: ``.OUT.tmp-*`` of a SIGKILLed run, then ``glm5 data preprocess`` to the same --out."""
    out = tmp_path / "idx"
    code = ("import time; from glm5_mcore.checkpoint.atomic import atomic_dir\n"
            f"with atomic_dir({str(out)!r}) as t:\n    (t / 'tokens.bin').write_bytes(b'x' * 4096); time.sleep(600)")
    left = _killed_holding(code, tmp_path, ".idx.tmp-")
    assert (left / "tokens.bin").is_file()
    src = _rows(tmp_path / "rows.jsonl")
    assert glm5(["data", "preprocess", "--input", str(src), "--out", str(out), "--hf-dir", tiny_dir,
                 "--no-progress"]) == 0
    assert not left.exists() and sorted(p.name for p in tmp_path.iterdir()) == ["idx", "rows.jsonl"]
    assert not (out / OWNER).exists()  # the owner file never reaches the output


@pytest.mark.slow
def test_a_killed_export_scratch_is_removed_and_live_or_foreign_ones_are_kept(tmp_path):
    code = ("import time; from glm5_mcore.checkpoint.atomic import scratch_dir\n"
            f"scratch_dir({str(tmp_path)!r}, '.glm5-export-'); time.sleep(600)")
    dead = _killed_holding(code, tmp_path, ".glm5-export-")
    mine = tmp_path / ".glm5-export-users-own"  # no owner file: not ours to judge
    mine.mkdir()
    live = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        held = tmp_path / ".glm5-export-live"
        held.mkdir()
        (held / OWNER).write_text(json.dumps({"pid": live.pid, "host": socket.gethostname()}))
        other_host = tmp_path / ".glm5-export-other"
        other_host.mkdir()
        (other_host / OWNER).write_text(json.dumps({"pid": 1 << 22, "host": socket.gethostname() + "-x"}))
        new = scratch_dir(tmp_path, ".glm5-export-")
        assert not dead.exists() and mine.is_dir() and held.is_dir() and other_host.is_dir() and new.is_dir()
        assert remove_stale(tmp_path, ".glm5-export-") == []  # our own live folder stays too
    finally:
        live.kill()
        live.wait()
    assert remove_stale(tmp_path, ".glm5-export-") == [held]  # its owner is gone now
