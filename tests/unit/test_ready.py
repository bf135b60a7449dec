"""`summit wait-ready`: the line `scripts/serve.sh` prints when the engines answer."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from app.cli import main
from app.clusters.ready import base_url, engines_answering, wait_ready


class FakeIngress:
    """A stand-in for Summit's ingress (named as a fake): answers /v1/models with whatever `models` holds."""

    def __init__(self):
        self.models: list[dict] | None = None  # None: 503, as while the app deploys
        self.path_header: str | None = None  # x-summit-request-path, as the two-hop ingress sends it
        self.asks = 0
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                owner.asks += 1
                if owner.models is None or self.path != "/v1/models":
                    self.send_response(503)
                    self.end_headers()
                    return
                body = json.dumps({"object": "list", "data": owner.models}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
                if owner.path_header:
                    self.send_header("x-summit-request-path", owner.path_header)
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, *args):
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()


@pytest.fixture
def ingress():
    fake = FakeIngress()
    yield fake
    fake.server.shutdown()


def write_config(tmp_path, host: str, port: int):
    path = tmp_path / "serve.yaml"
    path.write_text(f"http_options:\n  host: {host}\n  port: {port}\napplications: []\n")
    return path


def test_base_url_follows_http_options(tmp_path):
    assert base_url(write_config(tmp_path, "127.0.0.1", 8123)) == "http://127.0.0.1:8123"
    assert base_url(write_config(tmp_path, "0.0.0.0", 9000)) == "http://127.0.0.1:9000"  # reach a wildcard bind locally
    (tmp_path / "bare.yaml").write_text("applications: []\n")
    assert base_url(tmp_path / "bare.yaml") == "http://127.0.0.1:8000"  # Serve's default port


def test_ready_only_when_every_engine_answers(ingress):
    assert engines_answering(ingress.url) is None  # 503 while deploying
    ingress.models = [{"id": "a", "max_model_len": 2048}, {"id": "b", "object": "model", "owned_by": "summit"}]
    assert engines_answering(ingress.url) is None  # b's engine is not answering yet (the ingress's own entry)
    ingress.models[1]["max_model_len"] = 4096
    assert engines_answering(ingress.url).models == ["a", "b"]


def test_wait_ready_returns_once_the_engines_answer(ingress):
    threading.Timer(0.5, lambda: setattr(ingress, "models", [{"id": "tiny", "max_model_len": 2048}])).start()
    assert wait_ready(ingress.url, timeout_s=10, interval_s=0.1).ready.models == ["tiny"]


def test_wait_ready_gives_up_on_timeout_and_when_the_server_process_exits(ingress):
    assert wait_ready(ingress.url, timeout_s=0.5, interval_s=0.1).state == "timeout"
    assert ingress.asks >= 1  # it asked until its deadline
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    ingress.asks = 0
    # an hour's timeout: it returns after its first ask, because the server process is gone
    assert wait_ready(ingress.url, timeout_s=3600, interval_s=0.1, while_pid=gone.pid).state == "gone"
    assert ingress.asks == 1


def test_cli_prints_the_ready_line(ingress, tmp_path, capsys):
    ingress.models = [{"id": "tiny-llama", "max_model_len": 2048}]
    port = int(ingress.url.rsplit(":", 1)[1])
    assert main(["wait-ready", str(write_config(tmp_path, "127.0.0.1", port)), "--timeout", "10"]) == 0
    out = capsys.readouterr()
    assert f"{ingress.url}/v1 serves tiny-llama" in out.out and "warning" not in out.err


def test_cli_warns_with_the_fix_when_ray_runs_without_the_direct_path(ingress, tmp_path, capsys):
    """The header's text is the builder's own reason (app/build/builder.py: NO_HAPROXY); the real twin is
    tests/cpu/test_multinode.py, whose Ray runs without HAProxy."""
    from app.build.builder import NO_HAPROXY

    ingress.models = [{"id": "tiny-llama", "max_model_len": 2048}]
    port = int(ingress.url.rsplit(":", 1)[1])
    config = str(write_config(tmp_path, "127.0.0.1", port))
    ingress.path_header = "hops; ingress.path is hops"  # chosen in the YAML: nothing to fix
    assert main(["wait-ready", config, "--timeout", "10"]) == 0
    assert "warning" not in capsys.readouterr().err
    ingress.path_header = f"hops; {NO_HAPROXY}"
    assert main(["wait-ready", config, "--timeout", "10"]) == 0
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("summit: warning: requests take the two-hop path")
    assert 'eval "$(summit direct-path-env)"' in err[0]
    ingress.models = None
    assert main(["wait-ready", str(write_config(tmp_path, "127.0.0.1", port)), "--timeout", "0.5"]) == 1
