"""The spot watcher (dorylus/spot.py) against a fake instance metadata service: aiohttp on
127.0.0.1 (a free port), in a thread of its own, stopped by every test that starts it."""

from __future__ import annotations

import argparse
import asyncio
import json
import socket
import threading
import time

import aiohttp
import pytest
from aiohttp import web

from dorylus import spot


class FakeImds:
    """IMDSv2 as far as the watcher uses it: PUT /latest/api/token (TTL header required, tokens
    expire after their TTL), GETs that need a live token (401 otherwise), 404 for a path with no
    notice. ``notices[path] = body`` posts one; ``revoke()`` invalidates every token."""

    def __init__(self) -> None:
        self.notices: dict[str, str] = {}
        self.tokens: dict[str, float] = {}  # token -> expiry (monotonic)
        self.token_requests = 0
        self.unauthorized = 0
        self.gets: list[str] = []
        self.fail_with: int | None = None  # answer every GET with this status
        self._lock = threading.Lock()
        self._ready = threading.Event()
        self._loop: asyncio.AbstractEventLoop | None = None
        self._runner: web.AppRunner | None = None
        self.url = ""

    async def _token(self, request: web.Request) -> web.Response:
        ttl = request.headers.get(spot.TOKEN_TTL_HEADER)
        if ttl is None or not ttl.isdigit() or not 1 <= int(ttl) <= 21600:
            return web.Response(status=400)
        with self._lock:
            self.token_requests += 1
            token = f"token-{self.token_requests}"
            self.tokens[token] = time.monotonic() + int(ttl)
        return web.Response(text=token)

    async def _get(self, request: web.Request) -> web.Response:
        with self._lock:
            self.gets.append(request.path)
            expiry = self.tokens.get(request.headers.get(spot.TOKEN_HEADER, ""))
            if expiry is None or time.monotonic() >= expiry:
                self.unauthorized += 1
                return web.Response(status=401)
            if self.fail_with is not None:
                return web.Response(status=self.fail_with)
            body = self.notices.get(request.path)
        return web.Response(status=404) if body is None else web.Response(text=body)

    def revoke(self) -> None:
        with self._lock:
            self.tokens.clear()

    def start(self) -> "FakeImds":
        def serve() -> None:
            self._loop = asyncio.new_event_loop()
            app = web.Application()
            app.router.add_put(spot.TOKEN_PATH, self._token)
            app.router.add_get("/latest/meta-data/{tail:.*}", self._get)
            self._runner = web.AppRunner(app)
            self._loop.run_until_complete(self._runner.setup())
            site = web.TCPSite(self._runner, "127.0.0.1", 0)
            self._loop.run_until_complete(site.start())
            port = site._server.sockets[0].getsockname()[1]
            self.url = f"http://127.0.0.1:{port}"
            self._ready.set()
            self._loop.run_forever()
            self._loop.run_until_complete(self._runner.cleanup())
            self._loop.close()

        self._thread = threading.Thread(target=serve, daemon=True)
        self._thread.start()
        assert self._ready.wait(10)
        return self

    def stop(self) -> None:
        assert self._loop is not None
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(10)
        assert not self._thread.is_alive()


@pytest.fixture
def imds():
    fake = FakeImds().start()
    try:
        yield fake
    finally:
        fake.stop()


def poll(watcher: spot.SpotWatcher) -> list[spot.Notice]:
    """One poll from this thread, in a session of its own."""
    async def once():
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            return await watcher.poll(session)

    return asyncio.run(once())


def test_no_notice_calls_nothing(imds):
    got = []
    watcher = spot.SpotWatcher(imds.url, got.append)
    assert poll(watcher) == [] and poll(watcher) == []
    assert got == [] and watcher.polls == 2
    assert set(imds.gets) == set(spot.PATHS.values())
    assert imds.token_requests == 1  # one token serves both rounds


def records(caplog) -> list[tuple[str, str]]:
    """(level, message) of the spot watcher's records."""
    return [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "dorylus.spot"]


def test_spot_notice_is_reported_once(imds, caplog):
    got = []
    watcher = spot.SpotWatcher(imds.url, got.append)
    assert poll(watcher) == []
    imds.notices[spot.PATHS["spot"]] = json.dumps({"action": "terminate", "time": "2025-01-01T00:02:00Z"})
    notice = spot.Notice("spot", "terminate", "2025-01-01T00:02:00Z")
    assert poll(watcher) == [notice] and got == [notice]
    assert poll(watcher) == [] and got == [notice]  # the same notice again: not reported twice
    assert notice.describe() == "spot terminate at 2025-01-01T00:02:00Z"
    assert records(caplog) == [("WARNING", "spot watch: notice: spot terminate at 2025-01-01T00:02:00Z")]
    # A changed notice (AWS may move the time) is a new one.
    imds.notices[spot.PATHS["spot"]] = json.dumps({"action": "terminate", "time": "2025-01-01T00:03:00Z"})
    assert [n.time for n in poll(watcher)] == ["2025-01-01T00:03:00Z"] and len(got) == 2


def test_rebalance_and_autoscaling_termination_are_notices(imds):
    got = []
    watcher = spot.SpotWatcher(imds.url, got.append)
    imds.notices[spot.PATHS["autoscaling"]] = "InService"
    assert poll(watcher) == []  # in a group, not leaving it
    imds.notices[spot.PATHS["rebalance"]] = json.dumps({"noticeTime": "2025-01-01T00:00:00Z"})
    imds.notices[spot.PATHS["autoscaling"]] = "Terminated"
    assert [(n.kind, n.action, n.time) for n in poll(watcher)] == [
        ("rebalance", "rebalance", "2025-01-01T00:00:00Z"), ("autoscaling", "Terminated", "")]
    assert [n.kind for n in got] == ["rebalance", "autoscaling"]


def test_an_expired_token_is_renewed_before_it_is_refused(imds):
    got = []
    # A 1-second token: renewed 0.1 s before it ends, so no GET ever meets an expired one.
    watcher = spot.SpotWatcher(imds.url, got.append, token_ttl_s=1)
    assert poll(watcher) == []
    time.sleep(1.0)
    imds.notices[spot.PATHS["spot"]] = json.dumps({"action": "stop", "time": "2025-01-01T00:02:00Z"})
    assert [n.action for n in poll(watcher)] == ["stop"]
    assert imds.token_requests == 2 and imds.unauthorized == 0


def test_a_revoked_token_is_replaced_within_the_same_poll(imds):
    got = []
    watcher = spot.SpotWatcher(imds.url, got.append)
    assert poll(watcher) == []
    imds.revoke()  # e.g. the service restarted: the token the watcher holds is refused
    imds.notices[spot.PATHS["spot"]] = json.dumps({"action": "terminate", "time": "2025-01-01T00:02:00Z"})
    assert [n.action for n in poll(watcher)] == ["terminate"]
    assert imds.unauthorized == 1 and imds.token_requests == 2


def test_failures_are_logged_retried_and_never_raise_into_the_host(imds, caplog):
    """A failing service, then an unreachable one, then a healthy one with a notice: the
    watcher's thread logs, keeps polling, and reports the notice; a callback that raises is
    logged too."""
    got = []
    seen = threading.Event()

    def on_notice(notice):
        got.append(notice)
        seen.set()
        raise RuntimeError("host handler broke")

    imds.fail_with = 500
    watcher = spot.SpotWatcher(imds.url, on_notice, interval_s=0.05).start()
    try:
        deadline = time.monotonic() + 10
        while watcher.failures < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert watcher.failures >= 3
        failures = [(level, line) for level, line in records(caplog) if "failed" in line]
        assert len(failures) == 1  # the first failure only (then every 100th)
        assert failures[0][0] == "WARNING" and "answered HTTP 500" in failures[0][1] and imds.url in failures[0][1]
        imds.fail_with = None
        imds.notices[spot.PATHS["spot"]] = json.dumps({"action": "terminate", "time": "2025-01-01T00:02:00Z"})
        assert seen.wait(10)
        assert watcher._thread.is_alive()  # the raising handler did not end the watch
        broke = ("ERROR", "spot watch: notice handler failed: RuntimeError: host handler broke")
        deadline = time.monotonic() + 10  # logged by the watcher's thread after on_notice raised
        while broke not in records(caplog) and time.monotonic() < deadline:
            time.sleep(0.02)
        assert broke in records(caplog)
    finally:
        watcher.stop()
    assert not watcher._thread.is_alive() and [n.action for n in got] == ["terminate"]


def test_an_unreachable_service_is_retried_without_crashing(caplog):
    with socket.socket() as s:  # a port nothing listens on: bound, never listening, closed after
        s.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{s.getsockname()[1]}"
        watcher = spot.SpotWatcher(url, lambda n: None, interval_s=0.05, timeout_s=0.5).start()
        try:
            deadline = time.monotonic() + 10
            while watcher.failures < 2 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert watcher.failures >= 2 and watcher._thread.is_alive()
        finally:
            watcher.stop()
    assert not watcher._thread.is_alive()
    lines = [line for _, line in records(caplog)]
    assert len(lines) == 1 and "retrying every 0.05 s" in lines[0] and "ClientConnectorError" in lines[0]


@pytest.mark.parametrize("body", ["[]", '{"action": 3}', "not json"])
def test_a_malformed_notice_is_a_failure_not_a_notice(imds, body):
    got = []
    watcher = spot.SpotWatcher(imds.url, got.append)
    imds.notices[spot.PATHS["spot"]] = body
    with pytest.raises(ValueError):
        poll(watcher)
    assert got == []


def test_the_option():
    parser = argparse.ArgumentParser(exit_on_error=False)
    spot.add_argument(parser)
    assert parser.parse_args([]).spot_watch is None
    assert parser.parse_args(["--spot-watch", "off"]).spot_watch is None
    assert parser.parse_args(["--spot-watch", spot.IMDS_URL]).spot_watch == spot.IMDS_URL
    assert spot.start_from_args(parser.parse_args([]), lambda n: None, "test") is None
    for bad in ("https://169.254.169.254", "169.254.169.254", "http://x/latest", "http://:80", "http://h:99999"):
        with pytest.raises(argparse.ArgumentError, match="expected off or http://HOST|bad port"):
            parser.parse_args(["--spot-watch", bad])


@pytest.mark.parametrize("role", ["graphserver", "paramserver"])
def test_both_roles_take_the_option(role):
    from dorylus.cli import build_parser

    common = ["--config", "c.json"] + (["--store", "s", "--part", "0", "--param-server", "tcp://127.0.0.1:1"]
                                       if role == "graphserver" else ["--num-features", "2", "--num-classes", "2"])
    parser = build_parser()
    assert parser.parse_args([role, *common]).spot_watch is None  # off unless asked for
    assert parser.parse_args([role, *common, "--spot-watch", spot.IMDS_URL]).spot_watch == spot.IMDS_URL


def test_the_poll_interval_option():
    parser = argparse.ArgumentParser(exit_on_error=False)
    spot.add_argument(parser)
    assert parser.parse_args([]).spot_watch_interval_s == spot.INTERVAL_S
    assert parser.parse_args(["--spot-watch-interval-s", "0.1"]).spot_watch_interval_s == 0.1
    for bad in ("0", "-1", "61", "nan", "soon"):
        with pytest.raises(argparse.ArgumentError, match="must be in|expected seconds"):
            parser.parse_args(["--spot-watch-interval-s", bad])


def test_the_local_imds_posts_a_notice_the_watcher_reads():
    """--preempt's metadata service: tokens enforced, 404 until the notice, then the spot
    instance-action the watcher parses."""
    imds = spot.LocalImds()
    got: list[spot.Notice] = []
    watcher = spot.SpotWatcher(imds.url, got.append, interval_s=0.05)
    try:
        poll(watcher)
        assert got == [] and watcher.failures == 0
        imds.interrupt("terminate", seconds=120)
        poll(watcher)
        assert [(n.kind, n.action) for n in got] == [("spot", "terminate")] and got[0].time.endswith("Z")
        watcher._token = "forged"
        watcher._token_expires = float("inf")
        poll(watcher)  # a refused token is replaced within the poll
        assert len(got) == 1 and watcher.failures == 0
    finally:
        imds.close()


def test_the_local_imds_refuses_a_token_request_without_a_ttl_and_closes_once():
    """IMDSv2's rule (a token PUT names its TTL), and close(): the port stops answering, the
    thread ends, and a second close does nothing."""
    imds = spot.LocalImds()

    async def put(headers):
        async with aiohttp.ClientSession(timeout=aiohttp.ClientTimeout(total=5)) as session:
            async with session.put(imds.url + spot.TOKEN_PATH, headers=headers) as r:
                return r.status, await r.text()

    try:
        assert asyncio.run(put({}))[0] == 400
        assert asyncio.run(put({spot.TOKEN_TTL_HEADER: "60"})) == (200, imds.token)
    finally:
        imds.close()
    imds.close()
    assert not imds._thread.is_alive()
    port = int(imds.url.rsplit(":", 1)[1])
    with pytest.raises(OSError):
        socket.create_connection(("127.0.0.1", port), timeout=2).close()
