"""CURVE keys and what each role may do over an authenticated connection (DESIGN §5).

Why: in AWS mode the graph and parameter servers must accept connections from Lambda, so any
process that can reach their ports could otherwise push gradients, ghost rows or commands into
a run. With CURVE every connection is encrypted and the server knows which key, hence which
role, sent each message.

Roles and keys
--------------
Four roles hold one key pair each: ``coordinator``, ``graphserver`` (one pair shared by every
graph server: they are one role), ``paramserver`` and ``function``. ``dorylus keys --out DIR``
writes them as ``DIR/<role>.public`` and ``DIR/<role>.secret`` (Z85 text, mode 0600): the same
layout in which the Terraform user data copies them out of SSM, so ``--keys DIR`` reads either.
The function reads its pair and the servers' public keys from environment variables
(:data:`ENV_PREFIX`: ``DORYLUS_CURVE_<ROLE>_PUBLIC`` / ``_SECRET``), which Terraform fills from
the SSM parameters into Lambda's KMS-encrypted environment.

Servers and clients
-------------------
A server socket (:meth:`Keyring.serve`) is a CURVE server, and the ZAP authenticator on its
context (:func:`start_authenticator`) admits only the public keys of the roles that may dial it
(:data:`CLIENTS`). A client without a key, or with a key not in the list, never completes the
handshake: it gets no reply at all and the server never sees its messages. The authenticated
role travels with every message as ZeroMQ's ``User-Id`` property (:func:`sender_role`), and
:func:`check_allowed` refuses an operation that role may not send (only the coordinator may
COMMAND the servers, read STATS or SHUTDOWN them; a function may only pull and push).

Standard library and pyzmq only: the Lambda bundle imports this module.
"""

from __future__ import annotations

import json
import logging
import os
import stat
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import zmq
from zmq.utils import z85

from dorylus import atomic
from dorylus.errors import ConfigError

ROLES = ("coordinator", "graphserver", "paramserver", "function")
SERVER_ROLES = ("graphserver", "paramserver")
# Who dials whom: the client roles each server admits.
CLIENTS = {"graphserver": ("coordinator", "graphserver", "function"),
           "paramserver": ("coordinator", "graphserver", "function")}
# The servers each role dials, hence whose public keys it needs.
DIALS = {"coordinator": SERVER_ROLES, "graphserver": SERVER_ROLES, "paramserver": (),
         "function": SERVER_ROLES}
ENV_PREFIX = "DORYLUS_CURVE_"
TFVARS_FILE = "curve.tfvars.json"
KEY_CHARS = 40  # Z85 text of a 32-byte key

# What each client role may send to each server. COMMAND names are listed where a role may
# send only some commands (a graph server waits for weight versions, nothing else).
_ANY_COMMAND = "*"
PERMISSIONS: dict[str, dict[str, dict[str, tuple[str, ...]]]] = {
    "graphserver": {
        "coordinator": {"HELLO": (), "STATS": (), "SHUTDOWN": (), "COMMAND": (_ANY_COMMAND,)},
        "graphserver": {"HELLO": (), "GHOSTS": ()},
        "function": {"HELLO": (), "PULL": (), "PUSH": ()},
    },
    "paramserver": {
        "coordinator": {"HELLO": (), "STATS": (), "SHUTDOWN": (), "COMMAND": (_ANY_COMMAND,)},
        "graphserver": {"HELLO": (), "PULL_WEIGHTS": (), "PUSH_GRADS": (), "COMMAND": ("wait_version",)},
        "function": {"HELLO": (), "PULL_WEIGHTS": (), "PUSH_GRADS": ()},
    },
}


def env_name(role: str, kind: str) -> str:
    """``DORYLUS_CURVE_FUNCTION_SECRET`` for ``("function", "secret")``."""
    return f"{ENV_PREFIX}{role.upper()}_{kind.upper()}"


def _decode(text: str, what: str) -> bytes:
    text = text.strip()
    if len(text) != KEY_CHARS:
        raise ConfigError(f"{what}: a CURVE key is {KEY_CHARS} Z85 characters, got {len(text)}")
    try:
        key = z85.decode(text.encode("ascii"))
    except (ValueError, UnicodeEncodeError, KeyError, IndexError):
        raise ConfigError(f"{what}: not a Z85-encoded CURVE key") from None
    return z85.encode(key)


@dataclass(frozen=True)
class Keyring:
    """One role's key pair and the public keys (Z85 bytes, as pyzmq takes them) of the roles it
    talks to. Build with :func:`load_keys` or :func:`keys_from_env`."""

    role: str
    public: bytes
    secret: bytes
    publics: Mapping[str, bytes]  # role -> public key, this role's own included

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ConfigError(f"CURVE keys: unknown role {self.role!r}; roles are {', '.join(ROLES)}")
        if zmq.curve_public(self.secret) != self.public:
            raise ConfigError(f"CURVE keys of {self.role}: the secret key does not belong to the public key")
        needed = set(DIALS[self.role]) | set(CLIENTS.get(self.role, ()))
        missing = sorted(needed - set(self.publics))
        if missing:
            raise ConfigError(f"CURVE keys of {self.role}: missing the public key of {', '.join(missing)}")
        owners: dict[bytes, str] = {}
        for role, key in self.publics.items():
            if key in owners:
                raise ConfigError(f"CURVE keys: {owners[key]} and {role} have the same public key; "
                                  "every role needs its own pair (dorylus keys)")
            owners[key] = role

    def connect(self, socket: zmq.Socket, server_role: str) -> None:
        """Make ``socket`` (before it connects) a CURVE client of a ``server_role`` server."""
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public
        socket.curve_serverkey = self.publics[server_role]

    def serve(self, socket: zmq.Socket) -> None:
        """Make ``socket`` (before it binds) a CURVE server with this role's key pair."""
        socket.curve_server = True
        socket.curve_secretkey = self.secret
        socket.curve_publickey = self.public

    def clients(self) -> dict[bytes, str]:
        """Public key (Z85) -> role, for the roles allowed to dial this server role."""
        return {self.publics[role]: role for role in CLIENTS.get(self.role, ()) if role in self.publics}


# ----------------------------------------------------------------------------- files


def _read_key(path: Path, secret: bool) -> bytes:
    if not path.is_file():
        raise ConfigError(f"CURVE key file {path} does not exist")
    if secret and stat.S_IMODE(path.stat().st_mode) & 0o077:
        raise ConfigError(f"CURVE secret key {path} is readable by other users (mode "
                          f"{stat.S_IMODE(path.stat().st_mode):04o}); chmod 600 it")
    try:
        return _decode(path.read_text(), str(path))
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"CURVE key file {path} cannot be read: {exc}") from None


def load_keys(directory: str | os.PathLike, role: str) -> Keyring:
    """``role``'s keyring from a keys directory (``dorylus keys`` or the servers' copy from SSM):
    its own pair and every ``<role>.public`` present; what the role needs must be there."""
    directory = Path(directory)
    if not directory.is_dir():
        raise ConfigError(f"CURVE keys directory {directory} does not exist")
    publics = {r: _read_key(directory / f"{r}.public", secret=False) for r in ROLES
               if (directory / f"{r}.public").is_file()}
    if role not in publics:
        raise ConfigError(f"CURVE keys directory {directory} has no {role}.public")
    return Keyring(role, publics[role], _read_key(directory / f"{role}.secret", secret=True), publics)


def keys_from_env(role: str, environ: Mapping[str, str] = os.environ) -> Keyring | None:
    """``role``'s keyring from ``DORYLUS_CURVE_*`` variables, or None when none is set (a
    local run without CURVE). A partial set is an error naming what is missing."""
    if not any(name.startswith(ENV_PREFIX) for name in environ):
        return None
    publics = {r: _decode(environ[env_name(r, "public")], env_name(r, "public")) for r in ROLES
               if env_name(r, "public") in environ}
    for name in (env_name(role, "public"), env_name(role, "secret")):
        if name not in environ:
            raise ConfigError(f"CURVE keys from the environment: {name} is not set")
    secret = _decode(environ[env_name(role, "secret")], env_name(role, "secret"))
    return Keyring(role, publics[role], secret, publics)


def function_environment_names() -> list[str]:
    """The environment variables the function reads: its pair, the servers' public keys."""
    return [env_name("function", "public"), env_name("function", "secret"),
            *(env_name(role, "public") for role in DIALS["function"])]


def function_environment(directory: str | os.PathLike) -> dict[str, str]:
    """The function's environment variables for the keys in ``directory``: its own pair and
    the public keys of the servers it dials (what Terraform puts into Lambda's environment)."""
    keys = load_keys(directory, "function")
    env = {env_name("function", "public"): keys.public.decode(), env_name("function", "secret"): keys.secret.decode()}
    env.update({env_name(role, "public"): keys.publics[role].decode() for role in DIALS["function"]})
    return env


def write_keys(out: str | os.PathLike) -> list[Path]:
    """New key pairs for every role into ``out`` (created mode 0700 if missing): ``<role>.public``,
    ``<role>.secret`` and ``curve.tfvars.json`` (Terraform's ``curve_public_keys`` and
    ``curve_secret_keys``), each mode 0600. Refuses to overwrite any of them; on failure
    removes what it wrote. Returns the files written."""
    out = Path(out)
    pairs = {role: zmq.curve_keypair() for role in ROLES}
    files = {out / f"{role}.{kind}": key.decode() + "\n" for role, (public, secret) in pairs.items()
             for kind, key in (("public", public), ("secret", secret))}
    files[out / TFVARS_FILE] = json.dumps({
        "curve_public_keys": {role: public.decode() for role, (public, _) in pairs.items()},
        "curve_secret_keys": {role: secret.decode() for role, (_, secret) in pairs.items()},
    }, indent=2) + "\n"
    if out.exists() and not out.is_dir():
        raise ConfigError(f"keys directory {out} exists and is not a directory")
    existing = [str(p) for p in files if p.exists()]
    if existing:
        raise ConfigError(f"refusing to overwrite CURVE keys: {', '.join(existing)} already exist(s); "
                          "choose another --out or remove them")
    created_dir = not out.exists()
    try:
        out.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise ConfigError(f"keys directory {out} cannot be created: {exc.strerror or exc}") from None
    written: list[Path] = []
    try:
        for path, text in files.items():
            atomic.write_text(path, text, mode=0o600, exclusive=True)
            written.append(path)
    except OSError as exc:
        for path in written:
            path.unlink(missing_ok=True)
        if created_dir:
            out.rmdir()
        raise ConfigError(f"cannot write CURVE keys into {out}: {exc.strerror or exc}") from None
    return written


# ----------------------------------------------------------------------------- servers


def start_authenticator(context: zmq.Context, keys: Keyring, *, asyncio: bool = False) -> Any:
    """Start the ZAP handler of ``context`` that admits only ``keys.clients()`` and names each
    connection by its role (the messages' ``User-Id``). ``asyncio=True`` for a
    ``zmq.asyncio.Context`` (runs in the running loop), else a thread. Stop it with ``.stop()``."""
    if asyncio:
        from zmq.auth.asyncio import AsyncioAuthenticator as Base
    else:
        from zmq.auth.thread import ThreadAuthenticator as Base
    roles = keys.clients()

    class RoleAuthenticator(Base):
        def curve_user_id(self, client_public_key: bytes) -> str:
            return roles[z85.encode(client_public_key)]

    class Admitted:
        @staticmethod
        def callback(domain: str, key: bytes) -> bool:
            return key in roles

    auth = RoleAuthenticator(context)
    auth.start()
    auth.configure_curve_callback("*", Admitted())
    return auth


def sender_role(frame: Any) -> str | None:
    """The role a received message's key authenticated as (a frame of the message, received
    with ``copy=False``), or None on a connection without CURVE."""
    try:
        user = frame.get("User-Id")
    except (zmq.ZMQError, AttributeError):
        return None
    return user if user in ROLES else None


def peer_address(frame: Any) -> str:
    """The sending connection's IP address, for logs (``?`` when ZeroMQ does not say)."""
    try:
        return frame.get("Peer-Address") or "?"
    except (zmq.ZMQError, AttributeError):
        return "?"


def check_allowed(server: str, sender: str | None, op: str, command: str | None = None) -> str | None:
    """Why ``sender`` may not send ``op`` (``command`` for COMMAND) to a ``server``, or None if
    it may. A sender of None (no CURVE on this server) may send anything."""
    if sender is None:
        return None
    allowed = PERMISSIONS[server].get(sender, {})
    if op not in allowed:
        return f"{sender} may not send {op} to the {server}"
    commands = allowed[op]
    if commands and _ANY_COMMAND not in commands and command not in commands:
        return f"{sender} may not send command {command!r:.40} to the {server}"
    return None


def authorize(server: str, who: str, keyed: bool, identity: bytes, header, frame: zmq.Frame) -> None:
    """Raise ProtocolError ``forbidden`` if the sender of ``frame`` (its CURVE key's role; any
    sender when the server is not ``keyed``) may not send ``header`` to a ``server``; log every
    SHUTDOWN with its sender (a refused one as a warning), ``who`` naming this server."""
    from dorylus.protocol import Op, ProtocolError

    role = sender_role(frame) if keyed else None
    why = check_allowed(server, role, header.op.value, header.meta.get("command"))
    if header.op is Op.SHUTDOWN:
        logging.getLogger(__name__).log(
            logging.WARNING if why else logging.INFO, "%s: SHUTDOWN from %s (identity %s, address %s): %s", who,
            role or "a client without CURVE", identity.hex(), peer_address(frame), "refused, " + why if why else "stopping")
    if why is not None:
        raise ProtocolError("forbidden", why, req=header.req)
