"""The file ``ax archive --to FILE.jsonl.gz`` appends to: gzip JSONL, one member per batch.

Guarantees:

* :meth:`JsonlGzFile.append` returns only once its lines are on disk: one
  complete gzip member written with ``O_APPEND``, then ``fsync`` (and, for a
  file it created, the directory's ``fsync``).
* Opening a file whose last member is torn (a crash during a write) cuts that
  member off, so what follows stays readable; the file is otherwise only ever
  appended to. A file that does not start with complete gzip members (not one
  this module wrote) is refused, never truncated.
* One writer at a time: the file is ``flock``-ed while open; a second run on the
  same file is refused at once.

Opening reads (decompresses) the whole file once to find where its complete
members end: a few seconds per million archived tasks.
"""

from __future__ import annotations

import errno
import fcntl
import gzip
import logging
import os
import zlib
from pathlib import Path

from ax_kombu.exceptions import StoreError, ValidationError

log = logging.getLogger(__name__)

_GZIP_MAGIC = b"\x1f\x8b"
_CHUNK = 1 << 20


class JsonlGzFile:
    """An open archive file, locked for this process, its torn tail (if any) cut off.

    Raises:
        ValidationError: the file cannot be opened, is locked by another run, or is
            not a gzip file this module wrote.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        created = not self.path.exists()
        try:
            self._fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_APPEND, 0o644)
        except OSError as exc:
            raise ValidationError(f"cannot open --to {self.path}: {exc.strerror}") from None
        try:
            self._lock()
            self._repair()
            if created:
                _fsync_dir(self.path)
        except BaseException:
            os.close(self._fd)
            raise

    def _lock(self) -> None:
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise ValidationError(f"{self.path} is being written by another "
                                      "ax archive") from None
            raise

    def _repair(self) -> None:
        size = os.fstat(self._fd).st_size
        good = complete_length(self._fd)
        if good == size:
            return
        os.lseek(self._fd, good, os.SEEK_SET)
        tail = os.read(self._fd, len(_GZIP_MAGIC))
        if not _GZIP_MAGIC.startswith(tail[:len(_GZIP_MAGIC)]):
            raise ValidationError(f"{self.path} is not a gzip JSONL file written by ax archive"
                                  f" (unreadable after byte {good}); give another --to")
        log.warning("archive file ends with a torn batch; cutting it off",
                    extra={"path": str(self.path), "kept_bytes": good, "cut_bytes": size - good})
        os.ftruncate(self._fd, good)
        os.fsync(self._fd)

    def append(self, lines: list[str]) -> None:
        """Append ``lines`` as one gzip member and ``fsync`` it.

        Raises:
            StoreError: the write failed (the file may end in a torn member, which
                the next open cuts off).
        """
        data = gzip.compress("".join(f"{line}\n" for line in lines).encode(), mtime=0)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(self._fd, view):]
            os.fsync(self._fd)
        except OSError as exc:
            raise StoreError(f"cannot write to {self.path}: {exc.strerror}") from None

    def close(self) -> None:
        os.close(self._fd)  # also releases the flock


def complete_length(fd: int) -> int:
    """How many leading bytes of the file ``fd`` are complete gzip members."""
    os.lseek(fd, 0, os.SEEK_SET)
    good = offset = 0
    member = zlib.decompressobj(zlib.MAX_WBITS | 16)
    while chunk := os.read(fd, _CHUNK):
        offset += len(chunk)
        while chunk:
            try:
                member.decompress(chunk)
            except zlib.error:
                return good
            if not member.eof:
                break
            good, chunk = offset - len(member.unused_data), member.unused_data
            member = zlib.decompressobj(zlib.MAX_WBITS | 16)
    return good


def _fsync_dir(path: Path) -> None:
    fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
