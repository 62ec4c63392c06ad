"""The engine: one order of collectives per rank (handles, negotiated rounds, fusion, matching by name).

``core`` (handles, the queue, waits), ``rounds`` (one negotiated round, the same on every member),
``collective`` / ``collectives`` (each kind's local side), ``header`` (the control block's wire format),
``names`` (matching by name), ``speculate`` (payloads sent ahead of the check), ``background`` (the thread
running ``*_async`` jobs), ``join`` (``hvd.join``'s protocol), ``reduce`` (op codes and local reduction),
``trace`` (timeline events).
"""
