"""torch's own Flight Recorder dump of a rank, collected by the process that started it.

When an NCCL collective times out (DDP, FSDP, or phalanx's own CUDA path), torch's watchdog writes the rank's
Flight Recorder (its last collectives, their state, the stacks that issued them) to the file
``<TORCH_FR_DUMP_TEMP_FILE><global rank>`` (a pickle; ``TORCH_NCCL_DUMP_ON_TIMEOUT``, on by default since
torch 2.5; the older name of the prefix is ``TORCH_NCCL_DEBUG_INFO_TEMP_FILE``) and then aborts the process:
nothing inside the rank can send it anywhere. So whoever starts a rank (the local launcher, a host agent's
supervisor, a Spark task) points that prefix at a directory of its own, made for this rank by ``mkdtemp``
(mode 0700, a random name: nothing another user planted can redirect torch's write), and once the rank has
ended reads what torch wrote there and sends a summary as the rank's last output lines, ahead of its exit:
the driver's console shows them, and the failure report carries them with the rank's last lines.

Reading is guarded, since the file is data from a process that may be broken: it is opened with
``O_NOFOLLOW`` relative to the directory, must be a regular file of this user of at most :data:`MAX_BYTES`,
and is unpickled by an unpickler that builds plain data only (dicts, lists, strings, numbers; torch's list
rebuilders become ``list``): any other class or a persistent id is refused, and the summary says why. The
summary's text is stripped of control characters. The dump stays where it is (for torch's
``fr_trace``) when the rank failed; else, and when torch wrote nothing, the directory is removed. A launcher
killed before it could look leaves its directories behind: their names carry its pid, and the next launcher on
the host removes the empty ones of processes that are gone.
"""

from __future__ import annotations

import functools
import io
import os
import pickle
import re
import shutil
import socket
import stat
import tempfile
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from phalanx.env import names
from phalanx.launch.proctree import is_alive

#: torch's file name for a rank's dump, after the prefix directory (its own default before 2.6).
FILE_PREFIX = "nccl_trace_rank_"
#: The largest dump read (a 2000-entry recorder with stacks is ~1-3 MiB).
MAX_BYTES = 32 << 20
#: Most dump files read from one rank's directory.
MAX_FILES = 4
#: Most entries shown per dump, the last ones.
SHOWN_ENTRIES = 8
_PREFIX_VARS = (names.TORCH_FR_DUMP_TEMP_FILE, names.TORCH_NCCL_DEBUG_INFO_TEMP_FILE)
#: The start of a rank's dump directory's name, followed by the creating process's pid.
DIR_PREFIX = "phalanx-fr-"
_DIR_NAME = re.compile(re.escape(DIR_PREFIX) + r"(\d{1,9})-[A-Za-z0-9_]+")
_NAME = re.compile(re.escape(FILE_PREFIX) + r"(\d{1,9})")
_CONTROL = re.compile(r"[\x00-\x1f\x7f-\x9f]")
#: torch's pickler rebuilds typed lists through these; they are lists of plain values.
_LIST_BUILDERS = {("torch.jit._pickle", n) for n in ("build_intlist", "build_doublelist", "build_boollist")}


class _PlainUnpickler(pickle.Unpickler):
    """Plain data only: no class, function or persistent id but torch's typed-list rebuilders."""

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) in _LIST_BUILDERS:
            return list
        if (module, name) == ("torch.jit._pickle", "restore_type_tag"):
            return lambda value, _tag: value
        raise pickle.UnpicklingError(f"it names {module}.{name}, which a Flight Recorder dump never holds")


def load_plain(data: bytes) -> Any:
    """Unpickle ``data`` as plain data (see the module's docstring).

    Raises:
        pickle.UnpicklingError: it holds anything else, or is not a pickle.
    """
    try:
        return _PlainUnpickler(io.BytesIO(data)).load()
    except pickle.UnpicklingError:
        raise
    except Exception as e:  # a truncated or corrupt pickle raises many kinds
        raise pickle.UnpicklingError(f"it is not a readable pickle ({type(e).__name__}: {e})") from e


@dataclass
class DumpDir:
    """The private directory one rank's dump goes to (``path`` None: the user chose where dumps go)."""

    path: str | None

    @classmethod
    def create(cls, env: Mapping[str, str]) -> DumpDir:
        """A new directory for a rank whose environment is ``env`` (none when the user set the prefix). Its
        name carries this process's pid: the first call of a process also removes the empty ones whose
        process is gone (a launcher killed before it could read its ranks' dumps)."""
        if any(env.get(v) for v in _PREFIX_VARS):
            return cls(None)
        sweep_once()
        return cls(tempfile.mkdtemp(prefix=f"{DIR_PREFIX}{os.getpid()}-"))

    def env(self) -> dict[str, str]:
        """The rank's variables pointing torch's dump here (both names: torch reads the newer one first)."""
        if self.path is None:
            return {}
        prefix = os.path.join(self.path, FILE_PREFIX)
        return dict.fromkeys(_PREFIX_VARS, prefix)

    def collect(self, failed: bool) -> list[str]:
        """The summary lines of what torch wrote (none when it wrote nothing); keeps the files when the rank
        ``failed`` and there are some, else removes the directory."""
        if self.path is None:
            return []
        try:
            found = _read_all(self.path)
        except OSError:
            found = []
        if not found or not failed:
            shutil.rmtree(self.path, ignore_errors=True)
            return []
        lines: list[str] = []
        for rank, dump in found:
            lines += summarize(rank, dump, f"{socket.gethostname()}:{os.path.join(self.path, FILE_PREFIX)}{rank}")
        return lines


@functools.cache
def sweep_once() -> None:
    """Remove the empty dump directories in the temporary directory whose creating process is gone (once per
    process). One that holds a dump stays: it is a failed rank's, kept for ``fr_trace``."""
    tmp = tempfile.gettempdir()
    try:
        names = os.listdir(tmp)
    except OSError:
        return
    for name in names:
        m = _DIR_NAME.fullmatch(name)
        if m is None or is_alive(int(m.group(1))):
            continue
        try:
            os.rmdir(os.path.join(tmp, name))  # only an empty directory; never a link; another user's: EPERM
        except OSError:
            pass


def _read_all(path: str) -> list[tuple[int, Any]]:
    """(rank, dump or the reason it was refused) for each dump file in ``path``, by rank."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        ranks = sorted(int(m.group(1)) for n in os.listdir(fd) if (m := _NAME.fullmatch(n)))
        return [(r, _read_one(fd, f"{FILE_PREFIX}{r}")) for r in ranks[:MAX_FILES]]
    finally:
        os.close(fd)


def _read_one(dir_fd: int, name: str) -> Any:
    """The dump in ``name``, or a ``str`` saying why it is not read."""
    try:
        fd = os.open(name, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC, dir_fd=dir_fd)
    except OSError as e:
        return f"not opened ({e.strerror})"
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_uid != os.geteuid():
            return "not a regular file of this user"
        if st.st_size > MAX_BYTES:
            return f"{st.st_size} bytes, more than the {MAX_BYTES} read"
        with os.fdopen(os.dup(fd), "rb") as f:
            data = f.read(MAX_BYTES + 1)
    finally:
        os.close(fd)
    try:
        return load_plain(data)
    except pickle.UnpicklingError as e:
        return f"refused: {e}"


def _clean(value: Any, limit: int = 160) -> str:
    text = _CONTROL.sub("?", str(value))
    return text if len(text) <= limit else text[: limit - 3] + "..."


def summarize(rank: int, dump: Any, where: str) -> list[str]:
    """The lines sent for one dump: where it is, each group's last collectives, the last entries."""
    head = f"phalanx: torch's Flight Recorder dump of rank {rank} (written by NCCL's watchdog; kept at {where})"
    if isinstance(dump, str):
        return [f"{head}: {dump}"]
    if not isinstance(dump, dict) or not isinstance(dump.get("entries", []), list):
        return [f"{head}: refused: not a Flight Recorder dump (no list of entries)"]
    lines = [f"{head}, version {_clean(dump.get('version', '?'), 20)}:"]
    status = dump.get("pg_status")
    if isinstance(status, dict):
        for group, s in list(status.items())[:8]:
            if isinstance(s, dict):
                last = [_clean(s.get(f"last_{k}_collective"), 20) for k in ("enqueued", "started", "completed")]
                lines.append(f"  group {_clean(group, 40)}: last enqueued #{last[0]}, started #{last[1]}, "
                             f"completed #{last[2]}")
    entries = [e for e in dump.get("entries", []) if isinstance(e, dict)]
    for e in entries[-SHOWN_ENTRIES:]:
        lines.append(_entry(e))
    if not entries:
        lines.append("  (no collective recorded)")
    return lines


def _entry(e: dict[Any, Any]) -> str:
    group = e.get("process_group")
    name = group[0] if isinstance(group, (list, tuple)) and group else "?"
    line = (f"  #{_clean(e.get('collective_seq_id'), 20)} {_clean(e.get('profiling_name'), 60)} on group "
            f"{_clean(name, 40)} ({_clean(e.get('state'), 20)}) inputs {_clean(e.get('input_sizes'), 80)} "
            f"{_clean(e.get('input_dtypes'), 60)}")
    frames = e.get("frames")
    if e.get("state") != "completed" and isinstance(frames, list) and frames and isinstance(frames[0], dict):
        f = frames[0]
        line += f" at {_clean(f.get('filename'), 100)}:{_clean(f.get('line'), 10)} in {_clean(f.get('name'), 60)}"
    return line
