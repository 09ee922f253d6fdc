"""One HTTP/1.1 call under a wall-clock deadline (the SGLang worker's transport).

A socket timeout bounds each read, not the call: a server that sends one byte just inside it holds a call for as
long as it likes. `call` runs the request on a thread of its own and waits at most `seconds` for the whole answer;
past that it shuts the connection down (the thread's blocked read returns) and raises `DeadlineExceeded`. Connect,
send, headers and body are all inside the deadline.
"""

from __future__ import annotations

import http.client
import json
import socket
import threading
import urllib.parse


class DeadlineExceeded(TimeoutError):
    """No complete answer within the call's deadline."""


def call(method: str, url: str, payload: object | None, headers: dict[str, str], seconds: float) -> tuple[int, bytes]:
    """(HTTP status, body) of `method url` with `payload` as a JSON body, all of it within `seconds` of wall-clock
    time; `DeadlineExceeded` past it, the transport's `OSError` / `http.client.HTTPException` otherwise."""
    parts = urllib.parse.urlsplit(url)
    if not parts.hostname:
        raise http.client.InvalidURL(f"{url!r} names no host")
    connection = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = connection(parts.hostname, parts.port, timeout=seconds)
    path = parts.path + (f"?{parts.query}" if parts.query else "")
    body = None if payload is None else json.dumps(payload).encode()
    sent = dict(headers) | ({"Content-Type": "application/json"} if body is not None else {})
    box: dict = {}
    done = threading.Event()

    def target() -> None:
        try:
            conn.request(method, path or "/", body=body, headers=sent)
            resp = conn.getresponse()
            box["out"] = (resp.status, resp.read())
        except BaseException as e:
            box["error"] = e
        finally:
            done.set()

    threading.Thread(target=target, name=f"http {method} {url}", daemon=True).start()
    finished = done.wait(max(0.0, seconds))
    if not finished:
        _abort(conn)
        raise DeadlineExceeded(f"no complete answer within {seconds:.3g} s")
    conn.close()
    if "error" in box:
        raise box["error"]
    return box["out"]


def _abort(conn: http.client.HTTPConnection) -> None:
    """Shut the connection down under a thread blocked in it (close alone does not wake a blocked read)."""
    sock = conn.sock
    if sock is not None:
        try:
            socket.socket.shutdown(sock, socket.SHUT_RDWR)
        except OSError:  # the connection is closed already: nothing is blocked in it
            pass
    conn.close()
