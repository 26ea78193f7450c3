"""Run an agent CLI inside its sandbox with one way out: 127.0.0.1:PORT -> a Unix socket (stdlib only).

Usage: ``python -I _agent_exec.py --port PORT --unix SOCK --chdir DIR -- CMD...``. Started by
bubblewrap in a fresh network namespace (only its own loopback, no route anywhere): it listens on
127.0.0.1:PORT, pipes every connection to the Unix socket SOCK (bound into the sandbox; the runner's
measuring proxy listens there and forwards to the server), then runs CMD in DIR with stdin closed and
exits with its code. Exit code 125: the bridge could not be set up (message on stderr).
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import threading


def _pipe(src: socket.socket, dst: socket.socket) -> None:
    try:
        while True:
            data = src.recv(65536)
            if not data:
                break
            dst.sendall(data)
    except OSError:
        pass
    finally:
        for s, how in ((dst, socket.SHUT_WR), (src, socket.SHUT_RD)):
            try:
                s.shutdown(how)
            except OSError:
                pass


def _serve(listener: socket.socket, unix_path: str) -> None:
    while True:
        conn, _ = listener.accept()
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.connect(unix_path)
        except OSError:
            conn.close()
            up.close()
            continue
        for a, b in ((conn, up), (up, conn)):
            threading.Thread(target=_pipe, args=(a, b), daemon=True).start()


def main(argv: list[str]) -> int:
    if "--" not in argv:
        print("usage: _agent_exec.py --port PORT --unix SOCK --chdir DIR -- CMD...", file=sys.stderr)
        return 125
    sep = argv.index("--")
    opts = dict(zip(argv[:sep:2], argv[1:sep:2], strict=False))
    cmd = argv[sep + 1:]
    try:
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", int(opts["--port"])))
        listener.listen(64)
        threading.Thread(target=_serve, args=(listener, opts["--unix"]), daemon=True).start()
        os.chdir(opts["--chdir"])
    except (OSError, KeyError, ValueError) as e:
        print(f"agent sandbox bridge setup failed: {e!r}", file=sys.stderr)
        return 125
    return subprocess.call(cmd, stdin=subprocess.DEVNULL)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
