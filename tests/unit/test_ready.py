"""`summit wait-ready`: the line `scripts/serve.sh` prints when the engines answer."""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from app.cli import main
from app.ready import base_url, engines_answering, wait_ready


class FakeIngress:
    """A stand-in for Summit's ingress (named as a fake): answers /v1/models with whatever `models` holds."""

    def __init__(self):
        self.models: list[dict] | None = None  # None: 503, as while the app deploys
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self):
                if owner.models is None or self.path != "/v1/models":
                    self.send_response(503)
                    self.end_headers()
                    return
                body = json.dumps({"object": "list", "data": owner.models}).encode()
                self.send_response(200)
                self.send_header("content-type", "application/json")
                self.send_header("content-length", str(len(body)))
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
    assert engines_answering(ingress.url) == ["a", "b"]


def test_wait_ready_returns_once_the_engines_answer(ingress):
    threading.Timer(0.5, lambda: setattr(ingress, "models", [{"id": "tiny", "max_model_len": 2048}])).start()
    assert wait_ready(ingress.url, timeout_s=10, interval_s=0.1) == ["tiny"]


def test_wait_ready_gives_up_on_timeout_and_when_the_server_process_exits(ingress):
    start = time.monotonic()
    assert wait_ready(ingress.url, timeout_s=0.5, interval_s=0.1) is None
    assert time.monotonic() - start < 5
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    start = time.monotonic()
    assert wait_ready(ingress.url, timeout_s=60, interval_s=0.1, while_pid=gone.pid) is None
    assert time.monotonic() - start < 5


def test_cli_prints_the_ready_line(ingress, tmp_path, capsys):
    ingress.models = [{"id": "tiny-llama", "max_model_len": 2048}]
    port = int(ingress.url.rsplit(":", 1)[1])
    assert main(["wait-ready", str(write_config(tmp_path, "127.0.0.1", port)), "--timeout", "10"]) == 0
    assert f"{ingress.url}/v1 serves tiny-llama" in capsys.readouterr().out
    ingress.models = None
    assert main(["wait-ready", str(write_config(tmp_path, "127.0.0.1", port)), "--timeout", "0.5"]) == 1
