"""The benchmarks run from a fresh clone as their docstrings give them: none imports the tests (a clone's
``bench/x.py`` finds ``glm5_mcore``, ``rl`` and ``recipes`` through the install, never ``tests``), and each
answers ``--help`` from a copy of the repository that has no ``tests/`` folder at all."""

import ast
import subprocess

import pytest

from tests.support.launch import REPO, child_env, copy_repo

BENCHES = sorted((REPO / "bench").glob("*.py"))


def test_no_bench_imports_the_tests():
    bad = []
    for f in BENCHES:
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{f.name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] == "tests"]
    assert len(BENCHES) >= 10 and bad == [], bad


@pytest.mark.slow
def test_every_bench_answers_help_from_a_checkout_without_the_tests(tmp_path):
    root = copy_repo(tmp_path / "glm5-mcore", skip=("tests/",))
    assert not (root / "tests").exists() and (root / "bench" / "dsa_attention.py").is_file()
    failed = {}
    for f in BENCHES:
        r = subprocess.run([str(root / ".venv" / "bin" / "python"), f"bench/{f.name}", "--help"], cwd=root,
                           env=child_env(PYTHONPATH=str(root)), capture_output=True, text=True, timeout=300)
        if r.returncode != 0 or "usage:" not in r.stdout:
            failed[f.name] = (r.returncode, r.stdout[-300:], r.stderr[-1500:])
    assert failed == {}, failed
