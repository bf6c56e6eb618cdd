"""The API key file's format (server/keys.py): a key a line, each optionally followed by its
priority class and in-flight cap; a line it cannot read stops the start naming the line.
How a key's class and cap hold on each door: tests/server/test_priority_calls.py."""

import contextvars

import pytest

from attnserve.server.errors import InvalidArgument, RetryLater
from attnserve.server.keys import ApiKeys, LocalCounts, read_key_file
from attnserve.server.priority import DEFAULT, Priority, asked, of_call


def test_a_key_line_carries_its_class_and_its_cap(tmp_path):
    path = tmp_path / "keys"
    path.write_text("plain\n\n  indexer  class=Bulk max_inflight=8\nsearch class=interactive\n"
                    "capped max_inflight=2\n")
    plain, indexer, search, capped = read_key_file(path)
    assert (plain.secret, plain.priority, plain.max_inflight) == (b"plain", None, 0)
    assert (indexer.secret, indexer.priority, indexer.max_inflight, indexer.slot) == (
        b"indexer", Priority.BULK, 8, 0)
    assert search.priority is Priority.INTERACTIVE and search.max_inflight == 0
    assert capped.slot == 1  # the capped keys' counts, in the file's order


@pytest.mark.parametrize("line,said", [
    ("k class=urgent", "line 2: class: 'urgent' is not a priority class; the classes are "
                       "interactive, bulk"),
    ("k max_inflight=0", "line 2: max_inflight='0': a count of calls, at least 1"),
    ("k max_inflight=eight", "line 2: max_inflight='eight'"),
    ("k colour=red", "line 2: 'colour=red' is not a setting"),
    ("k class=bulk class=bulk", "line 2: 'class=bulk' is not a setting"),
])
def test_a_line_it_cannot_read_is_refused_naming_it(tmp_path, line, said):
    path = tmp_path / "keys"
    path.write_text(f"first\n{line}\n")
    with pytest.raises(ValueError, match=said):
        read_key_file(path)


def test_a_keys_class_wins_and_its_cap_counts_its_calls(tmp_path):
    """As a door admits a call, in a context of its own (a call's task has one)."""
    path = tmp_path / "keys"
    path.write_text("indexer class=bulk max_inflight=1\nplain\n")
    contextvars.copy_context().run(admitting, ApiKeys(None, path, LocalCounts()))


def admitting(keys: ApiKeys) -> None:
    indexer, plain = keys.keys
    assert keys.check("Bearer indexer") is indexer

    release = keys.admit(indexer, "interactive", "x-priority")
    assert of_call() is Priority.BULK
    asked("interactive", "priority")  # a request's field: the key's class still
    assert of_call() is Priority.BULK
    with pytest.raises(RetryLater) as refused:
        keys.admit(indexer, None, "x-priority")
    assert refused.value.retry_after_s == 1 and "max_inflight" in refused.value.message
    release()
    keys.admit(indexer, None, "x-priority")()  # its place is free again

    keys.admit(plain, None, "x-priority")
    assert of_call() is DEFAULT
    restore = asked("bulk", "priority")
    assert of_call() is Priority.BULK
    restore()
    assert of_call() is DEFAULT
    with pytest.raises(InvalidArgument, match="x-priority"):
        keys.admit(plain, "urgent", "x-priority")
