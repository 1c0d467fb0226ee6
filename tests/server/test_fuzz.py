"""Bounded property-based fuzz of the HTTP/JSON surface against the server's own OpenAPI
description (GET /openapi.json), with hypothesis (issue 21).

For every POST operation, request bodies come from three strategies: bodies valid by the
operation's schema; such bodies with fields replaced or added by arbitrary JSON values (wrong
types, huge numbers, deep nesting, unknown keys); and arbitrary bytes. The properties: no
answer is a 5xx, every 4xx is an OpenAI error object naming its status, and the process is
alive and healthy at the end (0 crashes). The case count is fixed (FUZZ_EXAMPLES per
strategy and operation, default below), and generation is cheap: max_tokens, n and prompt
sizes are narrowed in the schema copy the test generates from, since the point is the
surface, not throughput.

Schema -> strategy is the small converter below (the subset of JSON Schema the document
uses: type, enum, oneOf, properties / required / additionalProperties, items, minimum /
maximum / exclusiveMinimum, minItems / maxItems, maxLength, pattern as "any string"), not
hypothesis-jsonschema, whose 0.23 does not run on current hypothesis.
"""
import collections
import copy
import json
import os
import socket
import urllib.error
import urllib.request

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from conftest import Server

EXAMPLES = int(os.environ.get("FUZZ_EXAMPLES", "50"))
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
            # The served model's name, and fields documented as refused, are left to the mutated
            # bodies; token ids stay inside ml4-tiny's vocabulary.
            for key in ("model", "suffix", "best_of"):
                props.pop(key, None)
            if node.get("type") == "integer" and node.get("minimum") == 0 and node.get("maximum") == 1 << 30:
                node["maximum"] = 400
            if "propertyNames" in node:  # logit_bias keys: token ids of ml4-tiny
                node["propertyNames"] = {"pattern": "^[1-3]?[0-9]{1,2}$"}
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


def from_schema(schema):
    """A hypothesis strategy for values valid under `schema` (the subset described above)."""
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    if "oneOf" in schema:
        return st.one_of([from_schema(s) for s in schema["oneOf"]])
    t = schema.get("type")
    if isinstance(t, list):
        return st.one_of([from_schema({**schema, "type": x}) for x in t])
    if t == "null":
        return st.none()
    if t == "boolean":
        return st.booleans()
    if t == "integer":
        lo, hi = schema.get("minimum"), schema.get("maximum")
        return st.integers(min_value=lo, max_value=hi)
    if t == "number":
        lo = schema.get("minimum", schema.get("exclusiveMinimum"))
        return st.floats(min_value=lo, max_value=schema.get("maximum"), allow_nan=False, allow_infinity=False,
                         exclude_min="exclusiveMinimum" in schema)
    if t == "string":
        return st.text(min_size=schema.get("minLength", 0), max_size=schema.get("maxLength", 40))
    if t == "array":
        return st.lists(from_schema(schema.get("items", {})), min_size=schema.get("minItems", 0),
                        max_size=schema.get("maxItems", 4))
    if t == "object":
        props = schema.get("properties")
        if not props:
            extra = schema.get("additionalProperties")
            values = from_schema(extra) if isinstance(extra, dict) else json_values
            names = schema.get("propertyNames", {}).get("pattern")
            keys = st.from_regex(names, fullmatch=True) if names else st.text(max_size=10)
            return st.dictionaries(keys, values, max_size=4)
        required = set(schema.get("required", []))
        return st.fixed_dictionaries({k: from_schema(v) for k, v in props.items() if k in required},
                                     optional={k: from_schema(v) for k, v in props.items() if k not in required})
    return json_values


def post(server, path, data):
    req = urllib.request.Request(server.url + path, data=data, headers={"Content-Type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


STATUSES = collections.Counter()  # (path, status class) over the whole module


def check(server, path, data):
    status, body = post(server, path, data)
    STATUSES[(path, status // 100)] += 1
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
    # Not a fuzz of the 400 path alone: schema-valid bodies reached every handler's success path.
    print("fuzz statuses:", dict(STATUSES))
    for path in OPERATIONS:
        assert STATUSES[(path, 2)] > 0, (path, dict(STATUSES))
        assert STATUSES[(path, 5)] == 0
    assert fuzz_server.proc.poll() is None
    with urllib.request.urlopen(fuzz_server.url + "/health", timeout=10) as r:
        assert r.status == 200
    with socket.create_connection(("127.0.0.1", fuzz_server.port), timeout=10):
        pass
