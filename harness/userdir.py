"""This user's directory for warm servers' sockets, their logs and locks, and run files: one that
no one else controls, checked before every use.

Where: `$REPRO_SERVER_DIR/repro-UID` when set, else `$XDG_RUNTIME_DIR/repro-UID` (when that
is a directory of this user's, as the XDG spec has it), else `TMPDIR/repro-UID`. It is used only
while it is a real directory (not a symlink) owned by this uid with mode 0700; it is opened once
per use (O_NOFOLLOW) and everything in it is reached through that descriptor, so a directory
swapped after the check is never the one used. Files are opened with O_NOFOLLOW (a planted
symlink is refused, never followed). Sockets are addressed as /proc/self/fd/FD/NAME: always short
(AF_UNIX paths hold 107 bytes), whatever the temp dir's length. Whoever is at the other end of a
socket is checked too (SO_PEERCRED), on both sides.

Standard library only (the CLI parent and the fork server import it before torch); Linux.
"""

from __future__ import annotations

import contextlib
import os
import socket
import stat
import struct
import tempfile
from pathlib import Path

ENV_SERVER_DIR = "REPRO_SERVER_DIR"


class UnsafeDirectory(Exception):
    """The directory cannot be used (message: why, naming it)."""


def location() -> Path:
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime and not _ours(runtime):  # another user's (kept across su): not the spec's
        runtime = None
    base = os.environ.get(ENV_SERVER_DIR) or runtime or tempfile.gettempdir()
    return Path(base) / f"repro-{os.getuid()}"


def _ours(path: str) -> bool:
    try:
        st = os.stat(path)
    except OSError:
        return False
    return stat.S_ISDIR(st.st_mode) and st.st_uid == os.getuid()


class UserDirectory:
    """The directory, open and verified; use as a context (closes the descriptor)."""

    def __init__(self, path: Path, fd: int) -> None:
        self.path, self.fd = path, fd

    @classmethod
    def open(cls, create: bool = True) -> UserDirectory:
        """Open (creating it 0700 if missing and `create`) and verify; UnsafeDirectory if not."""
        path = location()
        created = False
        if create:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                os.mkdir(path, 0o700)
                created = True
            except FileExistsError:
                pass
            except OSError as e:
                raise UnsafeDirectory(f"{path}: cannot create it: {e.strerror}") from None
        try:
            fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as e:
            why = "a symlink" if os.path.islink(path) else e.strerror
            raise UnsafeDirectory(f"{path}: cannot open it: {why}") from None
        try:
            _verify(path, fd, created)
        except UnsafeDirectory:
            os.close(fd)
            raise
        return cls(path, fd)

    @classmethod
    def adopt(cls, fd: int) -> UserDirectory:
        """The directory open as an inherited `fd` (a warm server's), checked again."""
        path = Path(os.readlink(f"/proc/self/fd/{fd}"))
        os.set_inheritable(fd, False)
        _verify(path, fd, created=False)
        return cls(path, fd)

    def __enter__(self) -> UserDirectory:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1

    def address(self, name: str) -> str:
        """A socket address for NAME in this directory, short whatever the path's length."""
        return f"/proc/self/fd/{self.fd}/{name}"

    def open_file(self, name: str, flags: int, mode: int = 0o600) -> int:
        """os.open of NAME in this directory, never through a symlink."""
        return os.open(name, flags | os.O_NOFOLLOW | os.O_CLOEXEC, mode, dir_fd=self.fd)

    def exists(self, name: str) -> bool:
        try:
            os.stat(name, dir_fd=self.fd, follow_symlinks=False)
        except FileNotFoundError:
            return False
        return True

    def unlink(self, name: str) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(name, dir_fd=self.fd)


def _verify(path: Path, fd: int, created: bool) -> None:
    st = os.fstat(fd)
    if not stat.S_ISDIR(st.st_mode):
        raise UnsafeDirectory(f"{path}: not a directory")
    if st.st_uid != os.getuid():
        raise UnsafeDirectory(f"{path}: owned by uid {st.st_uid}, not by this user ({os.getuid()})")
    if created and stat.S_IMODE(st.st_mode) != 0o700:
        os.fchmod(fd, 0o700)  # our new directory, narrowed by the umask
        st = os.fstat(fd)
    if stat.S_IMODE(st.st_mode) != 0o700:
        raise UnsafeDirectory(f"{path}: mode {stat.S_IMODE(st.st_mode):04o}, not 0700")


def peer(sock: socket.socket) -> tuple[int, int]:
    """(pid, uid) of the process at the other end of a connected AF_UNIX socket (SO_PEERCRED:
    the kernel's word, not the peer's)."""
    raw = sock.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED, struct.calcsize("3i"))
    pid, uid, _ = struct.unpack("3i", raw)
    return pid, uid
