"""The priority classes' names as callers write them (server/priority.py): each class
read back whatever its case and surrounding blanks, anything else refused naming the field
and every class."""

import pytest

from attnserve.server.errors import InvalidArgument
from attnserve.server.priority import CLASSES, DEFAULT, Priority, parse


def test_the_classes_highest_first_and_the_default():
    assert CLASSES == (Priority.INTERACTIVE, Priority.BULK) and DEFAULT is Priority.INTERACTIVE
    assert parse("bulk", "x-priority") is Priority.BULK
    assert parse(" Interactive ", "x-priority") is Priority.INTERACTIVE


@pytest.mark.parametrize("text", ["urgent", "", "bulk;q=1", "x" * 5000])
def test_an_unknown_class_is_refused_naming_the_classes(text):
    with pytest.raises(InvalidArgument) as refused:
        parse(text, "x-priority")
    assert refused.value.field == "x-priority"
    assert refused.value.reason.endswith("is not a priority class; the classes are interactive, bulk")
    assert len(refused.value.message) < 300  # a long value is quoted cut
