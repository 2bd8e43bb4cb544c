import dataclasses

import msgpack
import pytest

from skyline.core import messages as m


def _req(**kw):
    base = dict(
        request_id="chatcmpl-1", model="x", prompt_token_ids=[1, 2, 3], sampling=m.SamplingSpec(max_tokens=5, stop=["\n"]),
        tier="interactive", arrival_ms=1000, deadline_ms=2000, ttft_ms=1000, tpot_ms=100,
    )
    base.update(kw)
    return m.GenerateRequest(**base)


@pytest.mark.parametrize(
    "msg",
    [
        _req(),
        m.DecodeWork(request=_req(route="colocated"), kv_handle={"remote_block_ids": [1, 2], "remote_host": "h", "tp_size": 1}),
        m.DecodeWork(request=_req(), kv_handle=None),
        m.TokenDelta("r", 3, 7, [1, 2], "hé"),
        m.Finished("r", 4, "length", 3, 5, {"e2e_ms": 12.5}, {"remote_prefill": True}, "d", "p"),
        m.Failed("r", 1, 503, "no worker"),
        m.Cancel("r"),
    ],
)
def test_round_trip_preserves_every_field(msg):
    assert m.decode(m.encode(msg)) == msg
    # The encoder's shallow walk writes what dataclasses.asdict would (nested messages as maps).
    assert msgpack.unpackb(m.encode(msg)) == [msg.TAG, dataclasses.asdict(msg)]


def test_nested_types_are_rebuilt():
    out = m.decode(m.encode(m.DecodeWork(request=_req())))
    assert isinstance(out.request, m.GenerateRequest)
    assert isinstance(out.request.sampling, m.SamplingSpec)
    assert out.request.sampling.stop == ["\n"]


def test_unknown_fields_from_newer_peers_are_ignored():
    payload = msgpack.packb(["cancel", {"request_id": "r", "reason": "x", "added_later": 1}])
    assert m.decode(payload) == m.Cancel("r", "x")


@pytest.mark.parametrize("payload", [b"", b"\x00garbage", msgpack.packb(["nope", {}]), msgpack.packb(["cancel", {}])])
def test_garbage_is_a_codec_error(payload):
    with pytest.raises(m.CodecError):
        m.decode(payload)
