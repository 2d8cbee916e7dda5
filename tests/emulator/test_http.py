"""The emulator's HTTP edge cases that aiohttp now handles: the API's error shape for what it
parses or refuses, and a shutdown that closes idle keep-alive connections."""

from __future__ import annotations

import http.client
import json
import socket
import time
from pathlib import Path

import pytest

from dorylus.emulator import serve

from . import handlers

H = handlers.__name__
CODE_DIR = str(Path(handlers.__file__).parents[H.count(".")])
INVOKE = "/2015-03-31/functions/echo/invocations"


@pytest.fixture(scope="module")
def emulator():
    server = serve(functions={"echo": f"{H}:echo"}, concurrency=1, code_dirs=[CODE_DIR])
    try:
        yield server
    finally:
        server.close()


def _reply(sock: socket.socket) -> tuple[bytes, dict]:
    """Read one reply (status line and headers, then a Content-Length body)."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = sock.recv(65536)
        assert chunk, f"connection closed before a reply: {data!r}"
        data += chunk
    head, _, body = data.partition(b"\r\n\r\n")
    status, *lines = head.decode().split("\r\n")
    headers = {k.lower(): v.strip() for k, _, v in (line.partition(":") for line in lines)}
    while len(body) < int(headers["content-length"]):
        body += sock.recv(65536)
    return status.encode(), {**headers, "body": json.loads(body)}


def test_declared_body_over_the_limit_is_refused_before_it_is_sent(emulator):
    with socket.create_connection((emulator.host, emulator.port), timeout=5) as sock:
        sock.sendall(f"POST {INVOKE} HTTP/1.1\r\nHost: x\r\nContent-Length: {10 ** 11}\r\n\r\n".encode())
        status, reply = _reply(sock)
    assert status.startswith(b"HTTP/1.1 413 ")
    assert reply["x-amzn-errortype"] == "RequestTooLargeException"
    assert reply["body"]["message"] == "Request must be smaller than 6291456 bytes"


def test_malformed_chunked_body_is_an_api_error(emulator):
    with socket.create_connection((emulator.host, emulator.port), timeout=5) as sock:
        sock.sendall(f"POST {INVOKE} HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n"
                     "zz\r\n{}\r\n0\r\n\r\n".encode())
        status, reply = _reply(sock)
    assert status.startswith(b"HTTP/1.") and b" 400 " in status
    assert reply["x-amzn-errortype"] == "InvalidRequestContentException"
    assert reply["body"]["message"]  # the parser's words for it


def test_unsupported_method_is_501_and_closes_the_connection(emulator):
    connection = http.client.HTTPConnection(emulator.host, emulator.port, timeout=5)
    try:
        connection.request("OPTIONS", INVOKE)
        response = connection.getresponse()
        body = json.loads(response.read())
        assert (response.status, response.getheader("x-amzn-ErrorType")) == (501, "UnknownOperationException")
        assert response.getheader("Connection") == "close" and body["message"] == "Unsupported method 'OPTIONS'"
    finally:
        connection.close()


def test_close_ends_idle_keep_alive_connections():
    server = serve(functions={"echo": f"{H}:echo"}, concurrency=1, code_dirs=[CODE_DIR])
    try:
        connection = http.client.HTTPConnection(server.host, server.port, timeout=5)
        connection.request("POST", INVOKE, body=b"{}")
        assert connection.getresponse().read() and connection.sock is not None  # kept alive
        started = time.monotonic()
    finally:
        server.close()
    try:
        assert time.monotonic() - started < 5
        assert connection.sock.recv(1) == b""  # the server closed its end
    finally:
        connection.close()
