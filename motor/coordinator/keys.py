"""API keys of the gateway: plaintext or hashed, each with a name, reloaded when their file changes.

A key entry is one of

* a plaintext key (any text that is not one of the hashed forms below);
* ``pbkdf2_sha256$<iterations>$<salt>$<hash>``: PBKDF2-HMAC-SHA256 (RFC 8018), salt and
  derived key in standard base64 (padding optional), the derived key 32 bytes;
* ``scrypt$<n>$<r>$<p>$<salt>$<hash>``: scrypt (RFC 7914), same encodings;
* ``<salt>:<iterations>:<hash>`` with hex salt and hex hash: PBKDF2-HMAC-SHA256 in the
  ``salt:iterations:hash`` form MindIE-Motor accepts (``../shared/reference/motor_reference.md``,
  "API key").

``motor.coordinator.keys.hash_key(key)`` writes the ``pbkdf2_sha256`` form (600 000 iterations,
OWASP's 2023 figure for PBKDF2-SHA256).

Every key has a name (from the config or the file; else ``key-<8 hex of SHA-256 of the entry>``)
that metrics, limits and logs use; the key itself never leaves this module.

Cost on the request path: a presented key is reduced to its SHA-256 digest, which is looked up
in a dict of the plaintext keys' digests and of the digests of presented keys already verified
against a hashed entry. A lookup's timing depends on the digest only, never on the key's
characters, so it cannot be used to guess a key byte by byte. A key not found there is checked
against the hashed entries by :meth:`KeyStore.verify`, in a thread (PBKDF2 at 600k iterations
is about 0.13 s of CPU per entry on a 2-core CI machine, never on the event loop), at most
``max_concurrent_verifications`` at a time; digests that failed are remembered (bounded) so a
client repeating a wrong key costs one derivation, not one per request.

Sources: ``coordinator.api_keys`` (strings, or ``{name, key}`` mappings), the env var
``MOTOR_API_KEYS`` (comma-separated), and ``coordinator.api_keys_file``: a file with one
entry per line (``name key`` or just ``key``; ``#`` comments), or a directory with one entry per
file, the file's name being the key's name (a Kubernetes Secret mounted as a volume; files whose
name starts with ``.`` are skipped, as are the Secret's ``..data`` links). The file or directory
is re-read when its modification time changes (checked every ``reload_interval_s``).
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import hashlib
import hmac
import logging
import os
import re
import secrets
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from motor.errors import ConfigError

logger = logging.getLogger(__name__)

PBKDF2_DEFAULT_ITERATIONS = 600_000
_MIN_ITERATIONS = 1000
_HEX_FORM = re.compile(r"^([0-9a-fA-F]{8,}):([0-9]{1,9}):([0-9a-fA-F]{32,})$")


@dataclass(frozen=True)
class HashedKey:
    """One hashed entry: ``kdf`` is ``pbkdf2_sha256`` or ``scrypt``; ``params`` its cost
    figures (iterations, or n, r, p); ``salt`` and ``digest`` raw bytes."""
    name: str
    kdf: str
    params: tuple[int, ...]
    salt: bytes
    digest: bytes

    def matches(self, key: bytes) -> bool:
        """Derive from ``key`` and compare in constant time (CPU-bound: call off the loop)."""
        if self.kdf == "pbkdf2_sha256":
            got = hashlib.pbkdf2_hmac("sha256", key, self.salt, self.params[0], len(self.digest))
        else:
            n, r, p = self.params
            got = hashlib.scrypt(key, salt=self.salt, n=n, r=r, p=p, dklen=len(self.digest),
                                 maxmem=256 * 1024 * 1024)
        return hmac.compare_digest(got, self.digest)


def _b64(text: str, what: str, entry_name: str) -> bytes:
    try:
        return base64.b64decode(text + "=" * (-len(text) % 4), validate=True)
    except (binascii.Error, ValueError):
        raise ConfigError(f"API key {entry_name!r}: {what} is expected in base64, got "
                          f"{text[:12]!r}...") from None


def parse_entry(entry: str, name: str | None = None) -> str | HashedKey:
    """One key entry -> the plaintext key (``str``) or a :class:`HashedKey`.

    Raises
    ------
    ConfigError
        for a hashed form with bad figures (naming the key's name, never its text): too few
        iterations, a bad encoding, scrypt ``n`` not a power of two.
    """
    label = name or default_name(entry)
    if entry.startswith("pbkdf2_sha256$"):
        parts = entry.split("$")
        if len(parts) != 4 or not parts[1].isdigit():
            raise ConfigError(f"API key {label!r}: expected pbkdf2_sha256$<iterations>$<salt>"
                              f"$<hash>, got {len(parts)} '$'-separated fields")
        it = int(parts[1])
        if it < _MIN_ITERATIONS:
            raise ConfigError(f"API key {label!r}: iterations are expected >= {_MIN_ITERATIONS}, "
                              f"got {it}")
        return HashedKey(label, "pbkdf2_sha256", (it,), _b64(parts[2], "salt", label),
                         _b64(parts[3], "hash", label))
    if entry.startswith("scrypt$"):
        parts = entry.split("$")
        if len(parts) != 6 or not all(x.isdigit() for x in parts[1:4]):
            raise ConfigError(f"API key {label!r}: expected scrypt$<n>$<r>$<p>$<salt>$<hash>, "
                              f"got {len(parts)} '$'-separated fields")
        n, r, p = (int(x) for x in parts[1:4])
        if n < 2 or n & (n - 1) or r < 1 or p < 1:
            raise ConfigError(f"API key {label!r}: scrypt n is expected a power of 2 >= 2 and "
                              f"r, p >= 1, got n={n} r={r} p={p}")
        return HashedKey(label, "scrypt", (n, r, p), _b64(parts[4], "salt", label),
                         _b64(parts[5], "hash", label))
    m = _HEX_FORM.match(entry)
    if m:
        it = int(m.group(2))
        if it < _MIN_ITERATIONS:
            raise ConfigError(f"API key {label!r}: iterations are expected >= {_MIN_ITERATIONS}, "
                              f"got {it}")
        return HashedKey(label, "pbkdf2_sha256", (it,), bytes.fromhex(m.group(1)),
                         bytes.fromhex(m.group(3)))
    return entry


def default_name(entry: str) -> str:
    """The name of an entry given without one: ``key-`` + 8 hex digits of its SHA-256."""
    return "key-" + hashlib.sha256(entry.encode()).hexdigest()[:8]


def hash_key(key: str, iterations: int = PBKDF2_DEFAULT_ITERATIONS) -> str:
    """The ``pbkdf2_sha256$...`` entry of ``key`` (16-byte random salt)."""
    salt = secrets.token_bytes(16)
    dk = hashlib.pbkdf2_hmac("sha256", key.encode(), salt, iterations, 32)
    return (f"pbkdf2_sha256${iterations}${base64.b64encode(salt).decode().rstrip('=')}"
            f"${base64.b64encode(dk).decode().rstrip('=')}")


def read_key_source(path: str) -> list[tuple[str | None, str, str]]:
    """(name or None, entry, where it comes from) of a key file or a Secret-style directory.

    Raises
    ------
    ConfigError
        when the path cannot be read (naming it and the OS's reason) or a line has more than
        two fields.
    """
    out: list[tuple[str | None, str, str]] = []
    try:
        if os.path.isdir(path):
            for fn in sorted(os.listdir(path)):
                full = os.path.join(path, fn)
                if fn.startswith(".") or not os.path.isfile(full):
                    continue
                with open(full, encoding="utf-8") as f:
                    text = f.read().strip()
                if text:
                    out.append((fn, text, f"coordinator.api_keys_file {full}"))
            return out
        with open(path, encoding="utf-8") as f:
            lines = f.read().splitlines()
    except OSError as e:
        raise ConfigError(f"coordinator.api_keys_file: expected a readable file or directory, "
                          f"got {path!r} ({e.strerror})") from None
    for i, line in enumerate(lines, 1):
        line = line.strip()
        if not line or line.startswith("#"):
            continue
        fields = line.split()
        where = f"coordinator.api_keys_file {path} line {i}"
        if len(fields) > 2:
            raise ConfigError(f"{where}: expected `name key` or `key`, got {len(fields)} fields")
        out.append((fields[0], fields[1], where) if len(fields) == 2 else
                   (None, fields[0], where))
    return out


def _source_stamp(path: str) -> tuple[float, ...]:
    """Modification times that change when the file, or any file of the directory, does."""
    try:
        if os.path.isdir(path):
            return tuple(os.stat(os.path.join(path, f)).st_mtime for f in sorted(os.listdir(path))
                         if not f.startswith(".")) + (os.stat(path).st_mtime,)
        return (os.stat(path).st_mtime, float(os.stat(path).st_size))
    except OSError:
        return ()


class KeyStore:
    """The keys clients must present (``Authorization: Bearer <key>``) and their names.

    Parameters
    ----------
    entries : iterable of (name or None, entry[, where])
        from the config and the environment; ``where`` (``coordinator.api_keys[2]``) names
        the entry in errors.
    path : str or None
        ``coordinator.api_keys_file`` (read now, re-read by :meth:`reload_if_changed`).
    max_concurrent_verifications : int
        hashed-key derivations running at once (each in a thread).
    failed_cache : int
        digests of presented keys that matched nothing, remembered (least recent dropped).

    Raises
    ------
    ConfigError
        from :func:`parse_entry` / :func:`read_key_source`, or for two keys with one name.
    """

    def __init__(self, entries: Iterable[tuple[str | None, str] | tuple[str | None, str, str]],
                 path: str | None = None,
                 max_concurrent_verifications: int = 2, failed_cache: int = 4096) -> None:
        self._static: list[tuple[str | None, str, str]] = [
            (e[0], e[1], e[2] if len(e) > 2 else f"API key {i}")
            for i, e in enumerate(entries)]
        self.path = path
        self._stamp: tuple[float, ...] = _source_stamp(path) if path else ()
        self._sem = asyncio.Semaphore(max_concurrent_verifications)
        self._failed: OrderedDict[bytes, None] = OrderedDict()
        self._failed_cap = failed_cache
        self._known: dict[bytes, str] = {}
        self._hashed: list[HashedKey] = []
        self._load(self._static + (read_key_source(path) if path else []))

    def _load(self, pairs: list[tuple[str | None, str, str]]) -> None:
        known: dict[bytes, str] = {}
        hashed: list[HashedKey] = []
        names: dict[str, str] = {}       # name -> where it was given
        texts: dict[str, str] = {}       # entry text -> where
        for name, entry, where in pairs:
            try:
                parsed = parse_entry(entry, name)
            except ConfigError as e:
                raise ConfigError(f"{where}: {e}") from None
            label = parsed.name if isinstance(parsed, HashedKey) else (name or default_name(entry))
            if label in names:
                raise ConfigError(f"{where}: expected a key name no other key has, got "
                                  f"{label!r} (also {names[label]})")
            if entry in texts:
                raise ConfigError(f"{where}: expected a key no other entry has, got the key "
                                  f"of {texts[entry]} again (which name would its limits use?)")
            names[label] = where
            texts[entry] = where
            if isinstance(parsed, HashedKey):
                hashed.append(parsed)
            else:
                known[hashlib.sha256(parsed.encode()).digest()] = label
        self._known, self._hashed = known, hashed
        self._failed.clear()
        self.names = frozenset(names)

    @property
    def enabled(self) -> bool:
        """Whether any key is configured (no key = no check)."""
        return bool(self.names)

    def lookup(self, key: bytes) -> str | None:
        """The name of ``key`` if it is a plaintext key or a hashed one verified before;
        ``None`` = unknown so far (try :meth:`verify` when :attr:`has_hashed`)."""
        return self._known.get(hashlib.sha256(key).digest())

    def known_bad(self, key: bytes) -> bool:
        """Whether ``key`` was checked against the hashed entries before and matched none."""
        return hashlib.sha256(key).digest() in self._failed

    @property
    def has_hashed(self) -> bool:
        return bool(self._hashed)

    async def verify(self, key: bytes) -> str | None:
        """The name of ``key`` checked against the hashed entries (in a thread), or ``None``.
        A match is remembered (next :meth:`lookup` finds it), a miss too (bounded)."""
        d = hashlib.sha256(key).digest()
        name = self._known.get(d)
        if name is not None or not self._hashed:
            return name
        if d in self._failed:
            self._failed.move_to_end(d)
            return None
        hashed = self._hashed
        async with self._sem:
            name = self._known.get(d)  # verified meanwhile by another request
            if name is None and d not in self._failed:
                name = await asyncio.to_thread(_first_match, hashed, key)
            if hashed is not self._hashed:  # reloaded meanwhile: the answer may be stale
                return None
        if name is None:
            self._failed[d] = None
            if len(self._failed) > self._failed_cap:
                self._failed.popitem(last=False)
        else:
            self._known[d] = name
        return name

    def reload_if_changed(self) -> bool:
        """Re-read ``path`` if it changed; True when the key set was replaced. A source that
        fails to parse keeps the current keys (logged as an error)."""
        if not self.path:
            return False
        stamp = _source_stamp(self.path)
        if stamp == self._stamp:
            return False
        self._stamp = stamp
        try:
            self._load(self._static + read_key_source(self.path))
        except ConfigError as e:
            logger.error("API keys not reloaded, the previous ones stay in use: %s", e)
            return False
        logger.info("API keys reloaded from %s: %d key(s)", self.path, len(self.names))
        return True


def _first_match(hashed: list[HashedKey], key: bytes) -> str | None:
    for h in hashed:
        if h.matches(key):
            return h.name
    return None
