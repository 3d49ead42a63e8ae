"""API key store: plaintext and hashed entries, names, files and Secret directories, reload."""
from __future__ import annotations

import asyncio
import base64
import hashlib
import os

import pytest

from motor.coordinator.keys import KeyStore, default_name, hash_key, parse_entry
from motor.errors import ConfigError


def run(coro):
    return asyncio.run(coro)


def test_plaintext_keys_are_found_by_name_and_others_are_not():
    ks = KeyStore([("alice", "sk-alice"), (None, "sk-anon")])
    assert ks.enabled and not ks.has_hashed
    assert ks.lookup(b"sk-alice") == "alice"
    assert ks.lookup(b"sk-anon") == default_name("sk-anon")
    assert ks.lookup(b"sk-alice ") is None and ks.lookup(b"") is None
    assert not KeyStore([]).enabled


def test_pbkdf2_entry_is_verified_once_then_found_by_lookup():
    entry = hash_key("sk-secret", iterations=1000)
    assert entry.startswith("pbkdf2_sha256$1000$")
    ks = KeyStore([("svc", entry)])
    assert ks.lookup(b"sk-secret") is None          # not verified yet
    assert run(ks.verify(b"sk-secret")) == "svc"
    assert ks.lookup(b"sk-secret") == "svc"          # remembered: no derivation any more
    assert run(ks.verify(b"sk-wrong")) is None
    assert "sk-secret" not in repr(ks.names)


def test_reference_salt_iterations_hash_form_and_scrypt():
    salt = bytes(range(16))
    dk = hashlib.pbkdf2_hmac("sha256", b"k1", salt, 1000, 32)
    mindie = f"{salt.hex()}:1000:{dk.hex()}"
    sc = hashlib.scrypt(b"k2", salt=salt, n=1024, r=8, p=1, dklen=32)
    scrypt = f"scrypt$1024$8$1${base64.b64encode(salt).decode()}${base64.b64encode(sc).decode()}"
    ks = KeyStore([("old", mindie), ("new", scrypt)])
    assert run(ks.verify(b"k1")) == "old"
    assert run(ks.verify(b"k2")) == "new"
    assert run(ks.verify(b"k3")) is None


def test_repeated_wrong_key_costs_one_derivation(monkeypatch):
    from motor.coordinator import keys
    calls = []
    real = keys._first_match
    monkeypatch.setattr(keys, "_first_match", lambda h, k: calls.append(k) or real(h, k))
    ks = KeyStore([("svc", hash_key("right", iterations=1000))])
    for _ in range(5):
        assert run(ks.verify(b"wrong")) is None
    assert calls == [b"wrong"]


@pytest.mark.parametrize("entry, words", [
    ("pbkdf2_sha256$10$c2FsdA$aGFzaA", "iterations are expected >= 1000, got 10"),
    ("pbkdf2_sha256$x$y", "expected pbkdf2_sha256$<iterations>$<salt>$<hash>"),
    ("pbkdf2_sha256$1000$!!!$aGFzaA", "salt is expected in base64"),
    ("scrypt$1000$8$1$c2FsdA$aGFzaA", "scrypt n is expected a power of 2"),
    ("00112233445566778899aabbccddeeff:5:" + "ab" * 32, "iterations are expected >= 1000, got 5"),
])
def test_bad_hashed_entries_are_config_errors_that_never_echo_the_entry(entry, words):
    with pytest.raises(ConfigError) as e:
        parse_entry(entry, "svc")
    assert words in str(e.value) and "'svc'" in str(e.value)
    assert entry not in str(e.value)


def test_the_same_key_under_two_names_is_refused():
    with pytest.raises(ConfigError, match="API key 1: expected a key no other entry has"):
        KeyStore([("a", "k1"), ("b", "k1")])


def test_duplicate_names_are_refused():
    with pytest.raises(ConfigError, match="API key 1: expected a key name no other key has, got 'a'"):
        KeyStore([("a", "k1"), ("a", "k2")])


def test_key_file_lines_and_reload_on_change(tmp_path):
    f = tmp_path / "keys.txt"
    f.write_text("# team keys\nalice sk-a\n\nsk-bare\n")
    ks = KeyStore([], str(f))
    assert ks.lookup(b"sk-a") == "alice" and ks.lookup(b"sk-bare") == default_name("sk-bare")
    assert not ks.reload_if_changed()
    f.write_text("bob sk-b\n")
    os.utime(f, (1, 1))  # a different stamp whatever the clock's resolution
    assert ks.reload_if_changed()
    assert ks.lookup(b"sk-a") is None and ks.lookup(b"sk-b") == "bob"
    # a broken file keeps the keys in use
    f.write_text("one two three\n")
    os.utime(f, (2, 2))
    assert not ks.reload_if_changed()
    assert ks.lookup(b"sk-b") == "bob"


def test_secret_directory_one_key_per_file(tmp_path):
    d = tmp_path / "secret"
    d.mkdir()
    (d / "alice").write_text("sk-a\n")
    (d / "svc").write_text(hash_key("sk-s", iterations=1000))
    (d / ".hidden").write_text("sk-hidden")
    ks = KeyStore([("cfg", "sk-c")], str(d))
    assert ks.names == {"alice", "svc", "cfg"}
    assert ks.lookup(b"sk-a") == "alice" and ks.lookup(b"sk-c") == "cfg"
    assert run(ks.verify(b"sk-s")) == "svc"
    assert ks.lookup(b"sk-hidden") is None
    (d / "alice").unlink()
    assert ks.reload_if_changed()
    assert ks.lookup(b"sk-a") is None and ks.lookup(b"sk-c") == "cfg"


def test_unreadable_source_names_the_path(tmp_path):
    with pytest.raises(ConfigError, match="api_keys_file: expected a readable file or directory, got .*nope"):
        KeyStore([], str(tmp_path / "nope"))
