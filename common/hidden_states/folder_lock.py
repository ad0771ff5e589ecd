"""The lock a 02 shard holds on its output folder, and the disk check before it writes."""

from __future__ import annotations

import contextlib
import fcntl
import os
import shutil
import socket
from collections.abc import Iterator
from pathlib import Path

from common.atomic import (
    format_bytes,
)
from common.errors import PipelineError

LOCK_FORMAT = ".extract_lock_{shard}_of_{shards}"  # held while a 02 writes that shard (see shard_lock)


@contextlib.contextmanager
def shard_lock(root: Path, shard_index: int, num_shards: int) -> Iterator[None]:
    """Hold this shard's lock on `root` for the block: a second 02 writing the same shard into
    the same folder (a command started twice, a job scheduled twice) would redo the same work and
    race on every file, so it is refused, naming the process that holds the lock. The kernel drops
    a lock when its process dies (SIGKILL included); the file is removed on a normal exit."""
    path = root / LOCK_FORMAT.format(shard=shard_index, shards=num_shards)
    while True:
        file = path.open("a+", encoding="utf-8")
        try:
            fcntl.flock(file, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            file.seek(0)
            holder = file.read().strip() or "a process"
            file.close()
            raise PipelineError(f"output folder {root}: {holder} is writing shard {shard_index} of {num_shards} into "
                                "it; wait for it to finish (or stop it), then run the same command again") from None
        if path.exists() and os.stat(path).st_ino == os.fstat(file.fileno()).st_ino:
            break
        file.close()  # the holder removed the file between our open and lock: lock the new one
    file.seek(0)
    file.truncate()
    file.write(f"02_extract_hidden_states.py (pid {os.getpid()} on {socket.gethostname()})")
    file.flush()
    try:
        yield
    finally:
        path.unlink(missing_ok=True)
        file.close()


def check_disk(root: Path, needed_bytes: int) -> None:
    """Refuse to start when the output disk cannot hold the estimated files."""
    probe = root if root.exists() else next(p for p in root.parents if p.exists())
    free = shutil.disk_usage(probe).free
    if needed_bytes > free:
        raise PipelineError(f"output disk of {root} has {format_bytes(free)} free, the samples still to extract "
                            f"need about {format_bytes(needed_bytes)}; free space, choose another --output, "
                            "or pass --skip-disk-check")
