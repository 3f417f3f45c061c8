"""Tenants: who a request is, from its API key, and what that tenant may hold.

Each API key names a tenant. A tenant's stored videos, latency history and video-cache
entries are its own: another tenant's id is 404, its history is not in the report, and a
cache entry is found only by requests of the tenant that built it (the tenant is part of
the cache key's salt, as vLLM's ``cache_salt``), unless the operator shares the cache across
tenants (``--share-cache-across-tenants``). One key (or more) may be the admin's: the admin
reads every tenant's history and the server's metrics.

Where the keys come from (all of them together):

* ``MMINFER_API_KEY`` (or ``--api-key``): the operator's key, tenant ``default``, admin.
  Alone, it is today's single-key server: one tenant, everything visible to it.
* ``MMINFER_API_KEY_<NAME>=<key>`` environment entries, one per tenant (``<name>``
  lowercased).
* ``--api-keys-file FILE``: lines ``<key> <tenant> [admin] [quota=value ...]`` (``#``
  comments), or JSON: a list of ``{"key", "tenant", "admin", <quota>: value}`` objects (or
  ``{"keys": [...]}``).

Quotas per tenant (a key line's, else the ``--tenant-*`` flag, else the default share):
``max_videos`` and ``max_video_gb`` of the video store (default: an equal share of the
store's count and bytes, so no tenant can fill what another may use; the same bytes
stored by two tenants are on disk once and charged to each), ``max_uploads`` (request
bodies received at once) and ``max_queue`` (requests waiting, uploading or running at once)
(default: half of the server's, at least one, so one tenant's traffic always leaves the
others room). With one tenant, none of them is narrower than the server's own limits.

Without any key every request is the one tenant ``default`` (and may read everything).
"""

from __future__ import annotations

import hmac
import json
import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path

from mminfer.errors import ConfigError, MMInferError

DEFAULT = "default"
ENV_PREFIX = "MMINFER_API_KEY_"
NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]{0,63}$")
QUOTAS = ("max_videos", "max_video_gb", "max_uploads", "max_queue")


class TooManyFromTenant(MMInferError):
    """A tenant already has as many bodies or requests in flight as its quota allows."""
    code = "too_many_requests"
    http_status = 429


@dataclass(frozen=True)
class Tenant:
    name: str
    admin: bool = False
    max_videos: int | None = None        # None: the --tenant-* flag, else the default share
    max_video_gb: float | None = None
    max_uploads: int | None = None
    max_queue: int | None = None


@dataclass(frozen=True)
class Quota:
    """A tenant's resolved limits (None: no limit beyond the server's own)."""
    max_videos: int | None
    max_video_bytes: int | None
    max_uploads: int | None
    max_queue: int | None


ANONYMOUS = Tenant(DEFAULT, admin=True)


@dataclass
class Keys:
    """The server's keys and their tenants."""
    by_key: dict[str, Tenant] = field(default_factory=dict)

    @property
    def enabled(self) -> bool:
        """Whether requests must carry a key."""
        return bool(self.by_key)

    def tenants(self) -> dict[str, Tenant]:
        out: dict[str, Tenant] = {}
        for t in self.by_key.values():
            out.setdefault(t.name, t)
        return out or {DEFAULT: ANONYMOUS}

    def lookup(self, token: str) -> Tenant | None:
        """The tenant of ``token``; every key is compared (in constant time each), so the
        time taken says nothing about which key came close."""
        found = None
        raw = token.encode()
        for key, tenant in self.by_key.items():
            if hmac.compare_digest(raw, key.encode()):
                found = tenant
        return found

    def add(self, key: str, tenant: Tenant, where: str):
        if not key or any(c.isspace() for c in key):
            raise ConfigError(f"{where}: an API key must be non-empty without spaces")
        if not NAME.match(tenant.name):
            raise ConfigError(f"{where}: tenant name {tenant.name!r} must be 1-64 letters, "
                              f"digits, '_', '.' or '-'")
        if key in self.by_key:
            raise ConfigError(f"{where}: this key is given twice")
        for other in self.by_key.values():     # one tenant, one set of rights and quotas
            if other.name == tenant.name and other != tenant:
                raise ConfigError(f"{where}: tenant {tenant.name!r} is given with different "
                                  f"rights or quotas than before")
        self.by_key[key] = tenant

    def quota(self, tenant: Tenant, s) -> Quota:
        """``tenant``'s limits on the server of settings ``s``."""
        n = len(self.tenants())

        def pick(own, flag, default):
            return own if own is not None else flag if flag is not None else default

        gb = pick(tenant.max_video_gb, s.tenant_max_video_gb, None)
        places = s.max_concurrent_uploads or s.queue_size
        return Quota(
            max_videos=pick(tenant.max_videos, s.tenant_max_videos,
                            None if n == 1 else max(1, s.video_store_max // n)),
            max_video_bytes=int(gb * 2**30) if gb is not None else
            (None if n == 1 else int(s.video_store_gb * 2**30 / n)),
            max_uploads=pick(tenant.max_uploads, s.tenant_max_uploads,
                             None if n == 1 else max(1, places // 2)) or None,
            max_queue=pick(tenant.max_queue, s.tenant_max_queue,
                           None if n == 1 else max(1, s.queue_size // 2)) or None)


def _tenant(name: str, admin, quotas: dict, where: str) -> Tenant:
    kinds = {f.name: f.type for f in fields(Tenant)}
    t = Tenant(str(name), admin=bool(admin))
    for k, v in quotas.items():
        if k not in QUOTAS:
            raise ConfigError(f"{where}: unknown setting {k!r} (quotas: {', '.join(QUOTAS)})")
        try:
            num = float(v) if "float" in str(kinds[k]) else int(v)
        except (TypeError, ValueError):
            raise ConfigError(f"{where}: {k} must be a number, not {v!r}") from None
        if num < 0:
            raise ConfigError(f"{where}: {k} must be >= 0")
        t = replace(t, **{k: num})
    return t


def parse_file(path) -> list[tuple[str, Tenant, str]]:
    """(key, tenant, where) of each entry of a keys file (text lines or JSON)."""
    p = Path(path)
    try:
        text = p.read_text(encoding="utf-8")
    except OSError as e:
        raise ConfigError(f"--api-keys-file {p}: cannot be read ({e.strerror or e})") from None
    out = []
    if text.lstrip().startswith(("[", "{")):
        try:
            data = json.loads(text)
        except ValueError as e:
            raise ConfigError(f"--api-keys-file {p}: not valid JSON ({e})") from None
        rows = data.get("keys") if isinstance(data, dict) else data
        if not isinstance(rows, list):
            raise ConfigError(f"--api-keys-file {p}: JSON must be a list of keys or "
                              f"{{\"keys\": [...]}}")
        for i, row in enumerate(rows):
            where = f"--api-keys-file {p}, entry {i}"
            if not isinstance(row, dict) or not isinstance(row.get("key"), str) \
                    or not isinstance(row.get("tenant"), str):
                raise ConfigError(f"{where}: an entry is an object with string `key` and "
                                  f"`tenant`")
            quotas = {k: v for k, v in row.items() if k not in ("key", "tenant", "admin")}
            out.append((row["key"], _tenant(row["tenant"], row.get("admin", False), quotas,
                                            where), where))
        return out
    for n, line in enumerate(text.splitlines(), 1):
        words = line.split("#", 1)[0].split()
        if not words:
            continue
        where = f"--api-keys-file {p}, line {n}"
        if len(words) < 2:
            raise ConfigError(f"{where}: a line is `<key> <tenant> [admin] [quota=value ...]`")
        admin, quotas = False, {}
        for w in words[2:]:
            if w == "admin":
                admin = True
            elif "=" in w:
                k, _, v = w.partition("=")
                quotas[k] = v
            else:
                raise ConfigError(f"{where}: {w!r} is neither `admin` nor `quota=value`")
        out.append((words[0], _tenant(words[1], admin, quotas, where), where))
    return out


def env_keys(environ=None) -> tuple[tuple[str, str], ...]:
    """(tenant, key) of the ``MMINFER_API_KEY_<NAME>`` environment entries."""
    env = os.environ if environ is None else environ
    return tuple(sorted((k[len(ENV_PREFIX):].lower(), v) for k, v in env.items()
                        if k.startswith(ENV_PREFIX) and len(k) > len(ENV_PREFIX) and v))


def load(s) -> Keys:
    """The keys of settings ``s`` (``api_key``, ``api_keys``, ``api_keys_file``)."""
    keys = Keys()
    if s.api_key:
        keys.add(s.api_key, Tenant(DEFAULT, admin=True), "MMINFER_API_KEY")
    for name, key in s.api_keys:
        keys.add(key, Tenant(name), f"{ENV_PREFIX}{name.upper()}")
    if s.api_keys_file:
        for key, tenant, where in parse_file(s.api_keys_file):
            keys.add(key, tenant, where)
    if s.metrics_token and keys.lookup(s.metrics_token) is not None:
        raise ConfigError("--metrics-token must not be one of the API keys")
    return keys


class Places:
    """Requests or bodies in flight per tenant; all calls come from the event loop."""

    def __init__(self, what: str, flag: str):
        self.what, self.flag = what, flag
        self.active: dict[str, int] = {}

    def begin(self, tenant: str, limit: int | None) -> "Place":
        n = self.active.get(tenant, 0)
        if limit is not None and n >= limit:
            raise TooManyFromTenant(
                f"your API key's tenant already has {n} {self.what} at once, its limit on "
                f"this server ({self.flag}); retry when one has finished",
                tenant_limit=limit)
        self.active[tenant] = n + 1
        return Place(self, tenant)


class Place:
    def __init__(self, owner: Places, tenant: str):
        self.owner, self.tenant, self.open = owner, tenant, True

    def end(self):
        if self.open:
            self.open = False
            n = self.owner.active.get(self.tenant, 1) - 1
            if n <= 0:
                self.owner.active.pop(self.tenant, None)
            else:
                self.owner.active[self.tenant] = n


def cache_salt(tenant: Tenant, request_salt: str | None, shared: bool,
               single_tenant: bool) -> str | None:
    """The salt of a request's video-cache key: the tenant (unless the cache is shared or
    there is one tenant) and the request's own ``cache_salt``. JSON of the pair, so no
    request salt can spell another tenant's."""
    mine = None if shared or single_tenant else tenant.name
    if mine is None and request_salt is None:
        return None
    return json.dumps([mine, request_salt])
