"""A store that lacks what the bucket lock relies on: the suite's GCS or S3 server behind a proxy that drops the
conditions of conditional writes from requests (GCS's `ifGeneration*` parameters, S3's `If-Match` and
`If-None-Match` headers: every conditional write is carried out), or GCS object generations from responses, as
stores that speak those APIs without them do. (moto does not check request signatures, so S3's signed headers may
be dropped.)
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
_S3_CONDITIONS = {"if-match", "if-none-match"}


class StoreProxy:
    """Forwards to the GCS or S3 API server at `backend` (its URL); `without` is "preconditions" (either API) or
    "generations" (GCS's)."""

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
                headers = {k: v for k, v in self.headers.items() if k.lower() not in _NOT_FORWARDED
                           and not (without == "preconditions" and k.lower() in _S3_CONDITIONS)}
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
                # A HEAD answer carries the length of the body a GET would return, and no body.
                head = self.command == "HEAD"
                self.send_header("Content-Length", answer.getheader("Content-Length", "0") if head else str(len(data)))
                self.end_headers()
                if not head:
                    self.wfile.write(data)
                backend_connection.close()

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = do_HEAD = forward

            def log_message(self, *args):
                pass

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", self.port), Handler)
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def __enter__(self) -> StoreProxy:
        self.thread.start()
        return self

    def __exit__(self, *exc):
        self.server.shutdown()
        self.server.server_close()
