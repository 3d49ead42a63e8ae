"""OpenAPI 3.1 document of the controller's HTTP API (served at ``GET /openapi.json``; the
copy in ``docs/openapi/controller.json`` is checked against it by a test).

Schemas of the wire types come from the pydantic models of :mod:`motor.protocol.instances`
(``model_json_schema``), so the document cannot drift from what the controller parses.
"""
from __future__ import annotations

from typing import Any

from pydantic import BaseModel

from motor.controller.registry import ACTIONS
from motor.protocol.instances import Heartbeat, InstanceTable, NodeRegistration

_ERROR = {"$ref": "#/components/schemas/Error"}
_FOLLOWER = {
    "307": {"description": "this controller follows: the same request to the leader "
                           "(`Location`; the body's `leader`)",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/NotLeader"}}}},
    "503": {"description": "no leader known (an election is under way or etcd is down); retry",
            "content": {"application/json": {"schema": {"$ref": "#/components/schemas/NotLeader"}}}},
}


def _json(schema: dict[str, Any], description: str = "OK") -> dict[str, Any]:
    return {"description": description, "content": {"application/json": {"schema": schema}}}


def _err(description: str) -> dict[str, Any]:
    return _json(_ERROR, description)


def _body(ref: str) -> dict[str, Any]:
    return {"required": True,
            "content": {"application/json": {"schema": {"$ref": f"#/components/schemas/{ref}"}}}}


def _obj(props: dict[str, Any], required: list[str] | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"type": "object", "properties": props}
    if required:
        out["required"] = required
    return out


def document() -> dict[str, Any]:
    """The OpenAPI document (a JSON-ready dict)."""
    models: dict[str, type[BaseModel]] = {"NodeRegistration": NodeRegistration,
                                          "Heartbeat": Heartbeat, "InstanceTable": InstanceTable}
    schemas: dict[str, Any] = {}
    for name, model in models.items():
        s = model.model_json_schema(ref_template="#/components/schemas/{model}")
        for k, v in s.pop("$defs", {}).items():
            schemas[k] = v
        schemas[name] = s
    schemas["Error"] = _obj({"error": _obj({"message": {"type": "string"},
                                            "type": {"type": "string"},
                                            "code": {"type": "integer"}})}, ["error"])
    schemas["NotLeader"] = _obj({"error": schemas["Error"]["properties"]["error"],
                                 "leader": {"type": ["string", "null"],
                                            "description": "the leader's URL, null if none"}},
                                ["error", "leader"])
    version = {"version": {"type": "integer", "description": "instance table version"}}
    paths: dict[str, Any] = {
        "/v1/nodes/register": {"post": {
            "summary": "A node manager registers its instances (replaces the node's set)",
            "requestBody": _body("NodeRegistration"),
            "responses": {"200": _json(_obj(version, ["version"])),
                          "400": _err("malformed registration"),
                          "409": _err("an instance id another node registered"), **_FOLLOWER}}},
        "/v1/nodes/heartbeat": {"post": {
            "summary": "Engine health of a node's instances",
            "requestBody": _body("Heartbeat"),
            "responses": {"200": _json(_obj({"known": {"type": "boolean",
                                                       "description": "false: register again"},
                                             **version}, ["known", "version"])),
                          "400": _err("malformed heartbeat"), **_FOLLOWER}}},
        "/v1/nodes/deregister": {"post": {
            "summary": "A node manager leaves with its instances",
            "requestBody": {"required": True, "content": {"application/json": {
                "schema": _obj({"node": {"type": "string"}}, ["node"])}}},
            "responses": {"200": _json(_obj({"known": {"type": "boolean"}, **version})),
                          "400": _err("malformed body"), **_FOLLOWER}}},
        "/v1/instances": {"get": {
            "summary": "The instance table; a long poll with `after`",
            "parameters": [
                {"name": "after", "in": "query", "schema": {"type": "integer"},
                 "description": "answer once the version differs from this one"},
                {"name": "timeout", "in": "query", "schema": {"type": "number"},
                 "description": "seconds to hold at most (capped by watch_timeout_s)"}],
            "responses": {"200": _json({"$ref": "#/components/schemas/InstanceTable"}),
                          "400": _err("after / timeout not numbers"), **_FOLLOWER}}},
        "/v1/instances/{id}/{action}": {"post": {
            "summary": "Lifecycle: drain, stop, start or restart an instance (forwarded to its "
                       "node manager, then the state is set)",
            "parameters": [
                {"name": "id", "in": "path", "required": True, "schema": {"type": "string"}},
                {"name": "action", "in": "path", "required": True,
                 "schema": {"type": "string", "enum": list(ACTIONS)}}],
            "requestBody": {"required": False, "content": {"application/json": {"schema": _obj({
                "drain": {"type": "boolean", "default": True,
                          "description": "restart: drain first"},
                "timeout_s": {"type": "number", "description": "longest drain (s)"},
                "grace_s": {"type": "number", "description": "wait before checking for idle "
                                                             "(s): coordinators see the table"}})}}},
            "responses": {
                "200": _json(_obj({"instance": {"type": "string"}, "action": {"type": "string"},
                                   "state": {"type": "string"}, **version,
                                   "node_manager": {"description": "the node manager's answer"}})),
                "400": _err("malformed body"), "404": _err("unknown instance or action"),
                "409": _err("the node has no management API, or the node manager refused"),
                "502": _err("the node manager did not answer"), **_FOLLOWER}}},
        "/v1/nodes": {"get": {
            "summary": "Registered nodes (diagnostics)",
            "responses": {"200": _json(_obj({**version, "nodes": {"type": "array", "items": _obj({
                "node": {"type": "string"}, "host": {"type": "string"},
                "mgmt_port": {"type": ["integer", "null"]},
                "last_heartbeat_age_s": {"type": "number"},
                "instances": {"type": "array", "items": {"type": "string"}}})}})),
                **_FOLLOWER}}},
        "/v1/leader": {"get": {
            "summary": "Who leads (every controller answers)",
            "responses": {"200": _json(_obj({
                "self": {"type": "string"}, "is_leader": {"type": "boolean"},
                "leader": {"type": ["string", "null"]},
                "peers": {"type": "array", "items": {"type": "string"},
                          "description": "controller.peers: every controller's URL"},
                "etcd": {"type": ["object", "null"]}}))}}},
        "/openapi.json": {"get": {"summary": "This document",
                                  "responses": {"200": _json({"type": "object"})}}},
        "/health": {"get": {"summary": "Alive", "responses": {"200": _json({"type": "object"})}}},
        "/readiness": {"get": {
            "summary": "Leader, or a follower that knows the leader",
            "responses": {"200": _json({"type": "object"}),
                          "503": _json({"$ref": "#/components/schemas/NotLeader"},
                                       "no leader known")}}},
        "/metrics": {"get": {"summary": "Prometheus text format (docs/metrics.md)",
                             "responses": {"200": {"description": "OK", "content": {
                                 "text/plain": {"schema": {"type": "string"}}}}}}},
        "/metrics/engines": {"get": {
            "summary": "The engines' own /metrics (vLLM, SGLang, motor sim) with the labels "
                       "motor_instance, motor_node, motor_role, dp_rank added, and "
                       "motor_engine_scrape_up / _duration_seconds / _samples per endpoint "
                       "(scraped at most once a second; docs/metrics.md)",
            "responses": {"200": {"description": "Prometheus text format 0.0.4", "content": {
                "text/plain": {"schema": {"type": "string"}}}}, **_FOLLOWER}}},
        "/v1/engines": {"get": {
            "summary": "The engines' load per endpoint, from their /metrics (the cluster page "
                       "reads it)",
            "responses": {"200": _json(_obj({
                "scraped_at": {"type": "number", "description": "Unix seconds"},
                "scrape_s": {"type": "number", "description": "the scrape round, seconds"},
                **version,
                "endpoints": {"type": "array", "items": _obj({
                    "instance": {"type": "string"}, "node": {"type": "string"},
                    "role": {"type": "string"}, "dp_rank": {"type": "integer"},
                    "url": {"type": "string"},
                    "up": {"type": "boolean", "description": "its /metrics answered in time"},
                    "error": {"type": ["string", "null"]},
                    "scrape_s": {"type": "number"},
                    "waiting": {"type": ["number", "null"]},
                    "running": {"type": ["number", "null"]},
                    "kv_usage": {"type": ["number", "null"], "description": "0..1"},
                    "prefix_hits": {"type": ["number", "null"], "description": "tokens"},
                    "prefix_queries": {"type": ["number", "null"], "description": "tokens"},
                    "prefix_hit_ratio": {"type": ["number", "null"], "description": "0..1"},
                    "ttft_sum_s": {"type": ["number", "null"]},
                    "ttft_count": {"type": ["number", "null"]}})}})),
                **_FOLLOWER}}},
        "/cluster": {"get": {
            "summary": "The live cluster page (HTML, inline script; polls the JSON routes)",
            "responses": {"200": {"description": "OK", "content": {
                "text/html": {"schema": {"type": "string"}}}}, **_FOLLOWER}}},
    }
    return {"openapi": "3.1.0",
            "info": {"title": "motor controller", "version": "1",
                     "description": "Registry of nodes and instances, the live instance table, "
                                    "the lifecycle API; with etcd, only the leader serves "
                                    "(docs/control-plane.md)."},
            "paths": paths, "components": {"schemas": schemas}}


if __name__ == "__main__":   # python -m motor.controller.openapi > docs/openapi/controller.json
    import json
    print(json.dumps(document(), indent=2, sort_keys=True))
