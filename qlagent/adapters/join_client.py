"""``qlagent worker join`` on the router (issue 26): read the Worker's enrolment (``describe``,
the token left unused) and redeem the join token at the control plane, trusting only the CA the
token carries, before anything is written. Standard library only
(``ssl``, ``http.client``): a router never loads ``cryptography``."""

from __future__ import annotations

import base64
import http.client
import json
import ssl

import msgspec

from ..core.cluster import WorkerInfo
from ..core.control import ControlError, ControlTlsError
from ..core.control_url import parse_control_url
from ..core.errors import ConflictError, NotFoundError, ValidationError
from .control_client import no_answer

MAX_ANSWER_BYTES = 65_536


def ca_pem(ca_der_b64: str) -> str:
    """The PEM text of the token's CA (base64 of DER). ValidationError naming ``TOKEN`` when it
    is not a CA certificate ssl can load."""
    try:
        der = base64.b64decode(ca_der_b64, validate=True)
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.load_verify_locations(cadata=der)
    except (ValueError, ssl.SSLError):
        raise ValidationError("TOKEN", "its CA certificate is damaged (copy the whole line)") from None
    if not ctx.cert_store_stats()["x509_ca"]:
        raise ValidationError("TOKEN", "its CA is not a CA certificate (basicConstraints CA:TRUE)")
    return ssl.DER_cert_to_PEM_cert(der)


def _ask(url: str, ca: str | None, method: str, path: str, credential: str, body: bytes,
         timeout_s: float) -> tuple[int, dict]:
    """One request to the replica at ``url`` as the Worker whose ``credential`` the token
    carries, over TLS trusting only ``ca``: (status, JSON body or {}). The no-answer errors of
    ``redeem``."""
    scheme, host, port = parse_control_url(url)
    ctx = None
    if scheme == "https":
        ctx = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
        ctx.minimum_version = ssl.TLSVersion.TLSv1_2
        ctx.load_verify_locations(cadata=ca)
        conn = http.client.HTTPSConnection(host, port, timeout=timeout_s, context=ctx)
    else:
        conn = http.client.HTTPConnection(host, port, timeout=timeout_s)
    headers = {"Authorization": f"Worker {credential}", "Connection": "close"}
    if body:
        headers["Content-Type"] = "application/json"
    try:
        conn.request(method, path, body=body or None, headers=headers)
        resp = conn.getresponse()
        raw = resp.read(MAX_ANSWER_BYTES)
    except BaseException as e:
        err = no_answer(e, host, port, scheme, ctx)
        if isinstance(err, ControlTlsError) and err.field == "worker.ca_file":
            raise ControlTlsError(f"TOKEN: control plane {host}:{port}: its certificate is not signed by the CA in the "
                                  "token (a token of another control plane, or a replica with another CA)",
                                  field="TOKEN") from None
        raise err from None
    finally:
        conn.close()
    try:
        answer = json.loads(raw) if raw else {}
    except ValueError:
        answer = {}
    return resp.status, answer if isinstance(answer, dict) else {}


def _not_known(url: str, worker_id: str) -> NotFoundError:
    return NotFoundError(f"TOKEN: {url}: the control plane knows no live Worker {worker_id} with this token's credential "
                         "(removed, or its credential rotated since)", code="worker_not_found", field="TOKEN")


def describe(url: str, ca: str | None, worker_id: str, credential: str, timeout_s: float) -> WorkerInfo | None:
    """``GET {url}/api/v3/cluster/workers/{worker_id}`` with the token's credential (read only:
    the token stays unused): the Worker's enrolment and the replica's Session TTL; None from a
    control plane older than the route (404). The refusals and no-answer errors of ``redeem``."""
    status, body = _ask(url, ca, "GET", f"/api/v3/cluster/workers/{worker_id}", credential, b"", timeout_s)
    if status in (401, 403):
        raise _not_known(url, worker_id)
    if status == 404:
        return None
    if status != 200:
        raise ControlError(f"{url}: answered {status} {body.get('error', '')} {body.get('message', '')}".rstrip(),
                           status=status)
    try:
        return msgspec.convert(body, type=WorkerInfo)
    except msgspec.ValidationError:
        raise ControlError(f"{url}: the answer is not a Worker description", code="bad_answer", status=status) from None


def redeem(url: str, ca: str | None, worker_id: str, credential: str, token_id: str, timeout_s: float) -> str:
    """``POST {url}/api/v3/cluster/workers/{worker_id}/join`` with the credential, over TLS
    trusting only ``ca`` (PEM; None for an http:// loopback URL); the Worker's name.

    Raises ControlTlsError (exit 2) when the replica's certificate is not signed by ``ca`` or
    names another host; ControlUnreachable (exit 5) without an answer; NotFoundError for a
    Worker the control plane does not know with this credential (removed, credential rotated)
    or an unknown token; ConflictError ``join_token_used`` / ``join_token_expired``;
    ControlError for another answer."""
    status, body = _ask(url, ca, "POST", f"/api/v3/cluster/workers/{worker_id}/join", credential,
                        json.dumps({"tokenId": token_id}).encode(), timeout_s)
    if status == 200:
        return str(body.get("name", ""))
    code, message = body.get("error", ""), body.get("message", "")
    if status in (401, 403):
        raise _not_known(url, worker_id)
    if status == 404 and code == "join_token_not_found":
        raise NotFoundError(f"TOKEN: {url}: {message}", code=code, field="TOKEN")
    if status == 409:
        raise ConflictError(f"TOKEN: {url}: {message}", code=code or "conflict", field="TOKEN")
    raise ControlError(f"{url}: answered {status} {code} {message}".rstrip(), status=status)
