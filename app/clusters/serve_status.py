"""What Serve says of a YAML's applications while they start — running, still starting, or failed and why — read
from the Ray dashboard's REST API (`/api/serve/applications/`, what `serve status` reads; the dashboard's state API
for a starting replica's own output). No Ray driver is started.

A failed start is said in the engine's own words: a replica whose engine could not start raises with a
`StartFailure` record (deployments/engine/failure.py) that Serve keeps in the deployment's message; the builder's
refusals (a `source` that does not exist, a model the cluster cannot place) end the application with the builder's
own line. A failure that another attempt would repeat (a config error) is final at its first occurrence, though Serve
tries again up to `deployment.max_start_attempts`; one that might not (a killed engine) is final once Serve has given
up on the application.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from deployments.engine.failure import StartFailure

# "ValueError: model 'x': source '/m' does not exist..." — the last such line of a traceback is its root
_EXCEPTION_LINE = re.compile(r"^(?:[\w.]+\.)?\w*(?:Error|Exception)(?:\([^)]*\))?: .+$")
_ANSI = re.compile(r"\x1b\[[0-9;]*m")


@dataclass(frozen=True)
class Verdict:
    """running: every application runs; starting: not yet (`detail`: Serve's latest word on it); failed: `reason`
    (one line), with Summit's record of the engine's failure where a replica wrote one."""

    state: str
    reason: str | None = None
    failure: StartFailure | None = None
    detail: str | None = None
    serve_status: str | None = None  # the application's status in Serve when this was read (DEPLOYING while it retries)


def auth_token() -> str | None:
    """Ray's cluster token as its own clients find it: RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, or
    ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_TOKEN"):
        return os.environ["RAY_AUTH_TOKEN"].strip()
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token").expanduser()
    try:
        return path.read_text().strip() or None
    except OSError:
        return None


class Dashboard:
    """The Ray dashboard at `address` (http://HOST:PORT), with Ray's token when the cluster asks for one."""

    def __init__(self, address: str):
        self.address = address.rstrip("/")
        if "://" not in self.address:
            self.address = "http://" + self.address
        self._token = auth_token() if os.environ.get("RAY_AUTH_MODE") == "token" else None

    def _get(self, path: str, timeout_s: float = 10) -> bytes:
        request = urllib.request.Request(self.address + path)
        if self._token:
            request.add_header("Authorization", f"Bearer {self._token}")
        try:
            with urllib.request.urlopen(request, timeout=timeout_s) as response:
                return response.read()
        except urllib.error.HTTPError as e:
            if e.code == 401 and self._token is None and (token := auth_token()):  # a token cluster, mode unset here
                self._token = token
                return self._get(path, timeout_s)
            raise

    def applications(self) -> dict | None:
        """Serve's applications (name → details), or None when the dashboard does not answer (yet)."""
        try:
            return json.loads(self._get("/api/serve/applications/")).get("applications") or {}
        except (OSError, ValueError):
            return None

    def actor_output(self, actor_id: str, lines: int = 40) -> list[str]:
        """The last lines an actor's process wrote (its stdout, then its stderr), wherever it runs."""
        found = []
        for suffix in ("out", "err"):
            try:
                text = self._get(f"/api/v0/logs/file?actor_id={actor_id}&suffix={suffix}&lines={lines}", 30)
            except (OSError, ValueError):
                continue
            found += [_ANSI.sub("", line).rstrip() for line in text.decode(errors="replace").splitlines()]
        return [line for line in found if line.strip()]


def verdict(apps: dict, names: list[str]) -> Verdict:
    """The start of the applications `names` as Serve reports it in `apps` (Dashboard.applications)."""
    ours = {name: apps.get(name) for name in names}
    for name, app in ours.items():
        if app is None:
            continue
        found = _failure(app, final=app.get("status") == "DEPLOY_FAILED")
        if found is not None:
            return dataclasses.replace(found, serve_status=app.get("status"))
    if ours and all(app is not None and app.get("status") == "RUNNING" for app in ours.values()):
        return Verdict("running")
    return Verdict("starting", detail=_latest_word(ours))


def _failure(app: dict, final: bool) -> Verdict | None:
    """A failure of this application: a replica's record that says another attempt would fail the same way, or, once
    Serve failed the application, its record or its builder's exception line."""
    messages = [d.get("message") or "" for d in (app.get("deployments") or {}).values()] + [app.get("message") or ""]
    deployed = app.get("last_deployed_time_s") or 0.0
    for message in messages:
        record = StartFailure.from_text(message)
        if record is None or (record.retry and not final):
            continue
        if not final and record.began is not None and record.began < deployed:
            continue  # a replica of the config this deploy replaced: Serve's message has not caught up yet
        return Verdict("failed", _sentence(record), record)
    if not final:
        return None
    for message in messages:
        if line := last_exception_line(message):
            return Verdict("failed", line)
    said = [m.strip().splitlines()[0] for m in messages if m.strip()]
    return Verdict("failed", said[0] if said else "Serve reports the application DEPLOY_FAILED")


def _sentence(record: StartFailure) -> str:
    return f"model {record.model!r}: its engine could not start: {record.reason}"


def last_exception_line(text: str) -> str | None:
    """The last `SomeError: ...` line of a traceback in `text` (Serve's message of a failed build); for a pydantic
    ValidationError (the schema's refusal), its first error's message, which names the key and the fix."""
    lines = [_ANSI.sub("", line).strip() for line in (text or "").splitlines()]
    found = [i for i, line in enumerate(lines) if _EXCEPTION_LINE.match(line)]
    if not found:
        return None
    line = lines[found[-1]]
    if re.search(r"\d+ validation errors? for \w+$", line):
        detail = next((x for x in lines[found[-1] + 1 :] if x.startswith("Value error, ")), None)
        if detail is not None:
            name = line.split(": ", 1)[0].rsplit(".", 1)[-1]
            return f"{name}: " + re.sub(r" \[type=.*$", "", detail.removeprefix("Value error, "))
    return line


def _latest_word(apps: dict) -> str | None:
    """Serve's latest message on a starting application (a deployment's, else the application's)."""
    for app in apps.values():
        for deployment in ((app or {}).get("deployments") or {}).values():
            if deployment.get("message"):
                return _ANSI.sub("", deployment["message"]).strip().splitlines()[0]
    return None


def starting_replicas(apps: dict, names: list[str]) -> list[tuple[str, dict]]:
    """(deployment, replica) of each replica of `names` that is not running yet."""
    found = []
    for name in names:
        for deployment_name, deployment in ((apps.get(name) or {}).get("deployments") or {}).items():
            found += [(deployment_name, r) for r in deployment.get("replicas") or [] if r.get("state") != "RUNNING"]
    return found
