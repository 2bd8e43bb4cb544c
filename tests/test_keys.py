import pytest

from skyline.core.keys import Keys


def test_keys_read_like_documentation():
    k = Keys()
    assert k.stream("prefill", "interactive") == "skyline:{prefill}:interactive"
    assert k.stream("decode", "batch") == "skyline:{decode}:batch"
    assert k.tokens("chatcmpl-abc") == "skyline:tokens:chatcmpl-abc"
    assert k.worker("decode-h-1") == "skyline:worker:decode-h-1"
    assert k.cancel == "skyline:cancel"
    assert k.workers == "skyline:workers"
    assert k.dead == "skyline:dead"


def test_prefix_isolates_fleets():
    assert Keys("blue").stream("prefill", "standard") == "blue:{prefill}:standard"


def test_streams_of_one_stage_share_a_cluster_hash_tag():
    # A worker XREADs all tier streams of its stage in one command, so in Redis
    # Cluster they must hash to one slot: same {tag}.
    streams = [key for stage, _t, key in Keys().all_streams(("a", "b", "c")) if stage == "prefill"]
    assert len(streams) == 3 and all("{prefill}" in s for s in streams)


def test_unknown_stage_is_rejected():
    with pytest.raises(ValueError):
        Keys().stream("bogus", "interactive")
