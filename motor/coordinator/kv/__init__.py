"""KV-cache-aware routing state: event decoding is in :mod:`motor.protocol.kv_events`,
ingestion (events -> index operations) in :mod:`.ingest`, the ZMQ socket loops in
:mod:`.subscriber`, slots / indexes / request keys in :mod:`.router`."""
from __future__ import annotations

from motor.coordinator.kv.ingest import KvIngest, SeqCheck
from motor.coordinator.kv.router import MAX_INSTANCES, ApproximateIndex, KvRouter

__all__ = ["ApproximateIndex", "KvIngest", "KvRouter", "MAX_INSTANCES", "SeqCheck"]
