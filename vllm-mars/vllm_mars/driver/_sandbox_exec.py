"""Exec a tool command pinned to CPU cores inside a write sandbox (stdlib only; run with ``python -I``).

Usage: ``python -I _sandbox_exec.py --cpus 0,1 --workspace DIR --mode bwrap|landlock|none [--net]
-- CMD...``. It sets its CPU affinity (inherited by the command), then either execs bubblewrap
(read-only root, private /tmp, the workspace bound read-write, namespaces unshared) or applies a
Landlock ruleset (writes allowed only under the workspace and /dev) and execs the command.
Exit code 125 means the sandbox itself could not be set up (message on stderr).
"""

from __future__ import annotations

import ctypes
import os
import struct
import sys

# Landlock (Linux >= 5.13); the syscall numbers are the same on every architecture.
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH = 1
_PR_SET_NO_NEW_PRIVS = 38
# Write-side filesystem rights of ABI 1 (read access stays unrestricted).
_WRITE_RIGHTS_V1 = (1 << 1) | (1 << 4) | (1 << 5) | (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10) \
    | (1 << 11) | (1 << 12)
_REFER, _TRUNCATE = 1 << 13, 1 << 14


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        v = libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(int(v), 0)


def apply_landlock(writable: list[str]) -> None:
    """Restrict this process (and its children) to writing only beneath ``writable``."""
    abi = landlock_abi()
    if abi < 1:
        raise OSError("Landlock is not available in this kernel")
    rights = _WRITE_RIGHTS_V1 | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
    libc = ctypes.CDLL(None, use_errno=True)
    attr = ctypes.create_string_buffer(struct.pack("=Q", rights))
    fd = libc.syscall(_SYS_CREATE_RULESET, attr, ctypes.c_size_t(8), ctypes.c_uint32(0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    for path in writable:
        pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
        try:
            rule = ctypes.create_string_buffer(struct.pack("=Qi", rights, pfd))
            if libc.syscall(_SYS_ADD_RULE, ctypes.c_int(fd), ctypes.c_int(_RULE_PATH_BENEATH), rule,
                            ctypes.c_uint32(0)) != 0:
                raise OSError(ctypes.get_errno(), f"landlock_add_rule({path}) failed")
        finally:
            os.close(pfd)
    if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
        raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
    if libc.syscall(_SYS_RESTRICT_SELF, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
        raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    os.close(fd)


def bwrap_argv(workspace: str, cmd: list[str], net: bool = False, binds: tuple[str, ...] = ()) -> list[str]:
    """Read-only root, private /tmp, ``workspace`` (and ``binds``) read-write, namespaces unshared
    (the network too unless ``net``: then only the sandbox's own loopback exists)."""
    argv = ["bwrap", "--ro-bind", "/", "/", "--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp",
            "--bind", workspace, workspace, "--chdir", workspace, "--unshare-all", "--die-with-parent"]
    for b in binds:
        argv += ["--bind", b, b]
    if net:
        argv.append("--share-net")
    return argv + ["--", *cmd]


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: _sandbox_exec.py --cpus LIST --workspace DIR --mode MODE [--net] -- CMD...", file=sys.stderr)
        return 125
    sep = argv.index("--")
    opts, cmd = argv[:sep], argv[sep + 1:]
    cpus, workspace, mode, net = "", "", "none", False
    i = 0
    while i < len(opts):
        if opts[i] == "--net":
            net = True
            i += 1
            continue
        key, value = opts[i], opts[i + 1]
        if key == "--cpus":
            cpus = value
        elif key == "--workspace":
            workspace = value
        elif key == "--mode":
            mode = value
        i += 2
    try:
        if cpus:
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
        if mode == "bwrap":
            cmd = bwrap_argv(workspace, cmd, net)
        elif mode == "landlock":
            apply_landlock([workspace, "/dev"])
        elif mode != "none":
            raise ValueError(f"sandbox mode {mode!r} unknown; allowed: bwrap, landlock, none")
        os.chdir(workspace)
        os.execvp(cmd[0], cmd)
    except (OSError, ValueError) as e:
        print(f"sandbox setup failed: {e}", file=sys.stderr)
        return 125
    return 125  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
