"""pip's index settings (pip.conf files and PIP_* variables, as pip reads them: a variable over a file), printed as
uv's flags, one argument a line, for scripts/setup.sh (uv reads neither). pip's `cert` is printed as `--cert FILE`:
the caller gives it to uv as SSL_CERT_FILE."""

from __future__ import annotations

import subprocess
import sys

FLAGS = {
    "index-url": "--index-url",
    "extra-index-url": "--extra-index-url",
    "find-links": "--find-links",
    "constraint": "--constraint",
    "trusted-host": "--allow-insecure-host",
    "cert": "--cert",
}
RANK = {"global": 0, "install": 1, ":env:": 2}  # pip: [install] over [global], a PIP_* variable over both


def index_args(config_list: str) -> list[str]:
    """uv's arguments from `pip config list` output (lines `section.name='value'`; a list is space-separated)."""
    found: dict[str, tuple[int, str]] = {}
    for line in config_list.splitlines():
        key, _, value = line.partition("=")
        section, _, name = key.rpartition(".")
        if section in RANK and name in FLAGS and RANK[section] >= found.get(name, (-1, ""))[0]:
            found[name] = (RANK[section], value.strip().strip("'\""))
    return [
        arg for name, flag in FLAGS.items() for value in found.get(name, (0, ""))[1].split() for arg in (flag, value)
    ]


if __name__ == "__main__":
    listed = subprocess.run([sys.executable, "-m", "pip", "config", "list"], capture_output=True, text=True).stdout
    print("\n".join(index_args(listed)))
