"""Who may read what Postcard writes: its user alone, unless ``POSTCARD_UMASK`` says otherwise.

Run folders hold the configuration, every round's metrics, checkpoints and the final model (issue
#62, finding 8: they, the logs and the SuperLink's ``state.db`` were world-readable). By default
Postcard makes each run folder ``0700`` and its files ``0600``, and starts the processes of a
deployment (``postcard.deploy``: the SuperLink, SuperNodes, warm workers; ``postcard.fleetgate``
itself) with the umask ``077``, so that the database and everything Flower and the ServerApps write
there are private too.

``POSTCARD_UMASK`` (octal, default ``077``) is the one setting: folders get ``0777 & ~umask`` and
files ``0666 & ~umask``; ``027`` lets the group read (``0750`` / ``0640``), ``022`` gives everyone
read access as before (``0755`` / ``0644``). It is read where files are written (the ServerApp's
process; the in-process runner's) and where deployment processes start.

Run folders are made private without changing the process's umask (:func:`private_dir`,
:func:`private_file`, :func:`secure_tree`): in a simulation the ServerApp runs in a thread of a
process whose other threads write files of their own (caches, assets), and a umask is process-wide.
"""

from __future__ import annotations

import os
import stat
from pathlib import Path

ENV = "POSTCARD_UMASK"
DEFAULT_UMASK = 0o077


def umask() -> int:
    """The umask of ``$POSTCARD_UMASK`` (octal digits, e.g. ``077``, ``027``, ``022``), else ``077``."""
    value = os.environ.get(ENV, "").strip()
    if not value:
        return DEFAULT_UMASK
    try:
        mask = int(value, 8)
    except ValueError:
        mask = -1
    if not 0 <= mask <= 0o777:
        raise ValueError(f"{ENV}={value!r} is not a umask: give octal digits such as 077 (private, the default), "
                         "027 (the group may read) or 022 (everyone may read)")
    return mask


def dir_mode() -> int:
    return 0o777 & ~umask()


def file_mode() -> int:
    return 0o666 & ~umask()


def private_dir(path: str | Path, *, exist_ok: bool = True) -> Path:
    """``path`` made (parents as usual) and given :func:`dir_mode`, whatever the process's umask."""
    path = Path(path)
    path.mkdir(parents=True, exist_ok=exist_ok, mode=dir_mode())
    _chmod(path, dir_mode())
    return path


def private_file(path: str | Path) -> None:
    """Give the file ``path`` :func:`file_mode` (nothing if it does not exist)."""
    _chmod(Path(path), file_mode())


def secure_tree(folder: str | Path) -> None:
    """Every folder under ``folder`` (itself included) :func:`dir_mode`, every file :func:`file_mode`
    (executable bits kept where the folder mode has them); symbolic links are neither followed nor changed."""
    folder = Path(folder)
    dirs, files = dir_mode(), file_mode()
    if folder.is_symlink() or not folder.is_dir():
        return
    _chmod(folder, dirs)
    for root, subdirs, names in os.walk(folder):
        for name in subdirs:
            path = Path(root, name)
            if not path.is_symlink():
                _chmod(path, dirs)
        for name in names:
            path = Path(root, name)
            try:
                st = path.lstat()
            except OSError:
                continue
            if stat.S_ISREG(st.st_mode):
                _chmod(path, files | (st.st_mode & 0o111 & dirs))


def _chmod(path: Path, mode: int) -> None:
    try:
        if stat.S_IMODE(path.lstat().st_mode) != mode:
            os.chmod(path, mode)
    except FileNotFoundError:
        pass
    except PermissionError:  # a file of another user (a shared folder): its owner decides
        pass
