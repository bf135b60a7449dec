"""summit-haproxy's config rewrite: hostless binds (Serve's stats and metrics ports) move to loopback, nothing else."""

from app.clusters.haproxy import loopback_binds

SERVE_CONFIG = """frontend prometheus
    bind :9101
    mode http
frontend http_frontend
    bind 127.0.0.1:8000
listen stats
  bind *:8404
  stats enable
"""


def test_only_hostless_binds_move():
    out = loopback_binds(SERVE_CONFIG)
    assert "    bind 127.0.0.1:9101\n" in out and "  bind 127.0.0.1:8404\n" in out
    assert "    bind 127.0.0.1:8000\n" in out and out.count("bind ") == 3
    assert loopback_binds(SERVE_CONFIG, "10.0.0.5").count("10.0.0.5") == 2


# --- HAProxy's own answers in OpenAI's shape ------------------------------------------------------------------------
import json  # noqa: E402
import subprocess  # noqa: E402
from pathlib import Path  # noqa: E402

import pytest  # noqa: E402

from app.clusters.haproxy import openai_answers, real_haproxy, without_splicing  # noqa: E402

# A config Serve 2.60 wrote (the shipped tiny app behind HAProxy), its run directory made a placeholder; and the
# ingress request router's failure answer, which Serve writes only when an app has a route picker.
SERVE_HAPROXY_CFG = (Path(__file__).with_name("serve_haproxy.cfg")).read_text()
ROUTER_FAILURE = (
    '    http-request return status 503 content-type text/plain lf-string "Ingress request router failed: '
    '%[var(txn.ingress_request_router_failed)]" hdr X-Serve-Reason %[var(txn.ingress_request_router_failed)]'
    " if { var(txn.ingress_request_router_failed) -m found }\n"
)


def _rewritten(tmp_path: Path) -> str:
    config = SERVE_HAPROXY_CFG.replace("@RUN@", str(tmp_path))
    config = config.replace(
        "    default_backend default_backend\n", ROUTER_FAILURE + "    default_backend default_backend\n"
    )
    return without_splicing(openai_answers(config, tmp_path / "answers"))


def test_haproxys_own_answers_become_openai_errors(tmp_path):
    config = _rewritten(tmp_path)
    assert f"{tmp_path}/500.http" not in config and "text/plain lf-string" not in config  # Serve's plain 500
    for code, status in ((400, 400), (408, 408), (500, 500), (502, 503), (503, 503), (504, 504)):
        assert f"    errorfile {code} {tmp_path}/answers/{code}.http\n" in config
        head, body = (tmp_path / f"answers/{code}.http").read_bytes().split(b"\r\n\r\n", 1)
        assert head.startswith(f"HTTP/1.1 {status} ".encode()) and f"Content-Length: {len(body)}".encode() in head
        assert (b"Retry-After: 1" in head) == (status == 503)
        error = json.loads(body)["error"]
        assert error["code"] == status and error["message"] and error["type"]
    assert f"status 404 content-type application/json file {tmp_path}/answers/404.json" in config
    assert json.loads((tmp_path / "answers/404.json").read_bytes())["error"]["code"] == 404
    frontend = config[config.index("frontend http_frontend") :].split("\nbackend ", 1)[0]
    assert (
        f"    http-response return status 503 content-type application/json file {tmp_path}/answers/no-app-503.json "
        "hdr Retry-After 1 if { status 404 } !{ res.hdr(content-type) -m sub json }\n"
    ) in frontend
    assert json.loads((tmp_path / "answers/no-app-503.json").read_bytes())["error"]["code"] == 503
    assert (
        f"status 503 content-type application/json file {tmp_path}/answers/router-503.json hdr Retry-After 1 "
        "hdr X-Serve-Reason"
    ) in config


def test_the_rewritten_config_is_valid_for_haproxy(tmp_path):
    try:
        binary = real_haproxy()
    except SystemExit as e:  # the README's set-up installs it (scripts/setup.sh): missing is a broken set-up
        pytest.fail(f"no haproxy binary: {e}")
    (tmp_path / "server-state").write_text("")
    path = tmp_path / "haproxy.cfg"
    path.write_text(_rewritten(tmp_path))
    check = subprocess.run([binary, "-c", "-f", str(path)], capture_output=True, text=True)
    assert check.returncode == 0, check.stdout + check.stderr


def test_serves_kernel_splicing_is_dropped_and_nothing_else(tmp_path):
    """Serve's splice options lose client closes (app/clusters/haproxy.py); every other line stays."""
    config = SERVE_HAPROXY_CFG.replace("@RUN@", str(tmp_path))
    kept = without_splicing(config)
    assert "option splice-request" in config and "option splice-response" in config  # the premise: Serve sets them
    assert "splice" not in kept
    assert [line for line in config.splitlines() if "splice" not in line] == kept.splitlines()
