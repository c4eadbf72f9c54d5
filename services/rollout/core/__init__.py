"""The rollout domain core: seeds, the episode loop, trajectories and the env window schedule.

Pure Python: nothing here opens a socket, a database or a queue; the adapters in
``services/rollout/`` do, and ``wiring.py`` connects them.
"""
