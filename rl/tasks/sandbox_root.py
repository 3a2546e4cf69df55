"""What a sandbox call sees (``rl.tasks.sandbox``): the bubblewrap command line of one call.

The call's root is bubblewrap's empty tmpfs, made read-only once set up, holding only:

- the interpreter and its standard library (``sysconfig``'s ``stdlib`` / ``platstdlib``; a
  ``site-packages`` inside it is covered by an empty read-only folder), bound read-only at their own paths;
- the shared libraries they load (``ldd`` of the interpreter and of every ``lib-dynload`` module, plus
  ``libgcc_s``, which glibc opens when a thread exits), each file bound read-only, and the top-level
  symlinks of a merged-/usr system (``/lib -> usr/lib``);
- its own ``/proc`` (the call's PID namespace: only its processes), a minimal ``/dev`` (null, zero, full,
  random, urandom, tty; read-only), and two writable tmpfs of ``disk_mb`` each: ``/tmp`` (the working
  folder, ``HOME`` and ``TMPDIR``) and ``/dev/shm``.

No other host path exists inside: no ``/etc``, ``/srv``, ``/run``, ``/home``, ``/root``, the project, the
data or the model. The call has new user, PID, network, mount, IPC, UTS and cgroup namespaces (bubblewrap's
``--unshare-all``): a network namespace of its own with only loopback, so no host address is reachable;
inside, the code runs as uid 1000 without capabilities and cannot make further user namespaces
(``--disable-userns``); ``--die-with-parent`` and the PID namespace end every process of the call with it.

The interpreter is this process's own, or — when the call runs as a uid of its own (root: see
``rl.tasks.sandbox``) and that interpreter sits where other users cannot reach (e.g. under ``/root``) — the
system's ``python3``. ``BOOT`` runs first inside: it says the sandbox started (``STARTED`` on stderr), sets the
per-process limits (``resource.setrlimit``) and runs the code read from stdin as ``python -`` would.
"""

from __future__ import annotations

import json
import os
import shutil
import stat
import subprocess
import sys
from functools import lru_cache

SANDBOX_UID = 1000
TOP_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")
EXTRA_LIBS = ("libgcc_s.so.1",)
"""Opened with dlopen (not in any ``DT_NEEDED``): glibc's ``pthread_exit`` unwinds through libgcc_s."""
STARTED = b"\0glm5-sandbox-started\0"
"""What ``BOOT`` writes to stderr before anything else (taken off again): the interpreter started inside."""
BOOT = """\
import os, sys, resource
os.write(2, b"\\0glm5-sandbox-started\\0")
for _k, _v in zip(("AS", "CPU", "FSIZE", "NOFILE", "NPROC", "CORE"), sys.argv[1].split(",")):
    _s, _h = (int(x) for x in _v.split(":"))
    resource.setrlimit(getattr(resource, "RLIMIT_" + _k), (_s, _h))
sys.argv[:] = ["-"]
def _hook(t, v, tb, _orig=sys.__excepthook__):
    if tb is not None and tb.tb_frame.f_code.co_filename == "<string>":  # this boot's frame: not the code's
        tb = tb.tb_next
        v = v.with_traceback(tb)
    _orig(t, v, tb)
sys.excepthook = _hook
del os, sys, resource, _k, _v, _s, _h, _hook
exec(compile(__import__("sys").stdin.buffer.read(), "<stdin>", "exec"))
"""
INFO = ("import json, sys, sysconfig; print(json.dumps([sysconfig.get_path('stdlib'), "
        "sysconfig.get_path('platstdlib'), '%d.%d.%d' % sys.version_info[:3]]))")


def others_can_run(path: str) -> bool:
    """Every folder above ``path`` and the file itself have the others' execute bit."""
    path = os.path.realpath(path)
    parts = [path]
    while parts[-1] != os.path.dirname(parts[-1]):
        parts.append(os.path.dirname(parts[-1]))
    return all(os.stat(p).st_mode & stat.S_IXOTH for p in parts)


@lru_cache(maxsize=None)
def sandbox_python(own_uid: bool) -> str:
    """This process's interpreter, or (``own_uid``: the call runs as another user, which cannot reach it)
    the system's ``python3``. A RuntimeError names what is missing."""
    if not own_uid or others_can_run(sys.executable):
        return os.path.realpath(sys.executable)
    found = shutil.which("python3", path="/usr/local/bin:/usr/bin:/bin")
    if found is None or not others_can_run(found):
        raise RuntimeError(f"no Python interpreter the sandbox's uid can run ({sys.executable} sits where other "
                           "users cannot reach it, and there is no system python3): install python3")
    return os.path.realpath(found)


def _ldd(files: list[str]) -> list[str]:
    """The shared libraries ``files`` load, as the loader finds them (paths, the loader included)."""
    out = subprocess.run(["ldd", *files], capture_output=True, text=True, timeout=60).stdout
    found = []
    for line in out.splitlines():
        line = line.strip()
        if "=>" in line:
            path = line.split("=>", 1)[1].split("(")[0].strip()
        elif line.startswith("/") and "(" in line:
            path = line.split("(")[0].strip()
        else:
            continue
        if path.startswith("/") and os.path.exists(path):
            found.append(path)
    return found


@lru_cache(maxsize=None)
def root_args(python: str) -> tuple[tuple[str, ...], str]:
    """(bubblewrap arguments binding ``python``, its standard library and libraries read-only, the
    interpreter's version)."""
    info = subprocess.run([python, "-I", "-c", INFO], capture_output=True, text=True, timeout=60)
    if info.returncode:
        raise RuntimeError(f"{python} -I failed: {info.stderr.strip()[-300:]}")
    stdlib, platstdlib, version = json.loads(info.stdout)
    lib_dirs = list(dict.fromkeys(os.path.realpath(d) for d in (stdlib, platstdlib) if os.path.isdir(d)))
    modules = [os.path.join(d, "lib-dynload", f) for d in lib_dirs if os.path.isdir(os.path.join(d, "lib-dynload"))
               for f in sorted(os.listdir(os.path.join(d, "lib-dynload"))) if f.endswith(".so")]
    libs = _ldd([python, *modules])
    for name in EXTRA_LIBS:
        for d in {os.path.dirname(p) for p in libs}:
            if os.path.exists(os.path.join(d, name)):
                libs.append(os.path.join(d, name))
                break
    args: list[str] = []
    for link in TOP_LINKS:
        if os.path.islink(link):
            args += ["--symlink", os.readlink(link), link]
    args += ["--ro-bind", python, python]
    for d in lib_dirs:
        args += ["--ro-bind", d, d]
        site = os.path.join(d, "site-packages")
        if os.path.isdir(site):  # a pyenv / conda interpreter keeps its packages inside: hidden
            args += ["--tmpfs", site, "--remount-ro", site]
    seen = set()
    for p in libs:
        dest = os.path.join(os.path.realpath(os.path.dirname(p)), os.path.basename(p))
        if dest not in seen and not any(dest.startswith(d + os.sep) for d in lib_dirs):
            seen.add(dest)
            args += ["--ro-bind", os.path.realpath(p), dest]
    return tuple(args), version


def bwrap_command(bwrap: str, python: str, rlimits: str, disk_mb: int) -> list[str]:
    """The call's command line from bubblewrap on: namespaces, the root of ``root_args``, ``/proc``,
    ``/dev``, the writable tmpfs, a clean environment, and ``BOOT`` with the per-process ``rlimits``
    (``"soft:hard,..."`` in ``BOOT``'s order)."""
    binds, _ = root_args(python)
    size = str(disk_mb * 1024 * 1024)
    env = {"PATH": "/usr/bin:/bin", "HOME": "/tmp", "TMPDIR": "/tmp", "LANG": "C.UTF-8",
           "PYTHONDONTWRITEBYTECODE": "1", "PYTHONUNBUFFERED": "1", "OMP_NUM_THREADS": "1"}
    return [bwrap, "--unshare-all", "--unshare-user", "--disable-userns", "--die-with-parent", "--new-session",
            "--uid", str(SANDBOX_UID), "--gid", str(SANDBOX_UID), "--hostname", "sandbox",
            *binds, "--proc", "/proc", "--dev", "/dev", "--size", size, "--tmpfs", "/dev/shm",
            "--remount-ro", "/dev", "--size", size, "--tmpfs", "/tmp", "--remount-ro", "/",
            "--chdir", "/tmp", "--clearenv", *[a for k, v in env.items() for a in ("--setenv", k, v)],
            "--", python, "-I", "-c", BOOT, rlimits]
