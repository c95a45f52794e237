"""ADR-0376 §1/§3 wire contract of Task Start: every rule at its edge, plus property tests."""

from __future__ import annotations

import json
import uuid
from importlib import resources

import msgspec
import pytest
from hypothesis import assume, given, settings
from hypothesis import strategies as st

from qlagent.core import taskstart as ts

MID = "0f8fad5b-d9cb-469f-a165-70867728950e"
DIGEST = "ab" * 32


def body(**overrides: object) -> bytes:
    doc: dict[str, object] = {
        "schema": ts.SCHEMA,
        "mutationId": MID,
        "expectedRevision": 7,
        "expectedContentDigest": DIGEST,
    }
    for key, value in overrides.items():
        if value is ...:
            doc.pop(key)
        else:
            doc[key] = value
    return json.dumps(doc).encode()


def rejected(raw: bytes) -> ts.TaskStartError:
    with pytest.raises(ts.TaskStartError) as info:
        ts.decode_task_start(raw)
    err = info.value
    assert (err.status, err.code, err.exit_code) == (400, "invalid_task_start_request", 2)
    return err


def test_valid_request_decodes():
    req = ts.decode_task_start(body())
    assert req == ts.TaskStartRequest(ts.SCHEMA, MID, 7, DIGEST)
    assert ts.decode_task_start(msgspec.json.encode(req)) == req


@pytest.mark.parametrize("revision", [1, 2147483647])
def test_revision_bounds_accepted(revision):
    assert ts.decode_task_start(body(expectedRevision=revision)).expectedRevision == revision


@pytest.mark.parametrize("revision", [0, -1, 2147483648, 10**30])
def test_revision_out_of_range_names_field_and_limit(revision):
    err = rejected(body(expectedRevision=revision))
    assert err.field == "expectedRevision" and "1..2147483647" in err.message


@pytest.mark.parametrize("revision", [True, 1.0, "1", None, [1]])
def test_revision_wrong_type_rejected(revision):
    err = rejected(body(expectedRevision=revision))
    assert err.field == "expectedRevision" and "int" in err.message


@pytest.mark.parametrize("mid", [
    MID.upper(),
    "{" + MID + "}",
    MID.replace("-", ""),
    "urn:uuid:" + MID,
    MID[:-1],
    MID + "0",
    " " + MID,
    MID.replace("-", "_"),
    "0f8fad5b-d9cb-469f-a165-70867728950g",
])
def test_non_canonical_mutation_id_rejected(mid):
    err = rejected(body(mutationId=mid))
    assert err.field == "mutationId" and "lowercase canonical UUID" in err.message


@pytest.mark.parametrize("digest", ["a" * 63, "a" * 65, "AB" * 32, "Ab" * 32, "g" * 64, "", " " + "a" * 63])
def test_bad_digest_rejected(digest):
    err = rejected(body(expectedContentDigest=digest))
    assert err.field == "expectedContentDigest" and "64 lowercase hex" in err.message


@pytest.mark.parametrize("schema", ["qinglong/task-start@v2", "QINGLONG/TASK-START@V1", "", "qinglong/task-start@v1 "])
def test_wrong_schema_rejected(schema):
    err = rejected(body(schema=schema))
    assert err.field == "schema" and ts.SCHEMA in err.message


@pytest.mark.parametrize("extra", ["runId", "priority", "command", "env", "Schema"])
def test_unknown_field_rejected(extra):
    err = rejected(body(**{extra: "x"}))
    assert err.field == extra and "unknown field" in err.message


@pytest.mark.parametrize("missing", ["schema", "mutationId", "expectedRevision", "expectedContentDigest"])
def test_missing_field_rejected(missing):
    err = rejected(body(**{missing: ...}))
    assert err.field == missing and "missing required field" in err.message


def test_duplicate_key_rejected():
    raw = body()[:-1] + b', "expectedRevision": 8}'
    err = rejected(raw)
    assert err.field == "expectedRevision" and "more than once" in err.message


@pytest.mark.parametrize("raw", [b"", b"\xff\xfe", b"[]", b"null", b'"x"', b"{", body() + b"x",
                                 body().replace(b"7", b"07")])
def test_malformed_body_rejected(raw):
    rejected(raw)


def test_errors_vocabulary_and_wire_shape():
    from qlagent.core.errors import QlError

    assert issubclass(ts.TaskStartError, QlError)
    assert ts.TaskStartError.not_found().to_dict() == {"code": "task_not_found",
                                                        "message": "task not found in this project"}
    for reason in sorted(ts.FENCE_REASONS):
        err = ts.TaskStartError.fence_rejected(reason)
        assert (err.status, err.code, err.reason, err.exit_code) == (409, "task_start_fence_rejected", reason, 3)
        assert err.to_dict()["reason"] == reason
    assert ts.FENCE_REASONS == {"authorization_changed", "definition_changed", "task_disabled",
                                "task_not_executable", "mutation_conflict"}
    with pytest.raises(ValueError):
        ts.TaskStartError.fence_rejected("because")
    un = ts.TaskStartError.unavailable()
    assert (un.status, un.code, un.exit_code) == (503, "task_start_unavailable", 5)
    inv = rejected(body(mutationId="x")).to_dict()
    assert set(inv) == {"code", "message", "field"}


def test_keys_refs_and_result_shape():
    assert ts.idempotency_key(MID) == f"ql3:task-start:v1:{MID}"
    assert ts.snapshot_ref(3, DIGEST) == f"qltd:v1:3:{DIGEST}"
    res = ts.TaskStartResult.build(outcome="accepted", run_id="r", attempt_id="a", event_ids=("e1", "e2"),
                                   task_revision=3, content_digest=DIGEST, state="queued",
                                   created_at_us=1_786_528_800_000_001)
    assert res.status == 202
    assert json.loads(msgspec.json.encode(res)) == {
        "outcome": "accepted", "runId": "r", "attemptId": "a", "eventIds": ["e1", "e2"],
        "taskRevision": 3, "taskSnapshotRef": f"qltd:v1:3:{DIGEST}", "state": "queued",
        "createdAt": "2026-08-12T10:00:00.000001Z",
    }
    assert msgspec.structs.replace(res, outcome="existing").status == 200


def test_openapi_task_start_schema_matches_the_struct():
    doc = json.loads(resources.files("qlagent.http").joinpath("openapi.json").read_text())
    assert doc["openapi"].startswith("3.1")
    schemas = doc["components"]["schemas"]
    req = schemas["TaskStartRequest"]
    assert req["additionalProperties"] is False
    assert set(req["required"]) == set(req["properties"]) == set(ts.TaskStartRequest.__struct_fields__)
    assert req["properties"]["expectedRevision"]["minimum"] == ts.REVISION_MIN
    assert req["properties"]["expectedRevision"]["maximum"] == ts.REVISION_MAX
    assert set(schemas["TaskStartResult"]["required"]) == set(ts.TaskStartResult.__struct_fields__)
    assert set(schemas["Error"]["properties"]["reason"]["enum"]) == ts.FENCE_REASONS


# -- properties ---------------------------------------------------------------------------------

hex64 = st.text(alphabet="0123456789abcdef", min_size=64, max_size=64)
valid = st.builds(
    ts.TaskStartRequest,
    schema=st.just(ts.SCHEMA),
    mutationId=st.uuids().map(str),
    expectedRevision=st.integers(ts.REVISION_MIN, ts.REVISION_MAX),
    expectedContentDigest=hex64,
)


@settings(max_examples=200, deadline=None)
@given(valid)
def test_any_valid_request_round_trips(req):
    assert ts.decode_task_start(msgspec.json.encode(req)) == req
    assert ts.decode_task_start(json.dumps(msgspec.structs.asdict(req)).encode()) == req


def _is_uuid(text: str) -> bool:
    try:
        return str(uuid.UUID(text)) == text
    except ValueError:
        return False


def _mutations(req: ts.TaskStartRequest):
    d = msgspec.structs.asdict(req)
    junk = st.one_of(st.none(), st.booleans(), st.floats(allow_nan=False, allow_infinity=False), st.text(max_size=70),
                     st.lists(st.integers(), max_size=2))
    return st.one_of(
        st.tuples(st.just("schema"), st.text(max_size=40).filter(lambda s: s != ts.SCHEMA)),
        st.tuples(st.just("mutationId"), st.one_of(
            st.just(d["mutationId"].upper()).filter(lambda s: s != d["mutationId"]),
            st.just(d["mutationId"].replace("-", "")),
            st.uuids().map(lambda u: "{%s}" % u),
            junk,
        )),
        st.tuples(st.just("expectedRevision"), st.one_of(
            st.integers(max_value=0), st.integers(min_value=ts.REVISION_MAX + 1, max_value=2**63),
            st.just(float(d["expectedRevision"])), st.just(str(d["expectedRevision"])), st.booleans(),
        )),
        st.tuples(st.just("expectedContentDigest"), st.one_of(
            st.text(alphabet="0123456789abcdef", max_size=63),
            st.text(alphabet="0123456789abcdef", min_size=65, max_size=80),
            st.just(d["expectedContentDigest"].upper()).filter(lambda s: s != d["expectedContentDigest"]),
            junk,
        )),
        st.tuples(st.text(min_size=1, max_size=20).filter(lambda k: k not in d), junk),
    )


@settings(max_examples=300, deadline=None)
@given(st.data())
def test_any_mutated_field_is_rejected_naming_it(data):
    req = data.draw(valid)
    key, value = data.draw(_mutations(req))
    doc = msgspec.structs.asdict(req)
    # Junk text can, rarely, be a valid value again; that is not a mutation.
    assume(not (key == "expectedContentDigest" and isinstance(value, str)
                and len(value) == 64 and set(value) <= set("0123456789abcdef")))
    assume(not (key == "mutationId" and isinstance(value, str) and _is_uuid(value)))
    doc[key] = value
    with pytest.raises(ts.TaskStartError) as info:
        ts.decode_task_start(json.dumps(doc).encode())
    assert info.value.status == 400 and info.value.field == key


def test_uuid4_strings_are_canonical():
    assert ts.decode_task_start(body(mutationId=str(uuid.uuid4())))


@settings(max_examples=100, deadline=None)
@given(
    outcome=st.sampled_from(["accepted", "existing"]),
    ids=st.lists(st.uuids().map(str), min_size=4, max_size=4),
    revision=st.integers(ts.REVISION_MIN, ts.REVISION_MAX),
    digest=hex64,
    created=st.integers(0, 4_102_444_800_000_000),  # up to 2100-01-01 in µs
)
def test_results_and_errors_conform_to_the_openapi_document(outcome, ids, revision, digest, created):
    jsonschema = pytest.importorskip("jsonschema")  # comes with schemathesis (test extra)
    schemas = json.loads(resources.files("qlagent.http").joinpath("openapi.json").read_text())["components"]["schemas"]
    res = ts.TaskStartResult.build(outcome=outcome, run_id=ids[0], attempt_id=ids[1], event_ids=(ids[2], ids[3]),
                                   task_revision=revision, content_digest=digest, state="queued",
                                   created_at_us=created)
    jsonschema.Draft202012Validator(schemas["TaskStartResult"]).validate(json.loads(msgspec.json.encode(res)))
    errors = [ts.TaskStartError.not_found(), ts.TaskStartError.unavailable(),
              ts.TaskStartError.fence_rejected("definition_changed"),
              rejected(body(expectedRevision=revision + 2**31))]
    for err in errors:
        jsonschema.Draft202012Validator(schemas["Error"]).validate(err.to_dict())
