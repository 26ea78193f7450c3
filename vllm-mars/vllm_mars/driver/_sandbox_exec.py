"""Exec a tool command pinned to CPU cores inside a sandbox (stdlib only; run with ``python -I``).

Usage: ``python -I _sandbox_exec.py --cpus 0,1 --workspace DIR --mode bwrap|landlock|none
[--read DIR]... [--net | --net-allow PORT...] -- CMD...``. It sets its CPU affinity (inherited by
the command), then either

* execs bubblewrap: only the system directories (and each ``--read`` DIR) bound read-only, a
  private /tmp, /dev and /proc, the workspace bound read-write, every namespace unshared, so no
  network at all unless ``--net`` (bubblewrap cannot filter ports: ``--net-allow`` is refused); or
* applies a Landlock ruleset and execs the command: writes only beneath the workspace (and /dev),
  reads and execution only beneath the workspace, the system directories and each ``--read`` DIR;
  with ABI >= 4 every TCP bind/connect is denied except ``--net-allow`` ports (``--net``: no
  network rules); with ABI >= 6 abstract unix sockets and signals outside the sandbox are denied.
  UDP is outside Landlock's reach.

Before exec it prints one line ``MARS_SANDBOX {json}`` to stderr naming the protections in force
(the tool plane reads it). Exit code 125 means the sandbox itself could not be set up.
"""

from __future__ import annotations

import argparse
import ctypes
import json
import os
import struct
import sys

# Landlock (Linux >= 5.13); the syscall numbers are the same on every architecture.
_SYS_CREATE_RULESET, _SYS_ADD_RULE, _SYS_RESTRICT_SELF = 444, 445, 446
_CREATE_RULESET_VERSION = 1
_RULE_PATH_BENEATH, _RULE_NET_PORT = 1, 2
_PR_SET_NO_NEW_PRIVS = 38
_EXECUTE, _READ_FILE, _READ_DIR = 1 << 0, 1 << 2, 1 << 3
_READ_RIGHTS = _EXECUTE | _READ_FILE | _READ_DIR
# Write-side filesystem rights of ABI 1.
_WRITE_RIGHTS_V1 = (1 << 1) | (1 << 4) | (1 << 5) | (1 << 6) | (1 << 7) | (1 << 8) | (1 << 9) | (1 << 10) \
    | (1 << 11) | (1 << 12)
_REFER, _TRUNCATE = 1 << 13, 1 << 14
_NET_BIND_TCP, _NET_CONNECT_TCP = 1 << 0, 1 << 1
_SCOPE_ABSTRACT_UNIX_SOCKET, _SCOPE_SIGNAL = 1 << 0, 1 << 1
#: Read-only system directories a tool may read and execute from (those that exist).
SYSTEM_READ_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/etc", "/opt", "/proc",
                    "/sys")
MARKER = "MARS_SANDBOX "


def landlock_abi() -> int:
    """The kernel's Landlock ABI version, 0 when unavailable."""
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        v = libc.syscall(_SYS_CREATE_RULESET, None, ctypes.c_size_t(0), ctypes.c_uint32(_CREATE_RULESET_VERSION))
    except (OSError, AttributeError):
        return 0
    return max(int(v), 0)


def _add_rule(libc, fd: int, rule_type: int, payload: bytes, what: str) -> None:
    buf = ctypes.create_string_buffer(payload)
    if libc.syscall(_SYS_ADD_RULE, ctypes.c_int(fd), ctypes.c_int(rule_type), buf, ctypes.c_uint32(0)) != 0:
        raise OSError(ctypes.get_errno(), f"landlock_add_rule({what}) failed")


def apply_landlock(writable: list[str], readable: list[str] | None = None,
                   net_ports: list[int] | None = None) -> dict:
    """Restrict this process (and its children): writes only beneath ``writable``, reads and
    execution only beneath ``writable`` + ``readable``; TCP bind/connect only to ``net_ports``
    (None: no network rules). Returns the protections in force."""
    abi = landlock_abi()
    if abi < 1:
        raise OSError("Landlock is not available in this kernel")
    write = _WRITE_RIGHTS_V1 | (_REFER if abi >= 2 else 0) | (_TRUNCATE if abi >= 3 else 0)
    fs_rights = write | _READ_RIGHTS
    net = net_ports is not None and abi >= 4
    net_rights = (_NET_BIND_TCP | _NET_CONNECT_TCP) if net else 0
    scoped = (_SCOPE_ABSTRACT_UNIX_SOCKET | _SCOPE_SIGNAL) if abi >= 6 else 0
    attr = struct.pack("=QQQ", fs_rights, net_rights, scoped)[: 24 if abi >= 6 else 16 if abi >= 4 else 8]
    libc = ctypes.CDLL(None, use_errno=True)
    fd = libc.syscall(_SYS_CREATE_RULESET, ctypes.create_string_buffer(attr), ctypes.c_size_t(len(attr)),
                      ctypes.c_uint32(0))
    if fd < 0:
        raise OSError(ctypes.get_errno(), "landlock_create_ruleset failed")
    reads = [p for p in (readable or []) if os.path.isdir(p)]
    try:
        for path, rights in [*((p, fs_rights) for p in writable), *((p, _READ_RIGHTS) for p in reads)]:
            pfd = os.open(path, os.O_PATH | os.O_CLOEXEC)
            try:
                _add_rule(libc, fd, _RULE_PATH_BENEATH, struct.pack("=Qi", rights, pfd), path)
            finally:
                os.close(pfd)
        for port in (net_ports or []) if net else []:
            _add_rule(libc, fd, _RULE_NET_PORT, struct.pack("=QQ", _NET_CONNECT_TCP, port), f"port {port}")
        if libc.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
            raise OSError(ctypes.get_errno(), "prctl(PR_SET_NO_NEW_PRIVS) failed")
        if libc.syscall(_SYS_RESTRICT_SELF, ctypes.c_int(fd), ctypes.c_uint32(0)) != 0:
            raise OSError(ctypes.get_errno(), "landlock_restrict_self failed")
    finally:
        os.close(fd)
    return describe("landlock", writable, reads, net_ports is None, net_ports or [], abi)


def describe(mode: str, writable: list[str], readable: list[str], net: bool, ports: list[int],
             abi: int | None = None) -> dict:
    """The protections a sandbox ``mode`` puts in force with these options (for the run's events)."""
    if mode == "none":
        return {"mode": "none", "writes": "anywhere", "reads": "anywhere", "tcp": "allowed", "udp": "allowed"}
    reads = [*writable, *(p for p in readable if os.path.isdir(p))]
    if mode == "bwrap":
        return {"mode": "bwrap", "writes": writable, "reads": reads,
                "tcp": "allowed" if net else "denied (no network namespace)",
                "udp": "allowed" if net else "denied (no network namespace)"}
    abi = landlock_abi() if abi is None else abi
    if net:
        tcp = "allowed"
    elif abi >= 4:
        tcp = f"denied except connect to ports {sorted(ports)}" if ports else "denied"
    else:
        tcp = "allowed (Landlock ABI < 4 cannot deny it)"
    return {"mode": "landlock", "abi": abi, "writes": writable, "reads": reads, "tcp": tcp,
            "udp": "allowed (outside Landlock)",
            "abstract_unix_sockets_and_signals": "scoped to the sandbox" if abi >= 6 else "not scoped"}


def _under_tmp(cmd: list[str], readable: list[str] | None, own: tuple[str, ...] = ()) -> list[str]:
    """Paths below /tmp that stay visible (read-only) over the sandbox's private /tmp: with a read
    list, its entries below /tmp; with the whole root readable, the top directory below /tmp of the
    interpreter's prefix and of every absolute path in ``cmd`` (a checkout or venv under /tmp), except
    paths inside ``own`` (the sandbox's own writable dirs, bound anyway)."""
    tmp = "/tmp/"
    if readable is not None:
        keep = [os.path.realpath(d) for d in readable]
        return sorted({d for d in keep if d.startswith(tmp) and os.path.isdir(d)})
    out = set()
    mine = [os.path.realpath(o).rstrip("/") + "/" for o in own]
    for a in [sys.prefix, sys.base_prefix, *cmd]:
        if not a.startswith("/") or any(os.path.realpath(a).rstrip("/") + "/" == m or
                                        os.path.realpath(a).startswith(m) for m in mine):
            continue
        for path in {a, os.path.realpath(a)}:
            if path.startswith(tmp):
                top = tmp + path[len(tmp):].split("/", 1)[0]
                if os.path.isdir(top):
                    out.add(top)
    return sorted(out)


def bwrap_argv(workspace: str, cmd: list[str], net: bool = False, binds: tuple[str, ...] = (),
               readable: list[str] | None = None) -> list[str]:
    """``workspace`` (and ``binds``) read-write, a private /tmp, /dev and /proc, every namespace
    unshared (the network too unless ``net``: then only the sandbox's own loopback exists). Reads:
    only ``readable`` (bound read-only) when given, else the whole root read-only."""
    argv = ["bwrap"]
    if readable is None:
        argv += ["--ro-bind", "/", "/"]
    for d in readable or ():
        if os.path.islink(d):  # merged-/usr layouts: /bin -> usr/bin
            argv += ["--symlink", os.readlink(d), d]
        elif os.path.isdir(d) and d not in ("/proc", "/dev", "/tmp"):
            argv += ["--ro-bind", d, d]
    argv += ["--dev", "/dev", "--proc", "/proc", "--tmpfs", "/tmp"]
    for d in _under_tmp(cmd, readable, (workspace, *binds)):  # the private /tmp must not hide what the command runs from
        argv += ["--ro-bind", d, d]
    argv += ["--bind", workspace, workspace, "--chdir", workspace, "--unshare-all", "--die-with-parent"]
    if readable is not None:
        argv.append("--new-session")
    for b in binds:
        argv += ["--bind", b, b]
    if net:
        argv.append("--share-net")
    return [*argv, "--", *cmd]


class _Args(argparse.ArgumentParser):
    def error(self, message: str):
        raise ValueError(message)


def _parse(opts: list[str]) -> argparse.Namespace:
    p = _Args(prog="_sandbox_exec.py", add_help=False)
    p.add_argument("--cpus", default="")
    p.add_argument("--workspace", required=True)
    p.add_argument("--mode", default="none")
    p.add_argument("--read", action="append", default=[])
    p.add_argument("--net-allow", action="append", type=int, default=[])
    p.add_argument("--net", action="store_true")
    return p.parse_args(opts)


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: _sandbox_exec.py --cpus LIST --workspace DIR --mode MODE [--read DIR]... "
              "[--net | --net-allow PORT]... -- CMD...", file=sys.stderr)
        return 125
    sep = argv.index("--")
    cmd = argv[sep + 1:]
    try:
        a = _parse(argv[:sep])
        cpus, workspace, mode, net, ports = a.cpus, a.workspace, a.mode, a.net, a.net_allow
        reads = [*SYSTEM_READ_DIRS, *a.read]
        if cpus:
            os.sched_setaffinity(0, {int(c) for c in cpus.split(",")})
        if mode == "bwrap":
            if ports and not net:
                raise ValueError("bubblewrap cannot allow single ports: use --sandbox landlock for an allow-list")
            cmd = bwrap_argv(workspace, cmd, net, readable=reads)
            info = describe(mode, [workspace], reads, net, ports)
        elif mode == "landlock":
            info = apply_landlock([workspace, "/dev"], reads, None if net else ports)
        elif mode == "none":
            info = describe(mode, [], [], True, [])
        else:
            raise ValueError(f"sandbox mode {mode!r} unknown; allowed: bwrap, landlock, none")
        os.chdir(workspace)
        print(MARKER + json.dumps(info), file=sys.stderr, flush=True)
        os.execvp(cmd[0], cmd)
    except (OSError, ValueError) as e:
        print(f"sandbox setup failed: {e}", file=sys.stderr)
        return 125
    return 125  # not reached


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
