"""The same-host shared-memory transport, a layer of its own below phalanx.torch (see ``docs/shm.md``).

Other layers use it through two modules only: :mod:`.api` (the calls phalanx.torch routes its collectives
through) and :mod:`.backend` (the ``phalanx_shm`` ``torch.distributed`` backend, registered on import). It
imports ``phalanx.env`` and ``phalanx.errors``, never its callers: what it must ask them during a wait, it
gets as callbacks (:func:`.api.set_wait_hooks`). This package module imports nothing, so importing
``phalanx.transport.backend`` loads only the modules the backend needs.
"""
