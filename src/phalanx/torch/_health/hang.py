"""The hang report: once a rank has waited in a collective past the stall warning time, one report names the
collective, the ranks missing from it and what each of them is doing, with every rank's Python stack (every
thread) and the tail of torch's Flight Recorder (the recent NCCL or gloo collectives of each rank, when
``TORCH_FR_BUFFER_SIZE`` / ``TORCH_NCCL_TRACE_BUFFER_SIZE`` is set: phalanx's launchers set it).

Every rank runs a watcher thread from ``hvd.init()`` that reads one store key every :func:`watch_interval`
seconds. The first rank of a stalled collective to reach the warning time (a store counter per collective
decides, so a job gets one report per hang) sets that key; every rank's watcher answers with its own section
(:func:`section`) and the reporter waits up to :data:`ANSWER_S` for them. A rank whose watcher cannot run (its
Python is blocked in C code holding the GIL) is listed as silent. The report goes to the reporter's stderr,
which every launcher streams to the driver, and into the error the stall shutdown raises.
"""

from __future__ import annotations

import json
import os
import socket
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import Any

from phalanx.torch._health.deadlock import Record, stalled_text
from phalanx.torch._runtime import RUNTIME, Watcher

#: Most seconds the reporter waits for the other ranks' sections.
ANSWER_S = 4.0
#: Flight Recorder entries shown per rank.
FR_ENTRIES = 8
_FR_SIZES = ("TORCH_NCCL_TRACE_BUFFER_SIZE", "TORCH_FR_BUFFER_SIZE")


def watch_interval(size: int) -> float:
    """Seconds between two reads of the request key by one rank's watcher: 1 s, longer in large jobs so the
    store serves at most ~200 reads a second."""
    return max(1.0, size / 200.0)


def start(store: Any, rank: int, size: int, describe_wait: Callable[[], str | None]) -> None:
    """Start watching for requests (``hvd.init()``); ``describe_wait()`` tells this rank's current wait."""
    stop()
    watcher = RUNTIME.watcher = Watcher(store, rank, size, describe_wait)
    store.set(f"stack/{rank}", "")
    threading.Thread(target=_loop, args=(watcher,), name="phalanx-hang-watch", daemon=True).start()


def stop() -> None:
    """Stop the watcher (``hvd.shutdown()``)."""
    RUNTIME.watcher.stop.set()
    RUNTIME.watcher.store = None


def _loop(watcher: Watcher) -> None:
    """The watcher thread: answer each new report request with this rank's section, until stopped."""
    interval = watch_interval(watcher.size)
    store = watcher.store
    while not watcher.stop.wait(interval):
        try:
            if not store.check(["request"]):
                continue
            rid = int(json.loads(store.get("request"))["id"])
            if rid == watcher.answered:
                continue
            watcher.answered = rid
            text = section(watcher.rank, watcher.describe_wait(), skip=threading.get_ident())
            store.set(f"stack/{watcher.rank}", json.dumps({"id": rid, "text": text}))
        except (RuntimeError, OSError, ValueError, KeyError, TypeError):
            return  # the store is gone (the job is ending): nothing to answer any more


#: A phalanx thread (``phalanx-*``) is shown only when it is inside a collective (the async ops' thread may be).
_IN_COLLECTIVE = ("/phalanx/torch/_engine/core.py", "/phalanx/torch/_health/stall.py", "/phalanx/transport/")
#: Frames of the worker's entry above the user's function, left out.
_ENTRY_FRAMES = ("<frozen runpy>", "/phalanx/worker/", "threading.py")


_PACKAGE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))) + os.sep  # phalanx/


def _into_phalanx(frames: list[traceback.FrameSummary]) -> list[traceback.FrameSummary]:
    """The frames down to the first call into phalanx (the user's call; what phalanx does inside is its own)."""
    for i, f in enumerate(frames):
        if f.filename.startswith(_PACKAGE):
            return frames[: i + 1]
    return frames


def python_stacks(skip: int | None = None) -> str:
    """Every thread's Python stack, innermost call last, without phalanx's idle threads and the frames of the
    worker's entry (``skip``: a thread id left out)."""
    names = {t.ident: t.name for t in threading.enumerate()}
    parts = []
    for ident, frame in sys._current_frames().items():
        name = str(names.get(ident, ident))
        full = traceback.extract_stack(frame)
        idle = name.startswith("phalanx-") and not any(s in f.filename for f in full for s in _IN_COLLECTIVE)
        if ident == skip or idle:
            continue
        frames = _into_phalanx([f for f in full if not any(s in f.filename for s in _ENTRY_FRAMES)])
        stack = "".join(traceback.format_list(frames)).rstrip()
        parts.append(f"  thread {name}:\n" + "\n".join("  " + line for line in stack.splitlines()))
    return "\n".join(parts)


def flight_recorder(limit: int = FR_ENTRIES) -> str:
    """The last ``limit`` collectives torch's Flight Recorder holds for this rank (NCCL's or gloo's), one per
    line; "" when it is off or unavailable."""
    if not any(os.environ.get(k, "0") not in ("", "0") for k in _FR_SIZES):
        return ""
    try:
        from torch._C import _distributed_c10d as c10d

        dump = getattr(c10d, "_dump_fr_trace_json", None) or getattr(c10d, "_dump_nccl_trace_json", None)
        if dump is None:
            return ""
        entries = json.loads(dump(True, False)).get("entries", [])
    except Exception:  # the dump is best effort: a report without it still names the ranks
        return ""
    lines = []
    for e in entries[-limit:]:
        group = e.get("process_group") or ["?", "?"]
        lines.append(f"  #{e.get('collective_seq_id')} {e.get('profiling_name')} on group {group[-1]} "
                     f"({e.get('state')}) inputs {e.get('input_sizes')} {e.get('input_dtypes')}")
    return "\n".join(lines)


def section(rank: int, wait: str | None, skip: int | None = None) -> str:
    """This rank's part of a report: where it is, its phalanx wait, its stacks, its Flight Recorder tail."""
    head = f"--- rank {rank} (host {socket.gethostname()}, pid {os.getpid()}): "
    head += f"waits in {wait}" if wait else "not in any phalanx collective"
    fr = flight_recorder()
    body = [head, "  Python stacks (most recent call last):", python_stacks(skip)]
    if fr:
        body += ["  Flight Recorder (last collectives; torch's TORCH_FR_BUFFER_SIZE):", fr]
    return "\n".join(body)


def report(store: Any, rank: int, size: int, wait: dict[str, Any], records: dict[int, Record], waited: float,
           own_wait: str) -> str | None:
    """The report of ``wait``'s stall, when this rank is the first of the collective to ask; else None.

    Args:
        store: the stall inspector's store.
        rank: this rank.
        size: the job's ranks.
        wait: this rank's wait (``_stall.current_wait``).
        records: every blocked rank's published record.
        waited: seconds this rank has waited.
        own_wait: this rank's wait, as its section names it.
    """
    key = f"reported/{','.join(map(str, wait['ranks']))}/{wait['seq']}"
    if int(store.add(key, 1)) != 1:
        return None
    rid = int(store.add("request_seq", 1))
    store.set("request", json.dumps({"id": rid, "by": rank}))
    answers = {rank: section(rank, own_wait)}
    keys = [f"stack/{r}" for r in range(size)]
    deadline = time.monotonic() + ANSWER_S
    while len(answers) < size and time.monotonic() < deadline:
        time.sleep(0.1)
        if not store.check(keys):
            continue
        for r, text in enumerate(store.multi_get(keys)):
            d = json.loads(text) if text else None
            if r not in answers and d is not None and d.get("id") == rid:
                answers[r] = d["text"]
    silent = [r for r in range(size) if r not in answers]
    lines = [f"phalanx hang report (rank {rank} has waited {waited:.0f} s): {stalled_text(rank, wait, records)}"]
    lines += [answers[r] for r in sorted(answers)]
    if silent:
        lines.append(f"--- no answer within {ANSWER_S:g} s from rank(s) {silent} (Python blocked in C code holding "
                     "the GIL, or the rank has ended)")
    return "\n".join(lines) + "\n"
