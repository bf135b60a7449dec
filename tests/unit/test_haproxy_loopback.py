"""summit-haproxy's config rewrite: hostless binds (Serve's stats and metrics ports) move to loopback, nothing else."""

from app.haproxy_loopback import loopback_binds

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
