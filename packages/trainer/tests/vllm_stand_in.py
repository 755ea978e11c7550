"""Test helper (not a test module): a stand-in for a ``vllm serve`` server's HTTP routes."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


class StandIn:
    """Answers GET/POST paths from ``routes`` (path -> (status, JSON body[, seconds before
    it answers])); records posts."""

    def __init__(self, routes: dict[str, tuple[int, object]]) -> None:
        self.routes, self.posts, self.auth = routes, [], []
        outer = self

        class Handler(BaseHTTPRequestHandler):
            def _answer(self) -> None:
                outer.auth.append((self.path, self.headers.get("Authorization")))
                status, body, *delay = outer.routes.get(self.path, (404, {"detail": "Not Found"}))
                if delay:  # seconds before it answers (a long weight transfer)
                    time.sleep(delay[0])
                raw = json.dumps(body).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(raw)))
                self.end_headers()
                self.wfile.write(raw)

            def do_GET(self) -> None:  # noqa: N802
                self._answer()

            def do_POST(self) -> None:  # noqa: N802
                length = int(self.headers.get("Content-Length", 0))
                outer.posts.append((self.path, json.loads(self.rfile.read(length) or b"null")))
                self._answer()

            def log_message(self, *args) -> None:
                """Quiet: the stand-in writes no access log to the test's output."""

        self.http = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.http.server_address[1]}"
        threading.Thread(target=self.http.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.http.shutdown()
        self.http.server_close()
