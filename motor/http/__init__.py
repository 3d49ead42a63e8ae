"""Minimal HTTP/1.1 server and pooled client on uvloop + httptools (shared plumbing)."""
from motor.http.client import Client, Pool, UpstreamClosed, UpstreamResponse, UpstreamTimeout  # noqa: F401
from motor.http.server import HttpServer, Request, Response, Router, install_uvloop  # noqa: F401
