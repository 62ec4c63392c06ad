"""``hvd.elastic.run``: sync, call, and on a lost peer roll back, re-form the world and go on."""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

from phalanx.errors import ElasticTimeoutError, HorovodInternalError, HostsUpdatedInterrupt, PhalanxError
from phalanx.torch import basics, process_sets
from phalanx.torch._runtime import RUNTIME
from phalanx.torch.elastic import _rendezvous
from phalanx.torch.elastic.state import State

log = logging.getLogger(__name__)
R = TypeVar("R")

#: Seconds to wait for the driver to announce a new world after one of phalanx's own collective errors that
#: does not look like a lost peer: if a round comes, the error was the loss; if not, it is raised. The user's
#: exceptions (``OSError``, ``TimeoutError``, ``ValueError``...) are never taken for a loss: as in Horovod,
#: only a failed collective (``HorovodInternalError``) or ``HostsUpdatedInterrupt`` re-forms the world, and
#: anything else propagates (the driver then stops the job, releasing the ranks blocked in the old round).
LOSS_CONFIRM_S = 5.0
#: Words gloo puts in the errors it raises when a peer went away (its socket closed or timed out).
_PEER_LOST = ("connection closed", "connection reset", "broken pipe", "timed out", "gloo", "peer")


def is_peer_loss(error: BaseException) -> bool:
    """Whether ``error`` means a collective failed because the world changed (not the user's bug)."""
    if isinstance(error, (HorovodInternalError, dist.DistError)):
        return True
    text = str(error).lower()
    return isinstance(error, RuntimeError) and any(word in text for word in _PEER_LOST)


def _confirmed_loss(error: Exception) -> bool:
    return isinstance(error, PhalanxError) and _rendezvous.new_round_published(LOSS_CONFIRM_S)


def _abandon_round(error: Exception) -> None:
    """Give up this round's shared-memory channels before rolling back alone (see ``abandon_process_sets``)."""
    who = f"rank {basics.rank()}" if basics.is_initialized() else "a rank"
    process_sets.abandon_process_sets(f"{who} rolled back after {type(error).__name__}: {error}")


def reset(deadline_s: float) -> None:
    """Leave the broken world and join the driver's next one (retrying while rounds fail to form).

    Raises:
        ElasticTimeoutError: no round formed within ``deadline_s`` seconds.
    """
    give_up = time.monotonic() + deadline_s
    while True:
        basics.shutdown()
        try:
            basics.init()
            return
        except ElasticTimeoutError:
            raise
        except Exception as e:
            if not is_peer_loss(e) or time.monotonic() > give_up:
                raise
            log.warning("elastic round failed to form (%s); waiting for the next one", e)


def run(func: Callable[..., R]) -> Callable[..., R]:
    """Decorate a training function ``func(state, *args, **kwargs)`` to survive lost workers.

    The wrapper syncs the state from rank 0, calls ``func``; when a collective fails because a peer died
    it restores the last commit, re-forms the world (``hvd.shutdown()``, wait for the driver's next round,
    ``hvd.init()``), runs the reset callbacks, syncs and calls ``func`` again.

    Args:
        func: the training function; its first argument is a :class:`State`.

    Returns:
        The wrapped function (returns ``func``'s value from the final world).
    """

    @functools.wraps(func)
    def wrapper(state: State, *args: Any, **kwargs: Any) -> R:
        basics.init()
        state.resume_from_checkpoint()
        skip_sync = False
        while True:
            if not skip_sync:
                state.sync()
            _rendezvous.mark_synced()
            try:
                return func(state, *args, **kwargs)
            except HostsUpdatedInterrupt as e:
                skip_sync = e.skip_sync
            except Exception as e:
                if not RUNTIME.round.store or not (is_peer_loss(e) or _confirmed_loss(e)):
                    raise
                log.warning("collective failed (%s: %s); rolling back to commit %d", type(e).__name__, e,
                            state.commits)
                # A peer may still wait in this round's collectives (the error was this rank's alone): release
                # it now rather than after the shared-memory time-out, so that it re-forms too.
                _abandon_round(e)
                state.restore()
                skip_sync = False
            reset(_rendezvous.timeout_s() * 3)
            state.on_reset()

    return wrapper
