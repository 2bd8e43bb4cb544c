"""Batch input parsing and output lines (pure): bad lines are reported per line, batch-level problems stop it."""

import json

from skyline.batch import jsonl
from skyline.batch.objects import batch_object

CHAT = "/v1/chat/completions"


def line(cid, url=CHAT, method="POST", body=None) -> str:
    return json.dumps({"custom_id": cid, "method": method, "url": url,
                       "body": body if body is not None else {"model": "m", "messages": []}})


def test_good_lines_become_requests_numbered_like_an_editor_and_blank_lines_are_skipped():
    content = "\n".join([line("a"), "", line("b"), "   "]) + "\n"
    parsed = jsonl.parse_input(content.encode(), CHAT, max_lines=10)
    assert [(r.line, r.custom_id) for r in parsed.requests] == [(1, "a"), (3, "b")]
    assert parsed.errors == [] and parsed.fatal == [] and parsed.total == 2
    assert jsonl.count_lines(content.encode()) == 2


def test_each_bad_line_is_reported_on_its_own_with_a_reason():
    content = "\n".join([
        line("ok"),
        "{not json",
        "[1, 2]",
        json.dumps({"method": "POST", "url": CHAT, "body": {}}),
        line("get", method="GET"),
        line("wrong-endpoint", url="/v1/completions"),
        line("nowhere", url="/v1/embeddings"),
        line("no-body", body="text"),
        line("streams", body={"model": "m", "stream": True}),
    ]).encode()
    parsed = jsonl.parse_input(content, CHAT, max_lines=100)
    assert [r.custom_id for r in parsed.requests] == ["ok"]
    codes = {e.line: e.code for e in parsed.errors}
    assert codes == {2: "invalid_json_line", 3: "invalid_json_line", 4: "missing_custom_id", 5: "invalid_method",
                     6: "mismatched_url", 7: "invalid_url", 8: "invalid_body", 9: "invalid_body"}
    assert parsed.fatal == [] and parsed.total == 9
    assert parsed.custom_ids() == {1: "ok", 2: None, 3: None, 4: None, 5: "get", 6: "wrong-endpoint",
                                   7: "nowhere", 8: "no-body", 9: "streams"}
    assert all(f"line {e.line}" in e.message for e in parsed.errors)


def test_duplicate_custom_ids_stop_the_batch_naming_both_lines():
    parsed = jsonl.parse_input("\n".join([line("x"), line("y"), line("x")]).encode(), CHAT, max_lines=10)
    assert [(e.code, e.line) for e in parsed.fatal] == [("duplicate_custom_id", 3)]
    assert "line 1" in parsed.fatal[0].message


def test_empty_oversized_and_all_bad_files_cannot_start():
    assert [e.code for e in jsonl.parse_input(b"\n\n", CHAT, 10).fatal] == ["empty_file"]
    many = "\n".join(line(str(i)) for i in range(5)).encode()
    assert [e.code for e in jsonl.parse_input(many, CHAT, 4).fatal] == ["too_many_lines"]
    all_bad = jsonl.parse_input(b"nope\n{}\n", CHAT, 10)
    assert [e.code for e in all_bad.fatal] == ["no_valid_requests", "invalid_json_line", "missing_custom_id"]
    assert all_bad.fatal[1].as_batch_error() == {"code": "invalid_json_line", "message": all_bad.fatal[1].message,
                                                 "param": None, "line": 1}


def test_output_lines_follow_the_openai_shape_and_split_into_output_and_error_files():
    ok = jsonl.response_line("a", 200, "chatcmpl-1", {"usage": {"prompt_tokens": 5, "completion_tokens": 7}})
    refused = jsonl.response_line("b", 400, "chatcmpl-2", {"error": {"message": "bad model"}})
    never = jsonl.error_line("c", "batch_cancelled", "cancelled")
    assert ok["id"].startswith("batch_req_") and ok["error"] is None and ok["response"]["request_id"] == "chatcmpl-1"
    assert never["response"] is None and never["error"] == {"code": "batch_cancelled", "message": "cancelled"}
    assert [jsonl.is_success(x) for x in (ok, refused, never)] == [True, False, False]
    assert jsonl.usage_of(ok) == (5, 7) and jsonl.usage_of(refused) == (0, 0)
    assert json.loads(jsonl.dumps(ok)) == ok


def test_batch_object_reads_back_from_its_hash():
    raw = {b"id": b"batch_1", b"endpoint": CHAT.encode(), b"input_file_id": b"file-1", b"completion_window": b"24h",
           b"status": b"failed", b"created_at": b"100", b"failed_at": b"101", b"total": b"3", b"failed": b"3",
           b"errors": json.dumps([{"code": "empty_file", "message": "m", "param": None, "line": None}]).encode()}
    obj = batch_object(raw)
    assert obj["status"] == "failed" and obj["failed_at"] == 101 and obj["completed_at"] is None
    assert obj["request_counts"] == {"total": 3, "completed": 0, "failed": 3}
    assert obj["errors"] == {"object": "list", "data": [{"code": "empty_file", "message": "m", "param": None,
                                                          "line": None}]}
    assert obj["output_file_id"] is None and obj["metadata"] is None
