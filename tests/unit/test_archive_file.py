"""The archive file of ``ax archive --to``: appended whole, a torn end cut off, a foreign
file refused, one writer at a time (no servers)."""

from __future__ import annotations

import gzip
import os
from pathlib import Path

import pytest

from ax_kombu.exceptions import ValidationError
from ax_kombu.store.archive_file import JsonlGzFile, complete_length


def lines_of(path: Path) -> list[str]:
    with gzip.open(path, "rt") as f:
        return f.read().splitlines()


def test_batches_are_appended_as_gzip_members(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl.gz"
    out = JsonlGzFile(path)
    out.append(['{"task_id":1}', '{"task_id":2}'])
    out.append(['{"task_id":3}'])
    out.close()
    out = JsonlGzFile(path)  # reopened: appended to, not replaced
    out.append(['{"task_id":4}'])
    out.close()
    assert lines_of(path) == [f'{{"task_id":{i}}}' for i in (1, 2, 3, 4)]
    with open(path, "rb") as f:
        assert complete_length(f.fileno()) == path.stat().st_size


@pytest.mark.parametrize("cut", [1, 2, 10, -8, -1])
def test_a_torn_last_member_is_cut_off_on_open(tmp_path: Path, cut: int) -> None:
    path = tmp_path / "a.jsonl.gz"
    out = JsonlGzFile(path)
    out.append(['{"task_id":1}'])
    out.close()
    good = path.stat().st_size
    torn = gzip.compress(b'{"task_id":2}\n' * 100)
    with open(path, "ab") as f:
        f.write(torn[:cut])
    out = JsonlGzFile(path)
    assert path.stat().st_size == good
    out.append(['{"task_id":3}'])
    out.close()
    assert lines_of(path) == ['{"task_id":1}', '{"task_id":3}']


def test_a_file_that_is_not_gzip_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "notes.jsonl.gz"
    path.write_bytes(b"my notes\n")
    with pytest.raises(ValidationError, match="not a gzip JSONL file"):
        JsonlGzFile(path)
    assert path.read_bytes() == b"my notes\n"


def test_one_writer_at_a_time(tmp_path: Path) -> None:
    path = tmp_path / "a.jsonl.gz"
    first = JsonlGzFile(path)
    try:
        with pytest.raises(ValidationError, match="being written by another"):
            JsonlGzFile(path)
    finally:
        first.close()
    JsonlGzFile(path).close()  # free again


def test_a_missing_directory_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(ValidationError, match="cannot open"):
        JsonlGzFile(tmp_path / "no" / "a.jsonl.gz")
    assert not os.path.exists(tmp_path / "no")
