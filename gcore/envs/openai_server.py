"""The HTTP side of ``--env openai_agent``: an OpenAI-compatible chat-completions endpoint on 127.0.0.1.

One ``ChatServer`` per environment object and process (started on the first rollout, kept for the run, a daemon
thread). Each episode gets a path of its own, ``http://127.0.0.1:PORT/<key>/v1`` (``key``: a random token), so a
request tells which episode it belongs to without any header of the agent's. The server answers

- ``GET /<key>/v1/models``: one model (whatever name the agent sends is accepted);
- ``POST /<key>/v1/chat/completions``: handed to the episode's handler, which blocks this request's thread until
  the engine has generated the reply (the episode loop batches the requests of all episodes into one
  ``generate``; gcore/envs/openai_agent.py).

Errors are answered in OpenAI's shape (``{"error": {"message": ..., "type": ...}}``) so the ``openai`` client
raises them as its own ``BadRequestError`` and the like. Only the standard library's ``ThreadingHTTPServer``.
"""

from __future__ import annotations

import json
import logging
import threading
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

log = logging.getLogger(__name__)

#: a request body larger than this is refused (413): a conversation of this size is past any context window
MAX_BODY_BYTES = 32 * 1024 * 1024

#: ``handler(key, body)`` -> (HTTP status, JSON reply); raises ``KeyError`` for a key it does not know
Handler = Callable[[str, dict[str, Any]], tuple[int, dict[str, Any]]]


def error_body(message: str, kind: str = "invalid_request_error") -> dict[str, Any]:
    """An OpenAI-shaped error reply."""
    return {"error": {"message": message, "type": kind, "param": None, "code": None}}


class ChatServer:
    """A ``ThreadingHTTPServer`` on ``127.0.0.1:port`` (0: a free port) that routes each episode's requests to
    ``handler``."""

    def __init__(self, handler: Handler, model: str, port: int = 0) -> None:
        self.handler, self.model = handler, model
        server = self

        class _Requests(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, format: str, *args: Any) -> None:  # noqa: ANN401  the base class's names
                log.debug("openai_agent endpoint: " + format, *args)

            def do_GET(self) -> None:
                key, rest = _split(self.path)
                if rest in ("/v1/models", "/models"):
                    self._reply(200, {"object": "list", "data": [
                        {"id": server.model, "object": "model", "created": 0, "owned_by": "gcore"}]})
                else:
                    self._reply(404, error_body(f"no such endpoint: GET {self.path}", "not_found_error"))

            def do_POST(self) -> None:
                key, rest = _split(self.path)
                length = int(self.headers.get("Content-Length") or 0)
                if length > MAX_BODY_BYTES:
                    self.close_connection = True
                    self._reply(413, error_body(f"request body of {length} bytes is over {MAX_BODY_BYTES}"))
                    return
                raw = self.rfile.read(length) if length else b""
                if rest not in ("/v1/chat/completions", "/chat/completions"):
                    self._reply(404, error_body(f"no such endpoint: POST {self.path} (gcore serves "
                                                "/v1/chat/completions and /v1/models)", "not_found_error"))
                    return
                try:
                    body = json.loads(raw or b"{}")
                except (json.JSONDecodeError, UnicodeDecodeError) as err:
                    self._reply(400, error_body(f"the request body is not JSON: {err}"))
                    return
                if not isinstance(body, dict):
                    self._reply(400, error_body("the request body must be a JSON object"))
                    return
                try:
                    status, reply = server.handler(key, body)
                except KeyError:
                    status, reply = 404, error_body("no episode at this address (a base_url of another rollout?)",
                                                    "not_found_error")
                self._reply(status, reply)

            def _reply(self, status: int, payload: dict[str, Any]) -> None:
                data = json.dumps(payload).encode()
                try:
                    self.send_response(status)
                    self.send_header("Content-Type", "application/json")
                    self.send_header("Content-Length", str(len(data)))
                    self.end_headers()
                    self.wfile.write(data)
                except OSError:  # the agent is gone (its process killed at its timeout): nobody to answer
                    self.close_connection = True

        self._server = ThreadingHTTPServer(("127.0.0.1", port), _Requests)
        self._server.daemon_threads = True
        self.port = int(self._server.server_address[1])
        self._thread = threading.Thread(target=self._server.serve_forever, name="gcore-openai-endpoint",
                                        daemon=True)
        self._thread.start()

    def base_url(self, key: str) -> str:
        return f"http://127.0.0.1:{self.port}/{key}/v1"

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()


def _split(path: str) -> tuple[str, str]:
    """``/<key>/v1/chat/completions?x`` -> (``key``, ``/v1/chat/completions``)."""
    path = path.split("?", 1)[0]
    _, key, rest = (path.split("/", 2) + ["", ""])[:3]
    return key, "/" + rest.rstrip("/")
