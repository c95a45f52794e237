"""Property-based conformance of the live agent to its OpenAPI document (issue 5 acceptance).

Schemathesis is not installed in this environment, so requests are generated with hypothesis
from the document itself: every operation, its path/query/header parameters (valid values
from the schemas, known identities, and out-of-schema junk), bearer tokens of each kind and, for
Task Start, bodies built from ``TaskStartRequest``. Each answer must be a documented status of
that operation, never a 5xx, and a JSON body must validate (jsonschema, Draft 2020-12) against the
documented schema of that status.
"""

from __future__ import annotations

import datetime as dt
import json
import os
import shutil
import urllib.parse
import uuid

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from jsonschema import Draft202012Validator, FormatChecker
from test_http_api import TASKS, Agent, start_body, token
from qlcli import ok

from qlagent.http.routing import openapi_document
from kit import scratch_dir

DOC = json.loads(openapi_document())
OPS = [(m.upper(), path, op) for path, item in DOC["paths"].items() for m, op in item.items()]

checker = FormatChecker()
SEEN: set[tuple[str, int]] = set()    # (operationId, status) answered during the property run


@checker.checks("date-time", raises=ValueError)
def _rfc3339(value: object) -> bool:
    if isinstance(value, str):
        dt.datetime.strptime(value, "%Y-%m-%dT%H:%M:%S.%fZ")
    return True


def _resolve(obj: dict) -> dict:
    while "$ref" in obj:
        node = DOC
        for part in obj["$ref"].lstrip("#/").split("/"):
            node = node[part]
        obj = node
    return obj


def _validator(schema: dict) -> Draft202012Validator:
    # "#/components/..." references resolve against the document's components.
    return Draft202012Validator({**schema, "components": DOC["components"]}, format_checker=checker)


@pytest.fixture(scope="module")
def live():
    root = scratch_dir("qlagent-conf-")
    state = os.path.join(root, "state")
    ok(state, "init")
    with open(os.path.join(root, "t.toml"), "w") as f:
        f.write(TASKS.split("[[task]]")[1].join(["[[task]]", ""]))   # "hello"
    ok(state, "task", "add", "-f", os.path.join(root, "t.toml"))
    toks = {"op": token(state, "alice", "operator"), "viewer": token(state, "vera", "viewer")}
    config = os.path.join(root, "qlagent.toml")
    with open(config, "w") as f:
        f.write("[http]\nmetrics = true\n")      # GET /metrics is an operation of the document too
    agent = Agent(state, config=config)
    status, head = agent.json("GET", "/api/v3/projects/default/tasks/hello", toks["op"])
    assert status == 200
    status, res = agent.json("POST", "/api/v3/projects/default/tasks/hello/runs", toks["op"],
                             start_body(head["revision"], head["contentDigest"]))
    assert status == 202
    known = {"projectId": ["default", head["projectId"]], "taskId": ["hello", head["taskId"]],
             "runId": [res["runId"]], "digest": head["contentDigest"], "revision": head["revision"]}
    yield agent, toks, known
    agent.stop()
    shutil.rmtree(root, ignore_errors=True)


def _junk() -> st.SearchStrategy[str]:
    return st.text(min_size=1, max_size=40)


def _param_value(p: dict, known: dict) -> st.SearchStrategy[str]:
    schema = p.get("schema", {})
    name = p["name"]
    options = []
    if name in known and p["in"] == "path":
        options += [st.sampled_from(known[name])] * 3     # mostly real identities, so 2xx paths run
    if name == "runId":
        options.append(st.uuids().map(str))
    if schema.get("type") == "integer":
        lo, hi = schema.get("minimum", 0), schema.get("maximum", 2**40)
        options += [st.integers(lo, hi).map(str), st.integers(-5, 2**63).map(str)]
    elif "enum" in schema:
        options.append(st.sampled_from(schema["enum"]))
    elif "pattern" in schema:
        options.append(st.from_regex(schema["pattern"], fullmatch=True))
    options.append(_junk())
    return st.one_of(*options)


@st.composite
def requests(draw, known: dict):
    method, template, op = draw(st.sampled_from(OPS))
    path, query, headers = template, {}, {}
    for p in op.get("parameters", []):
        value = draw(_param_value(p, known))
        if p["in"] == "path":
            path = path.replace("{" + p["name"] + "}", urllib.parse.quote(value, safe=""))
        elif p["in"] == "query" and draw(st.booleans()):
            query[p["name"]] = value
        elif p["in"] == "header" and draw(st.booleans()):
            if value.isascii() and value.isprintable():
                headers[p["name"]] = value
    body = None
    if op["operationId"] == "taskStart":
        body = draw(st.one_of(
            st.builds(lambda rev, dig, mid: start_body(rev, dig, mid),
                      st.one_of(st.just(known["revision"]), st.integers(-3, 2**32)),
                      st.one_of(st.just(known["digest"]), st.from_regex(r"[0-9a-fA-F]{60,66}", fullmatch=True)),
                      st.one_of(st.uuids().map(str), st.uuids().map(lambda u: str(u).upper()))),
            st.binary(max_size=64),
            st.dictionaries(st.text(max_size=10), st.integers() | st.text(max_size=10), max_size=5)
              .map(lambda d: json.dumps(d).encode())))
    elif method == "POST" and draw(st.booleans()):
        body = b""
    auth = draw(st.sampled_from(["op", "op", "viewer", None, "bogus"]))
    target = path + ("?" + urllib.parse.urlencode(query) if query else "")
    return method, target, op, headers, body, auth


@settings(max_examples=800, deadline=None, derandomize=True, database=None,
          suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow])
@given(data=st.data())
def test_live_answers_conform_to_the_openapi_document(live, data):
    agent, toks, known = live
    method, target, op, headers, body, auth = data.draw(requests(known))
    tok = {"op": toks["op"], "viewer": toks["viewer"], None: None, "bogus": "qlt_" + "B" * 43}[auth]
    status, resp_headers, raw = agent.request(method, target, body, tok, headers)
    SEEN.add((op["operationId"], status))
    assert status < 500, (method, target, status, raw[:300])
    documented = op["responses"]
    assert str(status) in documented, (method, target, status, raw[:300])
    spec = _resolve(documented[str(status)])
    for name in spec.get("headers", {}):
        if name in ("WWW-Authenticate", "Content-Range", "Accept-Ranges", "X-Qlagent-Log-Size",
                    "X-Qlagent-Log-Truncated", "Location"):
            assert name.lower() in resp_headers, (name, status, target)
    ctype = resp_headers.get("content-type")
    assert ctype in spec.get("content", {}), (status, ctype, target)
    if ctype == "application/json":
        errors = sorted(_validator(spec["content"][ctype]["schema"]).iter_errors(json.loads(raw)), key=str)
        assert not errors, (method, target, status, [e.message for e in errors[:3]])


def test_the_property_reached_success_and_refusal_of_every_operation(live):
    """Guard for the property above (run after it): it exercised every documented operation
    with a 2xx answer and, where auth applies, a 401 — so its checks covered real bodies."""
    ops = {op["operationId"] for _, _, op in OPS}
    assert {o for o, s in SEEN if 200 <= s < 300} == ops, sorted(SEEN)
    assert {o for o, s in SEEN if s == 401} == ops - {"healthz", "readyz", "openapi", "metrics"}, sorted(SEEN)
    assert uuid.UUID(live[2]["runId"][0])
