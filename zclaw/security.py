"""CURVE keys from the ``[security]`` config, and the rule that nothing leaves loopback unprotected.

Which files a process needs depends on what it does (``zclaw keys generate`` writes this layout)::

    KEYS_DIR/servers/broker.key, learner.key    public certs of the two servers: every client needs them
    KEYS_DIR/allowed/<name>.key                 public certs of the clients: the servers' ZAP allowlist
    KEYS_DIR/private/<name>.key_secret          one secret cert per name (mode 600, directory 700)

    role      binds (CurveServer)                 connects (CurveClient) as <name>
    broker    ingest PULL, serve ROUTER           -
    learner   PUB, ROUTER                         learner -> broker serve
    worker    -                                   worker<index> -> broker ingest, learner PUB + ROUTER
    tools     -                                   tools (status clients, the `zclaw train` launcher)

Every path can also be given explicitly (``security.server_secret`` and friends), for hosts that only get
the files they need. CURVE is on as soon as any of those keys is set; then every file a role needs must
exist and parse, or the role refuses to start with a :class:`~zclaw.config.ConfigError` naming the key.

Binding a server beyond loopback without CURVE is refused unless ``security.insecure`` (``--insecure``)
is set, and then a warning is logged: an open PULL port accepts segments from anyone who can reach it.
"""
from __future__ import annotations

import ipaddress
import socket
import stat
from pathlib import Path
from typing import Any, Dict, Mapping, Optional

from .config import ConfigError
from .wire.sockets import CurveClient, CurveServer

#: sub-directories of a keys directory (see the module doc)
SERVERS_DIR, ALLOWED_DIR, PRIVATE_DIR = "servers", "allowed", "private"
SERVER_NAMES = ("broker", "learner")
#: the client name of tools (status, the launcher) when ``security.name`` is empty
TOOLS_NAME = "tools"
#: keys whose value turns CURVE on
_KEY_SETTINGS = ("keys_dir", "server_secret", "client_secret", "broker_public", "learner_public",
                 "allowed_clients")
#: what each role needs: does it bind, which servers does it connect to
_ROLES: Dict[str, Any] = {
    "broker": (True, ()),
    "learner": (True, ("broker",)),
    "worker": (False, ("broker", "learner")),
    "tools": (False, ()),  # connects to whichever it asks; resolved on demand
}


def public_path(keys_dir: str, name: str, server: bool) -> Path:
    return Path(keys_dir) / (SERVERS_DIR if server else ALLOWED_DIR) / f"{name}.key"


def secret_path(keys_dir: str, name: str) -> Path:
    return Path(keys_dir) / PRIVATE_DIR / f"{name}.key_secret"


def is_loopback(host: str) -> bool:
    """True if every address ``host`` stands for is a loopback address (127.0.0.0/8, ::1).

    ``*``, ``0.0.0.0``, interface names and names that do not resolve count as beyond loopback.
    """
    h = host.strip().strip("[]")
    if not h or h == "*":
        return False
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        pass
    try:
        infos = socket.getaddrinfo(h, None)
    except (socket.gaierror, UnicodeError):
        return False
    addrs = {info[4][0] for info in infos}
    return bool(addrs) and all(ipaddress.ip_address(a.split("%", 1)[0]).is_loopback for a in addrs)


def _load(setting: str, path: Path, origin: str, need_secret: bool) -> Any:
    import zmq.auth

    if not path.is_file():
        raise ConfigError(
            f"security.{setting}: {path} does not exist ({origin}); make keys with `zclaw keys generate DIR`"
        )
    try:
        public, secret = zmq.auth.load_certificate(str(path))
    except (ValueError, OSError, KeyError, IndexError) as exc:
        raise ConfigError(f"security.{setting}: {path} is not a CURVE certificate: {exc}") from None
    if not public or len(public) != 40:
        raise ConfigError(f"security.{setting}: {path} has no valid public-key line")
    if need_secret and (not secret or len(secret) != 40):
        raise ConfigError(f"security.{setting}: {path} holds no secret key (a public .key file was given?)")
    return (public, secret) if need_secret else public


class Security:
    """The CURVE settings of one process (or none: ``enabled`` False means plain TCP everywhere)."""

    def __init__(self, sec: Mapping[str, Any], role: str, name: str, log: Any = None) -> None:
        if role not in _ROLES:
            raise ValueError(f"role {role!r}: expected one of {', '.join(_ROLES)}")
        self.sec = dict(sec)
        self.role = role
        self.name = name
        self.log = log
        self.insecure = bool(sec.get("insecure", False))
        self.enabled = any(sec.get(k) for k in _KEY_SETTINGS)
        self._server: Optional[CurveServer] = None
        self._client_keys: Any = None
        self._server_publics: Dict[str, bytes] = {}
        if not self.enabled:
            return
        binds, connects = _ROLES[role]
        if binds:
            self._server = self._load_server()
        if connects or role == "tools":
            self._client_keys = self._resolve("client_secret", name, secret=True)
        for server in connects:
            self._server_public(server)

    @classmethod
    def from_config(
        cls, cfg: Mapping[str, Mapping[str, Any]], role: str, index: int = 0, log: Any = None
    ) -> "Security":
        """The settings of ``role`` (broker, learner, worker, tools); ``index`` names worker<index>."""
        sec = cfg.get("security") or {}
        name = sec.get("name") or (f"worker{index}" if role == "worker"
                                   else TOOLS_NAME if role == "tools" else role)
        return cls(sec, role, name, log)

    # -- resolution ------------------------------------------------------------------------------------
    def _resolve(self, setting: str, name: str, secret: bool, server: bool = False) -> Any:
        explicit = self.sec.get(setting) or ""
        keys_dir = self.sec.get("keys_dir") or ""
        if explicit:
            path, origin = Path(explicit), f"security.{setting} = {explicit!r}"
        elif keys_dir:
            path = secret_path(keys_dir, name) if secret else public_path(keys_dir, name, server)
            origin = f"from security.keys_dir = {keys_dir!r} and key name {name!r}"
        else:
            raise ConfigError(
                f"security.{setting} is not set and security.keys_dir is empty, but CURVE is on "
                f"(a [security] key is set): give security.keys_dir or security.{setting}"
            )
        value = _load(setting, path, origin, secret)
        if secret:
            self._check_mode(setting, path)
        return value

    def _check_mode(self, setting: str, path: Path) -> None:
        try:
            mode = path.stat().st_mode
        except OSError:
            return
        if mode & (stat.S_IRWXG | stat.S_IRWXO) and self.log is not None:
            self.log.warning("secret key file is readable by others; chmod 600 it", key=f"security.{setting}",
                             path=str(path), mode=oct(mode & 0o777))

    def _load_server(self) -> CurveServer:
        public, secret = self._resolve("server_secret", self.role, secret=True)
        allowed = self.sec.get("allowed_clients") or ""
        keys_dir = self.sec.get("keys_dir") or ""
        if allowed:
            adir, origin = Path(allowed), f"security.allowed_clients = {allowed!r}"
        elif keys_dir:
            adir, origin = Path(keys_dir) / ALLOWED_DIR, f"from security.keys_dir = {keys_dir!r}"
        else:
            raise ConfigError("security.allowed_clients is not set and security.keys_dir is empty, but CURVE "
                              "is on: a server needs the directory of the client public certs it admits")
        if not adir.is_dir():
            raise ConfigError(f"security.allowed_clients: {adir} is not a directory ({origin})")
        certs = sorted(adir.glob("*.key"))
        if not certs:
            raise ConfigError(f"security.allowed_clients: {adir} holds no *.key public certs ({origin}): "
                              "nobody could connect")
        for cert in certs:
            _load("allowed_clients", cert, origin, need_secret=False)
        return CurveServer(public, secret, str(adir), log=self.log)

    def _server_public(self, server: str) -> bytes:
        if server not in SERVER_NAMES:
            raise ValueError(f"server {server!r}: expected one of {', '.join(SERVER_NAMES)}")
        if server not in self._server_publics:
            self._server_publics[server] = self._resolve(f"{server}_public", server, secret=False,
                                                         server=True)
        return self._server_publics[server]

    def summary(self) -> Dict[str, Any]:
        """A log-friendly summary (never the secret keys)."""
        out: Dict[str, Any] = {"curve": self.enabled, "key_name": self.name}
        if self._server is not None:
            out["allowed_clients"] = self._server.allowed_dir
        if self.insecure:
            out["insecure"] = True
        return out

    # -- what sockets get ------------------------------------------------------------------------------
    def server(self) -> Optional[CurveServer]:
        """The ``curve=`` of this role's bound sockets (None without CURVE)."""
        return self._server

    def client(self, server: str) -> Optional[CurveClient]:
        """The ``curve=`` of a socket connecting to ``server`` (broker or learner); None without CURVE."""
        if not self.enabled:
            return None
        if self._client_keys is None:
            self._client_keys = self._resolve("client_secret", self.name, secret=True)
        public, secret = self._client_keys
        return CurveClient(public, secret, self._server_public(server))

    def check_bind(self, host: str) -> None:
        """Refuse to bind ``host`` beyond loopback without CURVE, unless insecure (then warn)."""
        if self.enabled or is_loopback(host):
            return
        if self.insecure:
            if self.log is not None:
                self.log.warning(
                    "binding beyond loopback WITHOUT encryption or client authentication (--insecure): "
                    "anyone who reaches these ports can send data and read weights", bind_host=host,
                    role=self.role)
            return
        raise ConfigError(
            f"refusing to bind the {self.role} on {host!r}, beyond loopback, without CURVE keys: set "
            "security.keys_dir (make keys with `zclaw keys generate DIR`), or pass --insecure "
            "(security.insecure = true) on a network you trust"
        )
