"""The cluster file: where the servers of a cluster-mode run are, and which function they invoke.

``terraform output -json cluster`` writes it (the servers hold the same file as
``/etc/dorylus/cluster.json``); for hosts Terraform did not make, write the same shape by hand::

    {"format": "dorylus-cluster/1", "region": "us-east-1", "store": "s3://BUCKET/PREFIX",
     "function": {"name": "NAME", "endpoint_url": "http://127.0.0.1:9001"},   # endpoint_url: optional
     "param_servers": [{"index": 0, "host": "10.42.1.8", "port": 5600}],
     "graph_servers": [{"part": 0, "host": "10.42.1.64", "port": 5500}, ...],
     "keys": "DIR",                                                         # optional
     "recovery_wait_s": 900}                                                # optional

Terraform's output also carries ``name``, ``bucket``, ``ssm_prefix`` and ``curve`` (the roles
whose keys it stored in SSM), and the function's ``arn``, ``python``, ``architecture``,
``memory_mb`` and ``timeout_s``; they are read and checked too. ``function.endpoint_url`` sends
the invokes to another Lambda API (the local emulator: tests, a cluster on one machine);
``keys`` names the CURVE keys directory of the coordinator (relative to the file), and a
relative local ``store`` is relative to the file as well. ``recovery_wait_s`` (1 to 3600,
default :data:`DEFAULT_RECOVERY_WAIT_S`) bounds how long a run waits for its roles to answer
again at their addresses after one died (:meth:`dorylus.coordinator.remote.RemoteCluster.restart`).

Everything is checked before anything runs: a bad file is one ConfigError naming the file and
the key, and nothing is written.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from dorylus.errors import ConfigError
from dorylus.partition import s3

FORMAT = "dorylus-cluster/1"
# A spot graph server's replacement is a new instance at the same address: it boots and installs
# the project first, as at the cluster's first boot (docs/aws.md waits up to 900 s for that).
DEFAULT_RECOVERY_WAIT_S = 900
MAX_RECOVERY_WAIT_S = 3600
_TOP = {"format", "name", "region", "store", "bucket", "ssm_prefix", "function", "param_servers", "graph_servers",
        "curve", "keys", "recovery_wait_s"}
_FUNCTION = {"name", "arn", "python", "architecture", "memory_mb", "timeout_s", "endpoint_url"}
_HOST = re.compile(r"[A-Za-z0-9._:-]{1,253}")
_REGION = re.compile(r"[a-z]{2}(-[a-z]+)+-\d")


@dataclass(frozen=True)
class Server:
    host: str
    port: int

    @property
    def endpoint(self) -> str:
        host = f"[{self.host}]" if ":" in self.host else self.host
        return f"tcp://{host}:{self.port}"


@dataclass(frozen=True)
class FunctionTarget:
    name: str
    endpoint_url: str | None = None
    memory_mb: int | None = None


@dataclass(frozen=True)
class ClusterSpec:
    path: Path
    region: str
    store: str
    function: FunctionTarget
    param_server: Server
    graph_servers: tuple[Server, ...]  # index = part
    ssm_prefix: str | None = None
    curve_roles: tuple[str, ...] = ()
    keys: Path | None = None
    recovery_wait_s: int = DEFAULT_RECOVERY_WAIT_S


class _Reader:
    """Typed access to the parsed JSON that names the file and key in every error."""

    def __init__(self, path: Path):
        self.path = path

    def fail(self, where: str, problem: str) -> ConfigError:
        return ConfigError(f"cluster file {self.path}: {where} {problem}")

    def obj(self, value: Any, where: str, known: set[str]) -> dict[str, Any]:
        if not isinstance(value, dict):
            raise self.fail(where, f"must be a JSON object, got {type(value).__name__}")
        unknown = sorted(set(value) - known)
        if unknown:
            raise self.fail(where, f"has unknown key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return value

    def str(self, d: dict, key: str, where: str, *, required: bool = True) -> str | None:
        value = d.get(key)
        if value is None and not required:
            return None
        if not isinstance(value, str) or not value.strip():
            raise self.fail(f"{where}{key}", "must be a non-empty string" + ("" if key in d else " (missing)"))
        return value

    def int(self, d: dict, key: str, where: str, lo: int, hi: int, *, required: bool = True) -> int | None:
        value = d.get(key)
        if value is None and not required:
            return None
        if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
            raise self.fail(f"{where}{key}", f"must be an integer from {lo} to {hi}, got {value!r}"
                            + ("" if key in d else " (missing)"))
        return value

    def server(self, value: Any, where: str, id_key: str) -> tuple[int, Server]:
        d = self.obj(value, where, {id_key, "host", "port"})
        host = self.str(d, "host", f"{where}.")
        if not _HOST.fullmatch(host) or host in ("0.0.0.0", "*", "::"):
            raise self.fail(f"{where}.host", f"{host!r} is not an address the coordinator can dial")
        return self.int(d, id_key, f"{where}.", 0, 4095), Server(host, self.int(d, "port", f"{where}.", 1, 65535))


def load_cluster_file(path: str | Path) -> ClusterSpec:
    """The checked contents of a cluster file; a ConfigError naming the file and key otherwise."""
    path = Path(path)
    if not path.is_file():
        raise ConfigError(f"cluster file {path} does not exist")
    try:
        raw = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as exc:
        raise ConfigError(f"cluster file {path} is not valid JSON: {exc}") from None
    r = _Reader(path)
    d = r.obj(raw, "the top level", _TOP)
    if d.get("format") != FORMAT:
        raise r.fail("format", f"must be {FORMAT!r}, got {d.get('format')!r}")
    region = r.str(d, "region", "")
    if not _REGION.fullmatch(region):
        raise r.fail("region", f"{region!r} is not an AWS region name (like us-east-1)")
    store = r.str(d, "store", "")
    if not s3.is_url(store) and not Path(store).is_absolute():
        store = str((path.parent / store).resolve())

    f = r.obj(d.get("function"), "function", _FUNCTION)
    endpoint_url = r.str(f, "endpoint_url", "function.", required=False)
    if endpoint_url is not None and not re.fullmatch(r"https?://[^\s/]+(/\S*)?", endpoint_url):
        raise r.fail("function.endpoint_url", f"{endpoint_url!r} is not an http(s) URL")
    function = FunctionTarget(r.str(f, "name", "function."), endpoint_url,
                              r.int(f, "memory_mb", "function.", 128, 10240, required=False))

    param_servers = d.get("param_servers")
    if not isinstance(param_servers, list) or len(param_servers) != 1:
        count = len(param_servers) if isinstance(param_servers, list) else "no list"
        raise r.fail("param_servers", f"must list exactly one parameter server (training uses one), got {count}")
    _, param_server = r.server(param_servers[0], "param_servers[0]", "index")

    graph_list = d.get("graph_servers")
    if not isinstance(graph_list, list) or not graph_list:
        raise r.fail("graph_servers", "must be a non-empty list, one server per partition")
    by_part: dict[int, Server] = {}
    for i, entry in enumerate(graph_list):
        part, server = r.server(entry, f"graph_servers[{i}]", "part")
        if part in by_part:
            raise r.fail(f"graph_servers[{i}].part", f"{part} is listed twice")
        by_part[part] = server
    if sorted(by_part) != list(range(len(by_part))):
        raise r.fail("graph_servers", f"must own parts 0..{len(by_part) - 1}, one each; got {sorted(by_part)}")
    endpoints = [s.endpoint for s in (param_server, *by_part.values())]
    if len(set(endpoints)) != len(endpoints):
        raise r.fail("graph_servers", "and param_servers must all have different host:port addresses")

    curve = d.get("curve")
    roles: tuple[str, ...] = ()
    if curve is not None:
        c = r.obj(curve, "curve", {"roles", "parameters"})
        if not isinstance(c.get("roles", []), list) or not all(isinstance(x, str) for x in c.get("roles", [])):
            raise r.fail("curve.roles", "must be a list of role names")
        roles = tuple(c.get("roles", []))
    ssm_prefix = r.str(d, "ssm_prefix", "", required=False)
    keys = r.str(d, "keys", "", required=False)
    for key in ("name", "bucket"):
        r.str(d, key, "", required=False)
    recovery_wait_s = r.int(d, "recovery_wait_s", "", 1, MAX_RECOVERY_WAIT_S, required=False)
    return ClusterSpec(path=path, region=region, store=store, function=function, param_server=param_server,
                       graph_servers=tuple(by_part[i] for i in range(len(by_part))), ssm_prefix=ssm_prefix,
                       curve_roles=roles, keys=(path.parent / keys) if keys else None,
                       recovery_wait_s=DEFAULT_RECOVERY_WAIT_S if recovery_wait_s is None else recovery_wait_s)
