"""Tenants: what one API key creates, another does not see; operator keys see everything.

A real sim fleet (gateway, prefill and decode worker, and a batch runner, as
processes) with two tenant keys and an operator key, driven by the `openai`
client: files, batches, their output and error files, request timelines and
the dashboard. Another tenant's id must answer exactly like a missing one, and
after all of it Redis must hold no API key, in any key name or value.
"""

from __future__ import annotations

import hashlib
import hmac
import uuid

import httpx
import openai
import pytest
import redis

from skyline.core.config import GatewayConfig
from skyline.core.config_rules import ConfigError
from skyline.core.keys import Keys
from skyline.gateway.tenants import owner_secret
from tests.fleet import Fleet
from tests.test_batch_e2e import MODEL, chat_line, jsonl_of, start_runner, submit, wait_done

KEY_A = f"sk-tenant-a-{uuid.uuid4().hex}"
KEY_B = f"sk-tenant-b-{uuid.uuid4().hex}"
OPERATOR = f"sk-operator-{uuid.uuid4().hex}"
SECRET = f"owner-secret-{uuid.uuid4().hex}"
CONFIG = """
[gateway]
api_keys = ["{a}", "{b}"]
operator_api_keys = ["{op}"]
owner_secret_file = "{secret}"
[batch]
pacing_interval_s = 0.25
lease_s = 3
heartbeat_s = 1
maintenance_interval_s = 2
"""


@pytest.fixture(scope="module")
def fleet(redis_url, tmp_path_factory):
    logs = tmp_path_factory.mktemp("tenant-logs")
    (logs / "owner.secret").write_text(SECRET + "\n")
    cfg = logs / "tenants.toml"
    cfg.write_text(CONFIG.format(a=KEY_A, b=KEY_B, op=OPERATOR, secret=logs / "owner.secret"))
    f = Fleet(redis_url, f"e2e-tenants-{uuid.uuid4().hex[:6]}", "sim", logs, ["--config", str(cfg)])
    with f.running({"prefill-t": ("prefill",), "decode-t": ("decode",)}, timeout_s=60):
        yield f


def client_of(fleet: Fleet, key: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{fleet.url}/v1", api_key=key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def a(fleet):
    return client_of(fleet, KEY_A)


@pytest.fixture(scope="module")
def b(fleet):
    return client_of(fleet, KEY_B)


@pytest.fixture(scope="module")
def op(fleet):
    return client_of(fleet, OPERATOR)


def refused(call) -> dict:
    """The OpenAI error object of a call that must answer 404."""
    with pytest.raises(openai.NotFoundError) as exc:
        call()
    return exc.value.body


def like_missing(theirs: dict, their_id: str, missing: dict, missing_id: str) -> bool:
    """Another tenant's id answered exactly as a missing one: same code and type, same message but for the id."""
    return (theirs["code"], theirs["type"], theirs["message"].replace(their_id, "<id>")) == \
        (missing["code"], missing["type"], missing["message"].replace(missing_id, "<id>"))


def timeline(client: openai.OpenAI, request_id: str) -> dict:
    return client.get(f"/requests/{request_id}/timeline", cast_to=object)


def test_a_tenants_files_are_its_own(a, b, op, tmp_path):
    path = tmp_path / "a.jsonl"
    path.write_text(chat_line("f1") + "\n")
    with path.open("rb") as fh:
        mine = a.files.create(file=fh, purpose="batch")
    assert a.files.retrieve(mine.id).filename == "a.jsonl"
    assert a.files.content(mine.id).text == path.read_text()
    assert mine.id in [f.id for f in a.files.list().data]

    missing = refused(lambda: b.files.retrieve("file-0000"))
    assert like_missing(refused(lambda: b.files.retrieve(mine.id)), mine.id, missing, "file-0000")
    assert like_missing(refused(lambda: b.files.content(mine.id)), mine.id,
                        refused(lambda: b.files.content("file-0000")), "file-0000")
    assert mine.id not in [f.id for f in b.files.list().data]
    with pytest.raises(openai.AuthenticationError):
        a.with_options(api_key="sk-not-a-key").files.retrieve(mine.id)

    assert op.files.retrieve(mine.id).id == mine.id and op.files.content(mine.id).text == path.read_text()
    assert mine.id in [f.id for f in op.files.list(purpose="batch").data]


def test_a_tenants_batches_are_its_own_and_an_operator_manages_them(a, b, op, tmp_path):
    # No runner in this test: the batch waits in RQ, so it can still be cancelled.
    uploaded, batch = submit(a, tmp_path, [chat_line("c0"), chat_line("c1")])
    assert like_missing(refused(lambda: b.batches.create(input_file_id=uploaded.id, endpoint="/v1/chat/completions",
                                                         completion_window="24h")), uploaded.id,
                        refused(lambda: b.batches.create(input_file_id="file-0000", endpoint="/v1/chat/completions",
                                                         completion_window="24h")), "file-0000")
    assert a.batches.retrieve(batch.id).status == "validating"
    assert batch.id in [x.id for x in a.batches.list(limit=100).data]

    missing_id = "batch_" + "0" * 24
    assert like_missing(refused(lambda: b.batches.retrieve(batch.id)), batch.id,
                        refused(lambda: b.batches.retrieve(missing_id)), missing_id)
    assert like_missing(refused(lambda: b.batches.cancel(batch.id)), batch.id,
                        refused(lambda: b.batches.cancel(missing_id)), missing_id)
    assert batch.id not in [x.id for x in b.batches.list(limit=100).data]
    assert a.batches.retrieve(batch.id).status == "validating"  # B's cancel changed nothing

    assert batch.id in [x.id for x in op.batches.list(limit=100).data]
    cancelled = op.batches.cancel(batch.id)  # an operator manages every tenant's batches
    assert cancelled.status == "cancelled" and cancelled.error_file_id
    # The batch's error file is its owner's (A), not the canceller's: A reads it, B cannot.
    assert [e["error"]["code"] for e in jsonl_of(a, cancelled.error_file_id)] == ["batch_cancelled"] * 2
    refused(lambda: b.files.content(cancelled.error_file_id))
    assert cancelled.error_file_id in [f.id for f in a.files.list(purpose="batch_output").data]
    assert cancelled.error_file_id not in [f.id for f in b.files.list().data]


@pytest.fixture
def runner(fleet):
    start_runner(fleet, "runner")
    yield "runner"
    fleet.stop("runner")


def test_batch_output_and_the_timelines_of_its_requests_are_the_batch_owners(a, b, op, runner, tmp_path):
    _, batch = submit(a, tmp_path, [chat_line("r0"), chat_line("r1"), "{not json"])
    done = wait_done(a, batch.id, 30)  # the runner runs A's batch with the operator key
    assert done.status == "completed" and (done.request_counts.completed, done.request_counts.failed) == (2, 1)
    out = jsonl_of(a, done.output_file_id)
    assert [o["custom_id"] for o in out] == ["r0", "r1"]
    assert jsonl_of(a, done.error_file_id)[0]["error"]["code"] == "invalid_json_line"
    for fid in (done.output_file_id, done.error_file_id):
        refused(lambda fid=fid: b.files.content(fid))
        refused(lambda fid=fid: b.files.retrieve(fid))
        assert op.files.content(fid).text == a.files.content(fid).text

    # Each line ran as A's request (not the runner's): A reads its timeline, B gets a 404.
    rid = out[0]["response"]["request_id"]
    assert timeline(a, rid)["events"][0]["event"] == "arrived"
    refused(lambda: timeline(b, rid))
    assert timeline(op, rid)["request_id"] == rid


def test_a_request_timeline_is_its_senders(a, b, op):
    resp = a.chat.completions.with_raw_response.create(
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "whose timeline is this?"}])
    rid = resp.headers["x-skyline-request-id"]
    assert timeline(a, rid)["request_id"] == rid
    theirs, missing = refused(lambda: timeline(b, rid)), refused(lambda: timeline(b, "chatcmpl-unknown"))
    assert like_missing(theirs, rid, missing, "chatcmpl-unknown")
    assert timeline(op, rid)["request_id"] == rid

    mine = op.chat.completions.with_raw_response.create(  # operator keys call the inference routes too
        model=MODEL, max_tokens=4, messages=[{"role": "user", "content": "an operator's own request"}])
    assert mine.parse().choices[0].message.content
    refused(lambda: timeline(a, mine.headers["x-skyline-request-id"]))


def test_the_dashboard_data_needs_an_operator_key(fleet):
    with httpx.Client(base_url=fleet.url, timeout=10) as http:
        page = http.get("/dashboard")  # the page is code, no data: a browser cannot send a header to open it
        assert page.status_code == 200 and "key-form" in page.text
        assert http.get("/dashboard/data").status_code == 401
        tenant = http.get("/dashboard/data", headers={"Authorization": f"Bearer {KEY_A}"})
        assert tenant.status_code == 403 and tenant.json()["error"]["code"] == "operator_key_required"
        ok = http.get("/dashboard/data", headers={"Authorization": f"Bearer {OPERATOR}"})
        assert ok.status_code == 200 and {w["role"] for w in ok.json()["workers"]} == {"prefill", "decode"}


def test_redis_holds_no_api_key_only_keyed_digests(fleet, a, tmp_path):
    uploaded, batch = submit(a, tmp_path, [chat_line("s0")])
    a.chat.completions.create(model=MODEL, max_tokens=2, messages=[{"role": "user", "content": "hi"}])
    r = redis.Redis.from_url(fleet.redis_url)
    keys = Keys(fleet.key_prefix)
    digest = hmac.new(SECRET.encode(), KEY_A.encode(), hashlib.sha256).hexdigest()
    # What the test looks for is there: the owner is the HMAC of A's key under the configured secret.
    assert r.hget(keys.file(uploaded.id), "owner").decode() == digest
    assert r.hget(keys.batch(batch.id), "owner").decode() == digest
    assert r.zscore(keys.batches_of(digest), batch.id) is not None

    secrets_ = [k.encode() for k in (KEY_A, KEY_B, OPERATOR)]
    secrets_ += [hashlib.sha256(s).hexdigest().encode() for s in secrets_]  # an unkeyed hash is checkable offline
    seen = 0
    for name in r.scan_iter("*", count=1000):  # every key of the server: this fleet's, RQ's, other tests'
        blob = name + b"\n" + b"\n".join(_values(r, name))
        assert not [s for s in secrets_ if s in blob], f"an API key (or its plain SHA-256) is in Redis at {name!r}"
        seen += 1
    assert seen > 20  # files, batches, results, timelines, requesters, RQ jobs, streams...


def _values(r: redis.Redis, name: bytes) -> list[bytes]:
    kind = r.type(name).decode()
    if kind == "string":
        return [r.get(name) or b""]
    if kind == "hash":
        return [b for kv in r.hgetall(name).items() for b in kv]
    if kind == "list":
        return r.lrange(name, 0, -1)
    if kind == "set":
        return list(r.smembers(name))
    if kind == "zset":
        return [m for m, _ in r.zrange(name, 0, -1, withscores=True)]
    if kind == "stream":
        return [b for _id, entry in r.xrange(name) for kv in entry.items() for b in kv]
    return []  # gone meanwhile (expired)


def test_the_owner_secret_is_configured_or_derived_from_the_tenant_keys(tmp_path):
    derived = owner_secret(GatewayConfig(api_keys=("k1", "k2")))
    assert derived == owner_secret(GatewayConfig(api_keys=("k2", "k1"), operator_api_keys=("op",)))
    assert derived != owner_secret(GatewayConfig(api_keys=("k1", "k3")))  # why owner_secret_file is advised
    secret = tmp_path / "secret"
    secret.write_text("  s3cret\n")
    assert owner_secret(GatewayConfig(api_keys=("k1",), owner_secret_file=str(secret))) == b"s3cret"
    secret.write_text("\n")
    with pytest.raises(ConfigError, match="owner_secret_file .* is empty"):
        owner_secret(GatewayConfig(owner_secret_file=str(secret)))
