"""`--web.config.file`: TLS and basic auth in the Prometheus exporter-toolkit format, so a
Prometheus scrape config written for node_exporter works unchanged against the agent:

    tls_server_config:
      cert_file: /etc/aiprobe/tls.crt
      key_file: /etc/aiprobe/tls.key
      client_ca_file: /etc/aiprobe/ca.crt          # optional: mutual TLS
      client_auth_type: RequireAndVerifyClientCert # NoClientCert (default), VerifyClientCertIfGiven
      min_version: TLS12                           # TLS10 … TLS13
    basic_auth_users:
      prometheus: $2y$10$...                       # bcrypt hash (htpasswd -nBC 10 "" | tr -d ':\\n')
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import re
import ssl
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import bcrypt
import yaml
from aiprobe.config import ConfigError, read_config_file

_TLS_VERSIONS = {"TLS10": ssl.TLSVersion.TLSv1, "TLS11": ssl.TLSVersion.TLSv1_1,
                 "TLS12": ssl.TLSVersion.TLSv1_2, "TLS13": ssl.TLSVersion.TLSv1_3}
_CLIENT_AUTH = {"NoClientCert": ssl.CERT_NONE, "VerifyClientCertIfGiven": ssl.CERT_OPTIONAL,
                "RequireAndVerifyClientCert": ssl.CERT_REQUIRED}
_TLS_KEYS = {"cert_file", "key_file", "client_ca_file", "client_auth_type", "min_version", "max_version"}
# exporter-toolkit keys that change nothing here: HTTP/2 is not served, cipher choice is OpenSSL's.
_IGNORED_KEYS = {"http_server_config"}


class WebConfigError(ConfigError):
    """A bad web config; the message names the file and the key."""


class BasicAuth:
    """Checks `Authorization: Basic` headers against bcrypt hashes. bcrypt is slow on purpose, so
    results are cached by a hash of the credentials (as exporter-toolkit does) and checks run one at
    a time: wrong passwords sent in a loop cost one core at most."""

    CACHE_SIZE = 256

    def __init__(self, users: dict[str, bytes]) -> None:
        self._users = users
        # Unknown users are checked against a hash too, so timing does not tell which users exist.
        self._dummy = bcrypt.hashpw(b"aiprobe", bcrypt.gensalt(rounds=10))
        self._cache: OrderedDict[bytes, bool] = OrderedDict()
        self._lock = threading.Lock()

    def allows(self, header: str | None) -> bool:
        if not header or not header.startswith("Basic "):
            return False
        try:
            user, _, password = base64.b64decode(header[6:], validate=True).partition(b":")
        except (binascii.Error, ValueError):
            return False
        key = hashlib.sha256(user + b"\0" + password).digest()
        with self._lock:
            if key not in self._cache:
                hashed = self._users.get(user.decode(errors="replace"))
                ok = bcrypt.checkpw(password, hashed or self._dummy) and hashed is not None
                self._cache[key] = ok
                if len(self._cache) > self.CACHE_SIZE:
                    self._cache.popitem(last=False)
            self._cache.move_to_end(key)
            return self._cache[key]


@dataclass
class WebConfig:
    tls: ssl.SSLContext | None = None
    users: dict[str, bytes] = field(default_factory=dict)

    def __post_init__(self) -> None:
        self.auth = BasicAuth(self.users) if self.users else None


def load_web_config(path: str | Path) -> WebConfig:
    data = read_config_file(path, "web config")
    try:
        document = yaml.safe_load(data.decode("utf-8"))
    except UnicodeDecodeError:
        raise WebConfigError(f"web config {path}: not UTF-8 text") from None
    except (yaml.YAMLError, RecursionError) as exc:
        raise WebConfigError(f"web config {path}: not valid YAML ({_first_line(exc)})") from None
    document = document or {}
    if not isinstance(document, dict):
        raise WebConfigError(f"web config {path}: expected a mapping at the top")
    unknown = set(document) - {"tls_server_config", "basic_auth_users"} - _IGNORED_KEYS
    if unknown:
        raise WebConfigError(f"web config {path}: unsupported key {sorted(map(str, unknown))[0]!r}")
    base = Path(path).parent
    tls = _tls_context(document.get("tls_server_config"), base, path)
    users = _users(document.get("basic_auth_users"), path)
    return WebConfig(tls, users)


def _first_line(exc: BaseException) -> str:
    return str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__


def _tls_context(table: Any, base: Path, path: str | Path) -> ssl.SSLContext | None:
    if table is None:
        return None
    if not isinstance(table, dict):
        raise WebConfigError(f"web config {path}: tls_server_config: expected a mapping")
    unknown = set(table) - _TLS_KEYS
    if unknown:
        raise WebConfigError(f"web config {path}: tls_server_config.{sorted(map(str, unknown))[0]}: unsupported")
    if not table.get("cert_file") or not table.get("key_file"):
        raise WebConfigError(f"web config {path}: tls_server_config needs cert_file and key_file")

    def file(key: str) -> str:
        value = table[key]
        if not isinstance(value, str):
            raise WebConfigError(f"web config {path}: tls_server_config.{key}: expected a path")
        return str(base / value)  # relative paths are relative to the web config, as in exporter-toolkit

    context = ssl.SSLContext(ssl.PROTOCOL_TLS_SERVER)
    context.minimum_version = _choice(table, "min_version", _TLS_VERSIONS, ssl.TLSVersion.TLSv1_2, path)
    context.maximum_version = _choice(table, "max_version", _TLS_VERSIONS, ssl.TLSVersion.MAXIMUM_SUPPORTED, path)
    context.verify_mode = _choice(table, "client_auth_type", _CLIENT_AUTH, ssl.CERT_NONE, path)
    try:
        context.load_cert_chain(file("cert_file"), file("key_file"))
        if table.get("client_ca_file"):
            context.load_verify_locations(file("client_ca_file"))
    except (OSError, ssl.SSLError) as exc:
        raise WebConfigError(f"web config {path}: tls_server_config: {getattr(exc, 'strerror', None) or exc}") from None
    if context.verify_mode != ssl.CERT_NONE and not table.get("client_ca_file"):
        raise WebConfigError(f"web config {path}: tls_server_config.client_auth_type needs client_ca_file")
    return context


def _choice(table: dict[str, Any], key: str, choices: dict[str, Any], default: Any, path: str | Path) -> Any:
    value = table.get(key)
    if value is None:
        return default
    if value not in choices:
        raise WebConfigError(f"web config {path}: tls_server_config.{key}: expected one of {', '.join(choices)}")
    return choices[value]


def _users(table: Any, path: str | Path) -> dict[str, bytes]:
    if table is None:
        return {}
    if not isinstance(table, dict):
        raise WebConfigError(f"web config {path}: basic_auth_users: expected a mapping of user: bcrypt hash")
    users = {}
    for user, hashed in table.items():
        if not isinstance(user, str) or not isinstance(hashed, str) or not _is_bcrypt(hashed):
            raise WebConfigError(f"web config {path}: basic_auth_users.{user}: expected a bcrypt hash")
        users[user] = hashed.encode()
    return users


_BCRYPT = re.compile(r"\$2[abxy]?\$(0[4-9]|[12][0-9]|3[01])\$[./A-Za-z0-9]{53}")


def _is_bcrypt(hashed: str) -> bool:
    return _BCRYPT.fullmatch(hashed) is not None
