"""Crash-safe file writes: a temporary file in the target's directory, fsynced, then renamed.

A reader sees either the previous file or the complete new one, never a
truncated mix: a crash, a kill or a full disk during the write leaves the target
as it was (and at worst a stray temporary file beside it).
"""

import contextlib
import os
import secrets
from collections.abc import Callable
from typing import BinaryIO


def write_atomically(path: str | os.PathLike, write: Callable[[BinaryIO], None]) -> None:
  """Calls `write(file)` on a temporary file beside `path`, then renames it over `path`.

  The file is flushed and fsynced before the rename (so the rename never
  exposes unwritten data), and the directory after it (so the rename itself
  survives a power loss). The temporary file is created with the mode a plain
  `open(path, "wb")` would give (0o666 less the umask).

  Args:
    path: the file to write.
    write: writes the whole content to the binary file it is given.
  """
  # A symlink stays a symlink: the file it points to is what gets replaced.
  target = os.path.realpath(os.fspath(path))
  directory, name = os.path.split(target)
  temporary = os.path.join(directory, f".{name}.{os.getpid()}.{secrets.token_hex(4)}.tmp")
  fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | getattr(os, "O_BINARY", 0), 0o666)
  try:
    with os.fdopen(fd, "wb") as file:
      write(file)
      file.flush()
      os.fsync(file.fileno())
    os.replace(temporary, target)
  except BaseException:
    with contextlib.suppress(OSError):
      os.unlink(temporary)
    raise
  _fsync_directory(directory)


def _fsync_directory(directory: str) -> None:
  if os.name != "posix":
    return  # Windows cannot open a directory; its rename is durable on its own terms
  fd = os.open(directory, os.O_RDONLY)
  try:
    os.fsync(fd)
  finally:
    os.close(fd)
