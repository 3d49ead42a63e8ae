"""The model of a multipart audio request: read by a bounded scan of the form."""
from __future__ import annotations

from motor.coordinator.routing.passthrough import form_fields

CT = b"multipart/form-data; boundary=XyZ"


def _part(name: str, value: bytes, filename: str | None = None) -> bytes:
    fn = f'; filename="{filename}"' if filename else ""
    return (f'--XyZ\r\nContent-Disposition: form-data; name="{name}"{fn}\r\n\r\n').encode() \
        + value + b"\r\n"


def test_model_and_stream_after_a_large_file_part():
    body = _part("file", b"\x00" * 2_000_000, "a.wav") + _part("model", b"whisper") \
        + _part("stream", b"true") + b"--XyZ--\r\n"
    assert form_fields(CT, body) == {"model": "whisper", "stream": True}


def test_quoted_boundary_and_not_a_form():
    body = b'--q\r\nContent-Disposition: form-data; name="model"\r\n\r\nm\r\n--q--\r\n'
    assert form_fields(b'multipart/form-data; boundary="q"', body) == {"model": "m"}
    assert form_fields(b"application/json", b"{}") is None
    assert form_fields(b"multipart/form-data", body) is None        # no boundary
    assert form_fields(CT, b"garbage") == {}


def test_scan_is_bounded_by_parts():
    # 10 000 small parts before the model: the scan stops after 64 parts (no model found)
    body = b"".join(_part(f"x{i}", b"v") for i in range(10_000)) + _part("model", b"m") \
        + b"--XyZ--\r\n"
    assert form_fields(CT, body) == {}
