"""A GCS API server that lacks what the bucket lock relies on: fake-gcs-server (`tests.gcs_server`) behind a proxy
that drops generation preconditions from requests (`ifGenerationMatch`: every conditional write is carried out), or
object generations from responses, as stores that speak the GCS API without them do.
"""

from __future__ import annotations

import http.client
import http.server
import json
import threading
import urllib.parse

from tests.gcs_server import free_port

# Hop-by-hop and length headers: the proxy answers with a body of its own length.
_NOT_FORWARDED = {"connection", "keep-alive", "transfer-encoding", "content-length", "host"}


class GcsProxy:
    """Forwards to the GCS API server at `backend` (its URL); `without` is "preconditions" or "generations"."""

    def __init__(self, backend: str, without: str):
        assert without in ("preconditions", "generations")
        target = urllib.parse.urlsplit(backend)
        self.port, proxy = free_port(), self

        class Handler(http.server.BaseHTTPRequestHandler):
            def forward(self):
                url = urllib.parse.urlsplit(self.path)
                query = [(k, v) for k, v in urllib.parse.parse_qsl(url.query, keep_blank_values=True)
                         if not (without == "preconditions" and k.startswith("ifGeneration"))]
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _NOT_FORWARDED}
                backend_connection = http.client.HTTPConnection(target.hostname, target.port, timeout=30)
                backend_connection.request(self.command, url.path + "?" + urllib.parse.urlencode(query), body=body,
                                           headers=headers)
                answer = backend_connection.getresponse()
                data = answer.read().replace(backend.encode(), proxy.url.encode())  # links lead back here
                reply = [(k, v) for k, v in answer.getheaders() if k.lower() not in _NOT_FORWARDED]
                if without == "generations":
                    reply = [(k, v) for k, v in reply if k.lower() != "x-goog-generation"]
                    if answer.getheader("Content-Type", "").startswith("application/json"):
                        document = json.loads(data or b"null")
                        if isinstance(document, dict):
                            document.pop("generation", None)
                            data = json.dumps(document).encode()
                self.send_response(answer.status)
                for k, v in reply:
                    self.send_header(k, v)
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)
                backend_connection.close()

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = forward

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> GcsProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
