"""Watching for the end of this machine: spot interruptions and Auto Scaling terminations.

A spot instance learns two minutes ahead that AWS takes it back, a spot or on-demand instance
may get an earlier rebalance recommendation, and an instance in an Auto Scaling group with a
termination lifecycle hook (terraform/servers.tf) learns that the group is terminating it. All
three are read from the instance metadata service (IMDSv2: a session token from
``PUT /latest/api/token``, then GETs that carry it):

* ``/latest/meta-data/spot/instance-action``: ``{"action": "terminate"|"stop"|"hibernate",
  "time": "2025-01-01T00:02:00Z"}``, 404 while there is no notice;
* ``/latest/meta-data/events/recommendations/rebalance``: ``{"noticeTime": "..."}``, 404 before;
* ``/latest/meta-data/autoscaling/target-lifecycle-state``: ``"InService"``, or ``"Terminated"``
  once the group terminates the instance (404 outside a group).

:class:`SpotWatcher` polls them every ``interval_s`` in a thread of its own (the parameter
server has no event loop; the graph server's must not wait on HTTP) and calls ``on_notice``
once per distinct notice. It never raises into its host: an unreachable or failing metadata
service is logged (the first failure, then every hundredth), and polled again at the next
interval. The token is renewed before it expires and fetched again when the service refuses it.

``--spot-watch URL|off`` (``off`` by default; on EC2 ``http://169.254.169.254``, which
Terraform's user data passes on spot instances) starts one in ``dorylus graphserver`` and
``dorylus paramserver``, polling every ``--spot-watch-interval-s`` (5 s).

:class:`LocalImds` is the other end for a local run: ``dorylus train --preempt PART@EPOCH``
points graph server PART's watcher at one and posts the notice there at epoch EPOCH, so the
notice takes the path a real one takes.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import secrets
import socket
import threading
import time
from dataclasses import dataclass
from typing import Callable
from urllib.parse import urlsplit

import aiohttp

from dorylus.errors import ConfigError

logger = logging.getLogger(__name__)

IMDS_URL = "http://169.254.169.254"
TOKEN_PATH = "/latest/api/token"
TOKEN_TTL_HEADER = "X-aws-ec2-metadata-token-ttl-seconds"
TOKEN_HEADER = "X-aws-ec2-metadata-token"
# What each kind of notice is read from.
PATHS = {
    "spot": "/latest/meta-data/spot/instance-action",
    "rebalance": "/latest/meta-data/events/recommendations/rebalance",
    "autoscaling": "/latest/meta-data/autoscaling/target-lifecycle-state",
}
LOG_EVERY = 100  # failures logged after the first: one in this many (a dead IMDS must not fill the disk)
INTERVAL_S = 5.0
MAX_INTERVAL_S = 60.0  # a spot notice comes 120 s ahead: a slower watch would leave no time to checkpoint


@dataclass(frozen=True)
class Notice:
    """One notice: ``kind`` (a key of :data:`PATHS`), the ``action`` (terminate, stop,
    hibernate, rebalance, or the Auto Scaling target state) and its ``time`` (when the instance
    goes, or when the recommendation was made; "" when the service gives none)."""

    kind: str
    action: str
    time: str = ""

    def describe(self) -> str:
        """A short line for logs and for the coordinator (under the protocol's string limit)."""
        return f"{self.kind} {self.action}" + (f" at {self.time}" if self.time else "")


def parse_notice(kind: str, body: str) -> Notice | None:
    """The notice a path's 200 body holds, or None when the body is no notice (an Auto Scaling
    state other than Terminated). ValueError for a body that is not what AWS documents."""
    if kind == "autoscaling":
        state = body.strip()
        return Notice(kind, state) if state == "Terminated" else None
    doc = json.loads(body)
    if not isinstance(doc, dict):
        raise ValueError(f"{PATHS[kind]}: expected a JSON object, got {body[:80]!r}")
    if kind == "spot":
        action, when = doc.get("action"), doc.get("time", "")
        if not isinstance(action, str) or not isinstance(when, str):
            raise ValueError(f"{PATHS[kind]}: expected string action and time, got {body[:80]!r}")
        return Notice(kind, action, when)
    when = doc.get("noticeTime", "")
    if not isinstance(when, str):
        raise ValueError(f"{PATHS[kind]}: expected a string noticeTime, got {body[:80]!r}")
    return Notice(kind, "rebalance", when)


class SpotWatcher:
    """Poll the instance metadata at ``base_url`` every ``interval_s`` seconds and call
    ``on_notice(notice)`` (from the watcher's thread) once per distinct :class:`Notice`."""

    def __init__(self, base_url: str, on_notice: Callable[[Notice], None], interval_s: float = 5.0,
                 token_ttl_s: int = 21600, timeout_s: float = 2.0, kinds: tuple[str, ...] = tuple(PATHS),
                 what: str = "spot watch") -> None:
        self.base_url = base_url.rstrip("/")
        self.on_notice = on_notice
        self.interval_s = interval_s
        self.token_ttl_s = token_ttl_s
        self.timeout_s = timeout_s
        self.kinds = kinds
        self.what = what
        self.seen: list[Notice] = []
        self.polls = 0
        self.failures = 0
        self._token: str | None = None
        self._token_expires = 0.0
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -------------------------------------------------------------------------- one poll

    async def _fetch_token(self, session: aiohttp.ClientSession) -> str:
        async with session.put(self.base_url + TOKEN_PATH, headers={TOKEN_TTL_HEADER: str(self.token_ttl_s)}) as r:
            if r.status != 200:
                raise RuntimeError(f"token request answered HTTP {r.status}")
            token = (await r.text()).strip()
        if not token:
            raise RuntimeError("token request answered an empty token")
        self._token = token
        # Renewed a minute (or a tenth of its life) early: a token never expires mid-poll.
        self._token_expires = time.monotonic() + self.token_ttl_s - min(60.0, self.token_ttl_s / 10)
        return token

    async def _get(self, session: aiohttp.ClientSession, path: str) -> tuple[int, str]:
        token = self._token if self._token and time.monotonic() < self._token_expires else None
        for attempt in range(2):
            token = token or await self._fetch_token(session)
            async with session.get(self.base_url + path, headers={TOKEN_HEADER: token}) as r:
                if r.status == 401 and attempt == 0:  # expired or revoked early: one new token, once
                    self._token, token = None, None
                    continue
                return r.status, await r.text()
        raise AssertionError("unreachable")

    async def poll(self, session: aiohttp.ClientSession) -> list[Notice]:
        """One round over :attr:`kinds`: the new notices (each reported to ``on_notice``).
        Raises on a failing metadata service; :meth:`run` logs and carries on."""
        self.polls += 1
        new = []
        for kind in self.kinds:
            status, body = await self._get(session, PATHS[kind])
            if status == 404:
                continue  # no notice of this kind (or, for autoscaling, not in a group)
            if status != 200:
                raise RuntimeError(f"{PATHS[kind]} answered HTTP {status}")
            notice = parse_notice(kind, body)
            if notice is not None and notice not in self.seen:
                self.seen.append(notice)
                new.append(notice)
                logger.warning("%s: notice: %s", self.what, notice.describe())
                try:
                    self.on_notice(notice)
                except Exception as exc:  # the host's callback failing must not end the watch
                    logger.error("%s: notice handler failed: %s: %s", self.what, type(exc).__name__, exc)
        return new

    # -------------------------------------------------------------------------- the loop

    async def run(self) -> None:
        """Poll until :meth:`stop`; every failure is logged (rate-limited) and polled again."""
        timeout = aiohttp.ClientTimeout(total=self.timeout_s)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            while not self._stop.is_set():
                try:
                    await self.poll(session)
                except asyncio.CancelledError:
                    raise
                except Exception as exc:
                    self.failures += 1
                    self._token = None  # a restarted or replaced service issues new tokens
                    if self.failures == 1 or self.failures % LOG_EVERY == 0:
                        logger.warning("%s: instance metadata at %s failed (%d so far), retrying every %g s: %s: %s",
                                       self.what, self.base_url, self.failures, self.interval_s,
                                       type(exc).__name__, exc)
                deadline = time.monotonic() + self.interval_s
                while not self._stop.is_set() and time.monotonic() < deadline:  # stop() within 50 ms
                    await asyncio.sleep(min(0.05, max(0.0, deadline - time.monotonic())))

    def start(self) -> "SpotWatcher":
        """Run :meth:`run` in a daemon thread with its own event loop."""
        self._thread = threading.Thread(target=lambda: asyncio.run(self.run()), name=self.what, daemon=True)
        self._thread.start()
        return self

    def stop(self, timeout: float = 5.0) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)


# ----------------------------------------------------------------------------- CLI


def add_argument(parser: argparse.ArgumentParser) -> None:
    """``--spot-watch URL|off``, checked while parsing (a bad value is a usage error before anything starts)."""
    parser.add_argument("--spot-watch", metavar="URL|off", default=None, type=_url_argument,
                        help="poll the EC2 instance metadata at URL (http://169.254.169.254 on EC2) for a "
                             "spot interruption, rebalance or Auto Scaling termination notice and pass it on to "
                             "the coordinator (default: off)")
    parser.add_argument("--spot-watch-interval-s", metavar="S", default=INTERVAL_S, type=_interval_argument,
                        help=f"with --spot-watch: seconds between polls, in (0, {MAX_INTERVAL_S:g}] "
                             f"(default: {INTERVAL_S:g})")


def _interval_argument(value: str) -> float:
    try:
        seconds = float(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected seconds, got {value!r}") from None
    if not 0 < seconds <= MAX_INTERVAL_S:  # NaN fails too
        raise argparse.ArgumentTypeError(f"must be in (0, {MAX_INTERVAL_S:g}], got {value}")
    return seconds


def check_url(value: str) -> str | None:
    """``--spot-watch``'s value: None for off, else the URL (http, a host, no path beyond /)."""
    if value == "off":
        return None
    parts = urlsplit(value)
    if parts.scheme != "http" or not parts.hostname or parts.path not in ("", "/") or parts.query or parts.fragment:
        raise ConfigError(f"--spot-watch {value!r}: expected off or http://HOST[:PORT] (the instance metadata "
                          f"service, http://169.254.169.254 on EC2)")
    try:
        parts.port
    except ValueError:
        raise ConfigError(f"--spot-watch {value!r}: bad port") from None
    return value


def _url_argument(value: str) -> str | None:
    try:
        return check_url(value)
    except ConfigError as exc:
        raise argparse.ArgumentTypeError(str(exc).removeprefix(f"--spot-watch {value!r}: ")) from None


def start_from_args(args: argparse.Namespace, on_notice: Callable[[Notice], None], what: str) -> SpotWatcher | None:
    """The started watcher of ``--spot-watch`` (None when off or absent)."""
    url = getattr(args, "spot_watch", None)
    if url is None:
        return None
    return SpotWatcher(url, on_notice, interval_s=getattr(args, "spot_watch_interval_s", INTERVAL_S), what=what).start()


# ----------------------------------------------------------------------------- a local IMDS


class LocalImds:
    """The instance metadata of one local "instance", as far as :class:`SpotWatcher` reads it:
    IMDSv2 tokens (a GET without this server's token gets 401), 404 for every notice path until
    :meth:`interrupt` posts the spot ``instance-action``. An ``aiohttp.web`` server on 127.0.0.1,
    a free port, in a daemon thread with its own event loop (its callers, the coordinator, are
    synchronous); :meth:`close` stops it."""

    def __init__(self) -> None:
        import aiohttp.web  # here, not at the top: the roles import this module for the watcher alone

        self.token = secrets.token_urlsafe(24)
        self.notice: str | None = None  # the instance-action body, once posted
        sock = socket.create_server(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{sock.getsockname()[1]}"
        app = aiohttp.web.Application()
        app.router.add_put(TOKEN_PATH, self._token)
        app.router.add_get("/{path:.*}", self._get)
        self._runner = aiohttp.web.AppRunner(app, access_log=None)  # every poll would be a line in the log
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="local imds", daemon=True)
        self._thread.start()
        try:
            asyncio.run_coroutine_threadsafe(self._serve(sock), self._loop).result(10.0)
        except BaseException:
            sock.close()
            self.close()
            raise

    async def _serve(self, sock: socket.socket) -> None:
        await self._runner.setup()
        await aiohttp.web.SockSite(self._runner, sock).start()

    async def _token(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        if not request.headers.get(TOKEN_TTL_HEADER, "").isdigit():
            return aiohttp.web.Response(status=400)
        return aiohttp.web.Response(text=self.token)

    async def _get(self, request: aiohttp.web.Request) -> aiohttp.web.Response:
        if request.headers.get(TOKEN_HEADER) != self.token:
            return aiohttp.web.Response(status=401)
        body = self.notice if request.path == PATHS["spot"] else None
        return aiohttp.web.Response(status=404) if body is None else aiohttp.web.Response(text=body)

    def interrupt(self, action: str = "terminate", seconds: float = 120.0) -> str:
        """Post the spot interruption notice: ``action`` at ``seconds`` from now (UTC, as AWS
        writes it); returns the body."""
        when = time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(time.time() + seconds))
        self.notice = json.dumps({"action": action, "time": when})
        return self.notice

    def close(self) -> None:
        """Stop serving and end the thread; a second call does nothing."""
        if self._loop.is_closed():
            return
        if self._thread.is_alive():
            with contextlib.suppress(Exception):
                asyncio.run_coroutine_threadsafe(self._runner.cleanup(), self._loop).result(5.0)
            self._loop.call_soon_threadsafe(self._loop.stop)
            self._thread.join(5.0)
        if not self._thread.is_alive():
            self._loop.close()
