"""The Lambda emulator through real SDK clients (boto3 and aiobotocore) and raw HTTP."""

from __future__ import annotations

import asyncio
import base64
import datetime
import http.client
import json
import math
import os
import queue
import re
import signal
import socket
import subprocess
import sys
import threading
import time
import urllib.request
import uuid
from pathlib import Path

import boto3
import pytest
from aiobotocore.config import AioConfig
from aiobotocore.session import get_session
from botocore.config import Config

from dorylus.emulator import EVENT_PAYLOAD_LIMIT, SYNC_PAYLOAD_LIMIT, serve
from dorylus.errors import ConfigError

from . import handlers

H = handlers.__name__
FUNCTIONS = {name: f"{H}:{name}" for name in (
    "echo", "sleep", "noop", "fail", "crash", "unserializable", "chatty", "logs", "touch", "big")}
FUNCTIONS["missing-attr"] = f"{H}:does_not_exist"
FUNCTIONS["broken-import"] = f"{H.rpartition('.')[0]}.broken_handler:handler".lstrip(".")
# The directory from which H imports; pytest does not leave it on sys.path for the workers.
CODE_DIR = str(Path(handlers.__file__).parents[H.count(".")])
MEMORY_MB = 512
TIMEOUT_S = 1.0
CLIENT_KW = dict(aws_access_key_id="x", aws_secret_access_key="x")


def wait_until(predicate, timeout_s: float = 10.0, what: str = "condition"):
    give_up = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > give_up:
            raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")
        time.sleep(0.02)


def wait_idle(server) -> None:
    wait_until(lambda: server.stats()["in_flight"] == 0, what="no calls in flight")


def boto_client(server, region: str = "us-east-1"):
    return boto3.client("lambda", endpoint_url=server.url, region_name=region,
                        config=Config(retries={"max_attempts": 0}), **CLIENT_KW)


async def _aio_calls(url: str, calls: list[dict]) -> list:
    """Run the ``invoke`` kwargs in ``calls`` concurrently; -> (response, payload) or exception."""
    session = get_session()
    async with session.create_client("lambda", endpoint_url=url, region_name="us-east-1",
                                     config=AioConfig(retries={"max_attempts": 0}),
                                     **CLIENT_KW) as client:
        async def one(kwargs):
            try:
                response = await client.invoke(**kwargs)
                return response, await response["Payload"].read()
            except Exception as exc:  # returned, so the test can inspect it
                return exc
        return await asyncio.gather(*(one(kwargs) for kwargs in calls))


def aio_invoke(server, *calls: dict) -> list:
    return asyncio.run(asyncio.wait_for(_aio_calls(server.url, list(calls)), 30))


@pytest.fixture(scope="module")
def emulator():
    server = serve(functions=FUNCTIONS, concurrency=2, memory_mb=MEMORY_MB, timeout_s=TIMEOUT_S,
                   code_dirs=[CODE_DIR])
    try:
        yield server
    finally:
        server.close()


@pytest.fixture
def client(emulator):
    wait_idle(emulator)  # a previous test's Event calls must not hold slots
    client = boto_client(emulator)
    yield client
    client.close()
    wait_idle(emulator)


def assert_pool_healthy(client, marker: Path, size: int = 2) -> None:
    """``size`` Event calls that overlap in time all run: every worker is alive."""
    for _ in range(size):
        r = client.invoke(FunctionName="sleep", InvocationType="Event",
                          Payload=json.dumps({"seconds": 0.3, "marker": str(marker)}))
        assert r["StatusCode"] == 202
    wait_until(lambda: marker.exists() and len(marker.read_text().split()) == size,
               what=f"{size} overlapping calls to finish")


def test_request_response_round_trip(client):
    r = client.invoke(FunctionName="echo", Payload=json.dumps({"a": [1, 2.5, "x"], "b": None}))
    assert r["StatusCode"] == 200
    assert r["ExecutedVersion"] == "$LATEST"
    result = json.loads(r["Payload"].read())
    assert result["event"] == {"a": [1, 2.5, "x"], "b": None}
    assert result["env_function_name"] == "echo"


def test_empty_payload_is_an_empty_event(client):
    assert json.loads(client.invoke(FunctionName="echo")["Payload"].read())["event"] == {}


def test_context_fields(emulator):
    client = boto_client(emulator, region="eu-west-1")
    results = []
    for _ in range(2):
        r = client.invoke(FunctionName="echo")
        results.append((r["ResponseMetadata"]["RequestId"], json.loads(r["Payload"].read())))
    (id1, first), (id2, second) = results
    context = first["context"]
    assert context["function_name"] == "echo"
    assert context["function_version"] == "$LATEST"
    assert context["invoked_function_arn"] == "arn:aws:lambda:eu-west-1:123456789012:function:echo"
    assert context["memory_limit_in_mb"] == str(MEMORY_MB)  # a string, as in AWS's runtime
    assert context["log_group_name"] == "/aws/lambda/echo"
    assert re.fullmatch(r"\d{4}/\d\d/\d\d/\[\$LATEST\][0-9a-f]{32}", context["log_stream_name"])
    assert context["aws_request_id"] == id1 and second["context"]["aws_request_id"] == id2
    assert id1 != id2 and uuid.UUID(id1).version == 4
    remaining_first, remaining_second = first["remaining_ms"]
    assert TIMEOUT_S * 1000 >= remaining_first > remaining_second >= 0
    assert remaining_first - remaining_second >= 15  # the handler slept 20 ms in between


def test_function_name_as_arn_with_qualifier(client):
    r = client.invoke(FunctionName="arn:aws:lambda:us-east-1:123456789012:function:echo",
                      Qualifier="$LATEST")
    arn = json.loads(r["Payload"].read())["context"]["invoked_function_arn"]
    assert arn == "arn:aws:lambda:us-east-1:123456789012:function:echo:$LATEST"
    r = client.invoke(FunctionName="123456789012:function:echo")
    assert r["StatusCode"] == 200 and "FunctionError" not in r


def test_aiobotocore_round_trip_concurrent(emulator, client):
    outcomes = aio_invoke(emulator, {"FunctionName": "echo", "Payload": b'{"i": 0}'},
                          {"FunctionName": "echo", "Payload": b'{"i": 1}'})
    for i, (response, payload) in enumerate(outcomes):
        assert response["StatusCode"] == 200 and "FunctionError" not in response
        assert json.loads(payload)["event"] == {"i": i}


def test_event_runs_asynchronously(emulator, client, tmp_path):
    marker = tmp_path / "ran"
    before = emulator.stats()["invocations"]
    r = client.invoke(FunctionName="touch", InvocationType="Event",
                      Payload=json.dumps({"marker": str(marker)}))
    assert r["StatusCode"] == 202
    assert r["Payload"].read() == b""
    wait_until(marker.exists, what="the Event call to run")
    assert marker.read_text() == r["ResponseMetadata"]["RequestId"]
    assert emulator.stats()["invocations"] == before + 1


def test_dry_run_runs_nothing(emulator, client, tmp_path):
    marker = tmp_path / "ran"
    before = emulator.stats()
    r = client.invoke(FunctionName="touch", InvocationType="DryRun",
                      Payload=json.dumps({"marker": str(marker)}))
    assert r["StatusCode"] == 204
    time.sleep(0.3)
    assert not marker.exists()
    after = emulator.stats()
    assert after["invocations"] == before["invocations"]
    assert after["dry_runs"] == before["dry_runs"] + 1


def test_handler_exception_is_unhandled_function_error(emulator, client):
    before = emulator.stats()["errors"]
    r = client.invoke(FunctionName="fail", Payload=b'{"message": "bad input row 7"}')
    assert r["StatusCode"] == 200
    assert r["FunctionError"] == "Unhandled"
    error = json.loads(r["Payload"].read())
    assert error["errorMessage"] == "bad input row 7"
    assert error["errorType"] == "ValueError"
    assert any("handlers.py" in frame and "in fail" in frame for frame in error["stackTrace"])
    assert emulator.stats()["errors"] == before + 1
    [(response, payload)] = aio_invoke(emulator, {"FunctionName": "fail"})
    assert response["FunctionError"] == "Unhandled"
    assert json.loads(payload)["errorMessage"] == "boom"


@pytest.mark.parametrize("function, error_type, message", [
    ("unserializable", "Runtime.MarshalError", "Unable to marshal response"),
    ("missing-attr", "Runtime.HandlerNotFound", "Handler 'does_not_exist' missing"),
    ("broken-import", "Runtime.ImportModuleError", "this module is broken on purpose"),
    ("big", "Function.ResponseSizeTooLarge", "Response payload size exceeded"),
])
def test_runtime_errors(client, function, error_type, message):
    r = client.invoke(FunctionName=function, Payload=json.dumps({"n": SYNC_PAYLOAD_LIMIT}))
    assert r["FunctionError"] == "Unhandled"
    error = json.loads(r["Payload"].read())
    assert error["errorType"] == error_type
    assert message in error["errorMessage"]


def test_timeout_is_function_error_and_pool_recovers(emulator, client, tmp_path):
    start = time.monotonic()
    r = client.invoke(FunctionName="sleep", Payload=b'{"seconds": 30}')
    assert time.monotonic() - start < 10
    assert r["FunctionError"] == "Unhandled"
    error = json.loads(r["Payload"].read())
    assert error["errorType"] == "Sandbox.Timedout"
    assert "Task timed out after 1.00 seconds" in error["errorMessage"]
    # A timed-out call bills the whole timeout.
    assert r["ResponseMetadata"]["HTTPHeaders"]["x-dorylus-billed-ms"] == "1000"
    assert_pool_healthy(client, tmp_path / "after-timeout")


def test_worker_crash_is_function_error_and_pool_recovers(client, tmp_path):
    r = client.invoke(FunctionName="crash")
    assert r["FunctionError"] == "Unhandled"
    error = json.loads(r["Payload"].read())
    assert error["errorType"] == "Runtime.ExitError"
    assert "Runtime exited with error: exit status 3" in error["errorMessage"]
    assert_pool_healthy(client, tmp_path / "after-crash")


def test_unknown_function(emulator, client):
    with pytest.raises(client.exceptions.ResourceNotFoundException) as info:
        client.invoke(FunctionName="no-such-function")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 404
    assert info.value.response["Error"]["Message"] == (
        "Function not found: arn:aws:lambda:us-east-1:123456789012:function:no-such-function")
    [exc] = aio_invoke(emulator, {"FunctionName": "no-such-function"})
    assert exc.response["Error"]["Code"] == "ResourceNotFoundException"


@pytest.fixture
def patient_emulator():
    """Like ``emulator``, with a timeout long enough for handlers that hold their slot for
    seconds (a loaded machine needs that long to send the calls that must be throttled)."""
    server = serve(functions=FUNCTIONS, concurrency=2, memory_mb=MEMORY_MB, timeout_s=30, code_dirs=[CODE_DIR])
    try:
        yield server
    finally:
        server.close()


def test_concurrency_limit_throttles(patient_emulator, tmp_path):
    emulator = patient_emulator
    client = boto_client(emulator)
    marker = tmp_path / "events"
    before = emulator.stats()["throttles"]
    # Both slots taken (admission happens before the 202) for long enough that a loaded machine
    # still sends the next two calls while they run.
    for _ in range(2):
        assert client.invoke(FunctionName="sleep", InvocationType="Event",
                             Payload=json.dumps({"seconds": 3.0, "marker": str(marker)})
                             )["StatusCode"] == 202
    with pytest.raises(client.exceptions.TooManyRequestsException) as info:
        client.invoke(FunctionName="echo")
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 429
    assert info.value.response["Reason"] == "ConcurrentInvocationLimitExceeded"
    [exc] = aio_invoke(emulator, {"FunctionName": "echo"})
    assert exc.response["Error"]["Code"] == "TooManyRequestsException"
    stats = emulator.stats()
    assert stats["throttles"] == before + 2
    assert stats["peak_concurrency"] == 2
    wait_until(lambda: marker.exists() and len(marker.read_text().split()) == 2,
               what="the throttling calls to finish")
    wait_idle(emulator)
    assert client.invoke(FunctionName="echo")["StatusCode"] == 200
    client.close()


def _json_payload(size: int) -> bytes:
    payload = b'{"pad": "' + b"a" * (size - 11) + b'"}'
    assert len(payload) == size
    return payload


@pytest.mark.parametrize("invocation_type, limit, accepted_status", [
    ("RequestResponse", SYNC_PAYLOAD_LIMIT, 200), ("Event", EVENT_PAYLOAD_LIMIT, 202)])
def test_payload_size_limits(client, invocation_type, limit, accepted_status):
    assert limit == {"RequestResponse": 6_291_456, "Event": 262_144}[invocation_type]
    r = client.invoke(FunctionName="noop", InvocationType=invocation_type,
                      Payload=_json_payload(limit))
    assert r["StatusCode"] == accepted_status and "FunctionError" not in r
    with pytest.raises(client.exceptions.RequestTooLargeException) as info:
        client.invoke(FunctionName="noop", InvocationType=invocation_type,
                      Payload=_json_payload(limit + 1))
    assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 413


def test_invalid_json_payload(client):
    for payload in (b"{not json", b"\xff\xfe\x00garbage"):
        with pytest.raises(client.exceptions.InvalidRequestContentException) as info:
            client.invoke(FunctionName="echo", Payload=payload)
        assert info.value.response["ResponseMetadata"]["HTTPStatusCode"] == 400
        assert "Could not parse request body into json" in info.value.response["Error"]["Message"]


def test_unknown_invocation_type(client):
    with pytest.raises(client.exceptions.InvalidParameterValueException):
        client.invoke(FunctionName="echo", InvocationType="Sometime")


def _raw_exchange(server, data: bytes) -> bytes:
    with socket.create_connection((server.host, server.port), timeout=5) as sock:
        sock.sendall(data)
        chunks = []
        while chunk := sock.recv(65536):
            chunks.append(chunk)
    return b"".join(chunks)


def test_bad_requests_get_api_errors_and_server_survives(emulator, client):
    for garbage in (b"\x16\x03\x01\x02\x00garbage with no structure\r\n\r\n",
                    b"NOTAMETHOD /x HTTP/1.1\r\nHost: a\r\n\r\n",
                    b"POST /2015-03-31/functions/echo/invocations HTTP/1.1\r\n"
                    b"Content-Length: -5\r\nConnection: close\r\n\r\n"):
        reply = _raw_exchange(emulator, garbage)
        head, _, body = reply.partition(b"\r\n\r\n")
        assert re.match(rb"HTTP/1\.[01] (400|501) ", head), reply[:200]
        assert b"x-amzn-ErrorType" in head
        assert json.loads(body)["message"]  # a JSON error, not a stack trace or HTML
    connection = http.client.HTTPConnection(emulator.host, emulator.port, timeout=5)
    try:
        for method, path, status, code in [
                ("GET", "/nope", 404, "UnknownOperationException"),
                ("GET", "/2015-03-31/functions/echo/invocations", 405,
                 "MethodNotAllowedException"),
                ("POST", "/emulator/health", 405, "MethodNotAllowedException")]:
            connection.request(method, path, body=b"{}" if method == "POST" else None)
            response = connection.getresponse()
            body = json.loads(response.read())
            assert (response.status, response.getheader("x-amzn-ErrorType")) == (status, code)
            assert body["Type"] == "User" and body["message"]
    finally:
        connection.close()
    assert client.invoke(FunctionName="echo")["StatusCode"] == 200


def test_chunked_request_body(emulator, client):
    connection = http.client.HTTPConnection(emulator.host, emulator.port, timeout=5)
    try:
        connection.request("POST", "/2015-03-31/functions/echo/invocations",
                           body=iter([b'{"chunked"', b': true}']), encode_chunked=True)
        response = connection.getresponse()
        assert response.status == 200
        assert json.loads(response.read())["event"] == {"chunked": True}
    finally:
        connection.close()


def test_billing(emulator, client):
    emulator.reset_stats()
    headers, walls = [], []
    for seconds in (0.05, 0.08):
        start = time.monotonic()
        r = client.invoke(FunctionName="sleep", Payload=json.dumps({"seconds": seconds}))
        walls.append((time.monotonic() - start) * 1000)
        headers.append(r["ResponseMetadata"]["HTTPHeaders"])
        assert "FunctionError" not in r
    billed = [int(h["x-dorylus-billed-ms"]) for h in headers]
    durations = [float(h["x-dorylus-duration-ms"]) for h in headers]
    assert billed == [math.ceil(d) for d in durations]
    for d, seconds, wall in zip(durations, (0.05, 0.08), walls):
        assert seconds * 1000 <= d <= wall  # the handler's sleep, within the client's wait
    stats = emulator.stats()
    assert stats["invocations"] == 2 and stats["errors"] == 0
    assert stats["billed_ms"] == sum(billed)
    assert stats["billed_gb_s"] == pytest.approx(sum(billed) / 1000 * MEMORY_MB / 1024)
    assert stats["duration_ms"] == pytest.approx(sum(durations), abs=1e-3)


def test_stats_and_health_over_http(emulator, client):
    client.invoke(FunctionName="noop")
    with urllib.request.urlopen(f"{emulator.url}/emulator/health", timeout=5) as response:
        assert response.status == 200 and json.loads(response.read())["status"] == "ok"
    with urllib.request.urlopen(f"{emulator.url}/emulator/stats", timeout=5) as response:
        assert json.loads(response.read()) == emulator.stats()
    reset = urllib.request.Request(f"{emulator.url}/emulator/stats/reset", method="POST")
    with urllib.request.urlopen(reset, timeout=5) as response:
        stats = json.loads(response.read())
    assert stats["invocations"] == stats["billed_ms"] == stats["throttles"] == 0
    assert stats["memory_mb"] == MEMORY_MB and stats["concurrency"] == 2


def test_log_tail(client):
    r = client.invoke(FunctionName="chatty", LogType="Tail", Payload=b'{"word": "bird"}')
    log = base64.b64decode(r["LogResult"]).decode()
    request_id = r["ResponseMetadata"]["RequestId"]
    billed = r["ResponseMetadata"]["HTTPHeaders"]["x-dorylus-billed-ms"]
    assert log.startswith(f"START RequestId: {request_id}")
    assert "hello from chatty: bird\n" in log
    assert f"REPORT RequestId: {request_id}\t" in log
    assert f"Billed Duration: {billed} ms\tMemory Size: {MEMORY_MB} MB" in log
    r = client.invoke(FunctionName="chatty", LogType="Tail",
                      Payload=b'{"word": "bird", "lines": 500}')
    log = base64.b64decode(r["LogResult"])
    assert len(log) == 4096 and b"REPORT RequestId" in log  # the last 4 KB
    assert "LogResult" not in client.invoke(FunctionName="chatty", Payload=b'{"word": "x"}')


def test_handler_records_reach_the_call_log_as_lambda_writes_them(client):
    before = datetime.datetime.now(datetime.timezone.utc).replace(tzinfo=None)
    r = client.invoke(FunctionName="logs", LogType="Tail", Payload=b'{"word": "bird"}')
    log = base64.b64decode(r["LogResult"]).decode()
    request_id = r["ResponseMetadata"]["RequestId"]
    match = re.search(rf"^\[INFO\]\t(\S+)Z\t{request_id}\tsaid: bird$", log, re.MULTILINE)
    assert match, log
    when = datetime.datetime.strptime(match[1], "%Y-%m-%dT%H:%M:%S.%f")  # UTC, as CloudWatch shows it
    assert before - datetime.timedelta(seconds=1) <= when <= datetime.datetime.now(datetime.timezone.utc).replace(
        tzinfo=None)
    assert "below the root's level" not in log


def test_start_latency_is_not_billed():
    with serve(functions={"noop": FUNCTIONS["noop"]}, concurrency=1, memory_mb=128,
               timeout_s=2.0, start_latency_ms=300, code_dirs=[CODE_DIR]) as server:
        client = boto_client(server)
        start = time.monotonic()
        r = client.invoke(FunctionName="noop")
        wall_ms = (time.monotonic() - start) * 1000
        assert wall_ms >= 300
        assert int(r["ResponseMetadata"]["HTTPHeaders"]["x-dorylus-billed-ms"]) < 100
        assert server.stats()["billed_gb_s"] == pytest.approx(
            server.stats()["billed_ms"] / 1000 * 128 / 1024)


@pytest.mark.parametrize("functions, option, message", [
    ({"f": "no_such_module_for_dorylus:handler"}, {}, "is not on the Python path"),
    ({"f": "no_such_package_for_dorylus.mod:handler"}, {}, "cannot be imported"),
    ({"f": f"{H}.echo"}, {}, "is not of the form 'package.module:function'"),
    ({"bad name": f"{H}:echo"}, {}, "is not a valid Lambda name"),
    ({}, {}, "no functions registered"),
    ({"f": f"{H}:echo"}, {"memory_mb": 64}, "outside Lambda's range"),
    ({"f": f"{H}:echo"}, {"timeout_s": 901}, "outside (0, 900]"),
    ({"f": f"{H}:echo"}, {"concurrency": 0}, "concurrency must be >= 1"),
])
def test_bad_configuration_is_a_clear_error(functions, option, message):
    with pytest.raises(ConfigError, match=re.escape(message)):
        serve(functions=functions, code_dirs=[CODE_DIR], **option)
    with pytest.raises(ConfigError, match="code directory '/no/such/dir' does not exist"):
        serve(functions={"f": f"{H}:echo"}, code_dirs=["/no/such/dir"])


def test_port_in_use_is_a_clear_error(emulator):
    with pytest.raises(ConfigError, match="cannot listen on"):
        serve(port=emulator.port, functions={"f": f"{H}:echo"}, concurrency=1,
              code_dirs=[CODE_DIR])


def test_cli_serves_until_sigterm():
    """``run_from_args`` logs its URL, serves, and exits 0 on SIGTERM."""
    code = ("import argparse, sys\n"
            "from dorylus.emulator import add_arguments, run_from_args\n"
            "parser = argparse.ArgumentParser()\nadd_arguments(parser)\n"
            "sys.exit(run_from_args(parser.parse_args(sys.argv[1:])))\n")
    process = subprocess.Popen(
        [sys.executable, "-c", code, "--port", "0", "--concurrency", "1", "--memory-mb", "256",
         "--function", f"echo={H}:echo", "--code-dir", CODE_DIR],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        lines: queue.Queue[str] = queue.Queue()
        threading.Thread(target=lambda: lines.put(process.stderr.readline()), daemon=True).start()
        line = lines.get(timeout=30)
        match = re.fullmatch(rf"\S+ \S+ lambda-emulator\[{process.pid}\] INFO listening on "
                             r"(http://127\.0\.0\.1:\d+) \(concurrency 1, memory 256 MB\)\n", line)
        assert match, line
        client = boto3.client("lambda", endpoint_url=match.group(1), region_name="us-east-1",
                              config=Config(retries={"max_attempts": 0}), **CLIENT_KW)
        r = client.invoke(FunctionName="echo", Payload=b'{"via": "cli"}')
        assert json.loads(r["Payload"].read())["event"] == {"via": "cli"}
        process.send_signal(signal.SIGTERM)
        assert process.wait(timeout=15) == 0
        assert "Traceback" not in process.stderr.read()
    finally:
        if process.poll() is None:
            process.kill()
            process.wait(timeout=10)
        process.stdout.close()
        process.stderr.close()


def test_close_with_calls_in_flight_stops_everything(tmp_path):
    server = serve(functions={"sleep": FUNCTIONS["sleep"], "echo": FUNCTIONS["echo"]},
                   concurrency=2, timeout_s=60, code_dirs=[CODE_DIR])
    replies: list = []
    try:
        client = boto_client(server)
        pid = json.loads(client.invoke(FunctionName="echo")["Payload"].read())["pid"]
        client.invoke(FunctionName="sleep", InvocationType="Event", Payload=b'{"seconds": 30}')
        caller = threading.Thread(target=lambda: replies.append(_invoke_or_error(
            client, FunctionName="sleep", Payload=b'{"seconds": 30}')), daemon=True)
        caller.start()
        wait_until(lambda: server.stats()["in_flight"] == 2, what="two calls in flight")
    finally:
        start = time.monotonic()
        server.close()
        closed_in = time.monotonic() - start
    assert closed_in < 10
    caller.join(10)
    assert not caller.is_alive()
    # The interrupted call ends with an error, never a result.
    assert isinstance(replies[0], Exception) or replies[0].get("FunctionError") == "Unhandled"
    with pytest.raises(ProcessLookupError):
        os.kill(pid, 0)  # the worker is gone and reaped
    with pytest.raises(OSError):
        socket.create_connection((server.host, server.port), timeout=2).close()
    server.close()  # idempotent


def _invoke_or_error(client, **kwargs):
    try:
        return client.invoke(**kwargs)
    except Exception as exc:
        return exc


def test_function_environment_is_set_as_lambdas_configuration_sets_it():
    """``serve(environment=...)`` is the functions' environment (how the CURVE keys reach them)."""
    with serve(functions={"environment": f"{H}:environment"}, concurrency=1, code_dirs=[CODE_DIR],
               environment={"DORYLUS_CURVE_FUNCTION_PUBLIC": "k" * 40, "OTHER": "1"}) as server:
        client = boto_client(server)
        try:
            payload = client.invoke(FunctionName="environment", Payload=json.dumps(
                {"names": ["DORYLUS_CURVE_FUNCTION_PUBLIC", "OTHER", "AWS_LAMBDA_FUNCTION_NAME"]}))["Payload"]
            assert json.loads(payload.read()) == {"DORYLUS_CURVE_FUNCTION_PUBLIC": "k" * 40, "OTHER": "1",
                                                  "AWS_LAMBDA_FUNCTION_NAME": "environment"}
        finally:
            client.close()


def test_a_client_that_hangs_up_mid_call_leaves_the_call_to_finish_and_free_its_worker(emulator, tmp_path):
    marker = tmp_path / "done"
    body = json.dumps({"seconds": 0.5, "marker": str(marker)}).encode()
    connection = http.client.HTTPConnection(emulator.host, emulator.port, timeout=10)
    connection.request("POST", "/2015-03-31/functions/sleep/invocations", body=body,
                       headers={"Content-Type": "application/json"})
    wait_until(lambda: emulator.stats()["in_flight"] == 1, what="the call to start")
    connection.close()  # before the answer
    wait_until(marker.exists, what="the call to finish in its worker")
    wait_idle(emulator)  # its slot is free again
    client = boto_client(emulator)
    try:  # and both workers serve calls: none was left waiting for an answer no one reads
        for _ in range(2):
            r = client.invoke(FunctionName="echo", Payload=b'{"x": 1}')
            assert json.loads(r["Payload"].read())["event"] == {"x": 1} and "FunctionError" not in r
    finally:
        client.close()


@pytest.mark.parametrize("with_affinity", [True, False])
def test_affinity_places_a_call_on_the_warm_sandbox_of_its_key(with_affinity):
    """Two overlapping calls warm two sandboxes, "a"'s ending last; a later call of key "b" goes
    to "b"'s sandbox with the affinity and to the most recent one ("a"'s) without."""
    affinity = (lambda payload: json.loads(payload)["key"]) if with_affinity else None
    with serve(functions={"pid": f"{H}:pid"}, concurrency=3, memory_mb=128, timeout_s=30,
               code_dirs=[CODE_DIR], affinity=affinity) as server:
        def call(key: str, seconds: float) -> dict:
            return {"FunctionName": "pid", "Payload": json.dumps({"key": key, "seconds": seconds})}

        first = aio_invoke(server, call("a", 0.6), call("b", 0.0))
        pid_a, pid_b = (json.loads(payload) for _, payload in first)
        assert pid_a != pid_b
        (_, later), = aio_invoke(server, call("b", 0.0))
        assert json.loads(later) == (pid_b if with_affinity else pid_a)
        (_, again), = aio_invoke(server, call("a", 0.0))
        assert json.loads(again) == pid_a
