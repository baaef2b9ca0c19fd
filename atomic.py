"""Writing a file so that a crash, a kill or a full disk at any moment never leaves a part of it under its name.

    atomic_write(path, b"bytes", b"more")             # readers see the old file or the whole new one
    replace_with(path, lambda f: fig.savefig(f))      # the same for a writer that takes a file object
    write_synced(tmp, write)                          # a new file, on disk when this returns: the first half of
                                                      # a commit its caller makes (a checkpoint and its digest)
    fd = lock_directory(work_dir)                     # held while a writer works there: a later one tells a
                                                      # killed writer's leftover (unlocked) from a live one's

Every file the project writes goes through one of these; an OSError is one line naming the file and the space
left (cli.write_error), and the half-written file is gone.
"""

import os

from cli import write_error


def write_synced(path: str, write):
    """write(f) into a new file at path, flushed and synced to disk -> what write returned."""
    with open(path, "wb") as f:
        result = write(f)
        f.flush()
        os.fsync(f.fileno())
    return result


def replace_with(path: str, write, what: str = "file", after: str = ""):
    """write(f) into a new file beside path, synced, which then replaces path -> what write returned. On any
    failure the new file is removed; an OSError becomes cli.WriteError (write_error's `what` and `after`)."""
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        result = write_synced(tmp, write)
        os.replace(tmp, path)
        return result
    except BaseException as e:
        if os.path.exists(tmp):
            os.remove(tmp)
        if isinstance(e, OSError):  # a full disk, say: one line naming the file and the space left
            raise write_error(what, path, e, after) from None
        raise


def atomic_write(path: str, *chunks) -> None:
    """Bytes-like chunks, in order, as the file at path (replace_with)."""
    replace_with(path, lambda f: [f.write(chunk) for chunk in chunks])


def lock_directory(directory: str) -> int | None:
    """A descriptor of directory that holds an exclusive flock on it until it is closed or the process ends;
    None when another process (or descriptor) holds it or there is no flock (Windows, some network filesystems).
    A work directory that its maker keeps locked is one that a later run can tell from a killed run's leftover."""
    try:
        import fcntl
    except ImportError:
        return None
    try:
        fd = os.open(directory, os.O_RDONLY)
    except OSError:
        return None
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except OSError:
        os.close(fd)
        return None
    return fd


def in_the_way(path: str, lexists=os.path.exists) -> str | None:
    """What is at path that a file written there cannot replace ("a directory", "not a regular file"), or None
    (nothing there, or a file). lexists: os.path.lexists to count a dangling symlink as in the way."""
    if not lexists(path) or os.path.isfile(path):
        return None
    return "a directory" if os.path.isdir(path) else "not a regular file"
