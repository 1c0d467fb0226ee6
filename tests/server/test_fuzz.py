"""Bounded property-based fuzz of the HTTP/JSON surface against the server's own OpenAPI
description (GET /openapi.json), with hypothesis and hypothesis-jsonschema (issue 21).

For every POST operation, request bodies come from three strategies: bodies valid by the
operation's schema; such bodies with fields replaced or added by arbitrary JSON values (wrong
types, huge numbers, deep nesting, unknown keys); and arbitrary bytes. The properties: no
answer is a 5xx, every 4xx is an OpenAI error object naming its status, and the process is
alive and healthy at the end (0 crashes). The case count is fixed (FUZZ_EXAMPLES per
strategy and operation, default below), and generation is cheap: max_tokens, n and prompt
sizes are narrowed in the schema copy the test generates from, since the point is the
surface, not throughput.
"""
import copy
import json
import os
import socket
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis_jsonschema import from_schema

from conftest import Server

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "60"))
SETTINGS = settings(max_examples=EXAMPLES, deadline=None, database=None,
                    suppress_health_check=list(HealthCheck))


@pytest.fixture(scope="module")
def fuzz_server(model_dir):
    s = Server(model_dir, "--max-model-len", "256", "--max-body-bytes", "65536", "--max-queue", "64",
               "--max-media-bytes", "4096", name="fuzz")
    yield s
    assert s.proc.poll() is None, "the server died during the fuzz: " + s.log_text()
    s.stop()


@pytest.fixture(scope="module")
def spec(fuzz_server):
    with urllib.request.urlopen(fuzz_server.url + "/openapi.json", timeout=10) as r:
        return json.loads(r.read())


def inline(node, schemas):
    if isinstance(node, dict):
        if "$ref" in node:
            return inline(schemas[node["$ref"].rsplit("/", 1)[1]], schemas)
        return {k: inline(v, schemas) for k, v in node.items()}
    if isinstance(node, list):
        return [inline(v, schemas) for v in node]
    return node


def narrowed(schema):
    """The operation's schema with generation kept cheap (the server's bounds stay wider)."""
    s = copy.deepcopy(schema)

    def walk(node):
        if isinstance(node, dict):
            props = node.get("properties", {})
            for key, limit in (("max_tokens", 4), ("max_completion_tokens", 4), ("n", 2), ("min_tokens", 4),
                               ("top_logprobs", 3), ("logprobs", 3), ("prompt_logprobs", 2)):
                if key in props and props[key].get("type") == "integer":
                    props[key]["maximum"] = limit
            if node.get("type") == "array":
                node["maxItems"] = min(node.get("maxItems", 4), 4)
            if node.get("type") == "string" and "enum" not in node and "pattern" not in node:
                node["maxLength"] = 40
            for v in node.values():
                walk(v)
        elif isinstance(node, list):
            for v in node:
                walk(v)

    walk(s)
    return s


json_values = st.recursive(
    st.none() | st.booleans() | st.integers(min_value=-2**70, max_value=2**70) |
    st.floats(allow_nan=False, allow_infinity=False) | st.text(max_size=30),
    lambda inner: st.lists(inner, max_size=4) | st.dictionaries(st.text(max_size=10), inner, max_size=4),
    max_leaves=12)


def post(server, path, data):
    req = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def check(server, path, data):
    status, body = post(server, path, data)
    assert status < 500, (path, data[:300], status, body[:300])
    if status >= 400:
        err = json.loads(body)["error"]
        assert err["code"] == status and isinstance(err["message"], str), body[:300]
    else:
        # A 200: JSON, or an SSE stream ending in [DONE] with no error event.
        text = body.decode(errors="replace")
        if text.lstrip().startswith("data:"):
            assert text.rstrip().endswith("data: [DONE]"), text[-300:]
            assert '"error"' not in text.split("data: [DONE]")[0].rsplit("data:", 1)[-1]
        else:
            assert "error" not in json.loads(text), text[:300]


OPERATIONS = ["/v1/completions", "/v1/chat/completions", "/tokenize", "/detokenize"]


@pytest.mark.parametrize("path", OPERATIONS)
def test_schema_valid_bodies(fuzz_server, spec, path):
    schemas = spec["components"]["schemas"]
    body_schema = narrowed(inline(spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"],
                                  schemas))

    @SETTINGS
    @given(body=from_schema(body_schema))
    def run(body):
        check(fuzz_server, path, json.dumps(body).encode())

    run()


@pytest.mark.parametrize("path", OPERATIONS)
def test_mutated_bodies(fuzz_server, spec, path):
    schemas = spec["components"]["schemas"]
    op_schema = inline(spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"], schemas)
    keys = sorted(set(op_schema.get("properties", {})) |
                  {k for alt in op_schema.get("oneOf", []) for k in alt.get("properties", {})})
    body_schema = narrowed(op_schema)

    @SETTINGS
    @given(body=from_schema(body_schema), changes=st.dictionaries(st.sampled_from(keys + ["zz_unknown"]), json_values,
                                                                   min_size=1, max_size=3))
    def run(body, changes):
        if isinstance(body, dict):
            body.update(changes)
        check(fuzz_server, path, json.dumps(body).encode())

    run()


@pytest.mark.parametrize("path", OPERATIONS)
def test_arbitrary_bytes(fuzz_server, path):
    @SETTINGS
    @given(data=st.binary(max_size=300) | json_values.map(lambda v: json.dumps(v).encode()))
    def run(data):
        check(fuzz_server, path, data)

    run()


def test_alive_and_healthy_after_the_fuzz(fuzz_server):
    assert fuzz_server.proc.poll() is None
    with urllib.request.urlopen(fuzz_server.url + "/health", timeout=10) as r:
        assert r.status == 200
    with socket.create_connection(("127.0.0.1", fuzz_server.port), timeout=10):
        pass
