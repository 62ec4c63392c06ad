"""The engine's health: ``stall`` (the stall inspector), ``deadlock`` (its analysis of the published
records), ``hang`` (the one hang report with every rank's stack), ``generations`` (``hvd.init()`` again after
``hvd.shutdown()`` on one job store).
"""
