"""Pure scheduling policies shared by the simulator and the live system (no Ray, no torch).

- ``latency``: the PTL(BS) per-token latency model and its profile file.
- ``dispatch``: which instance gets each request (random, round-robin, least-loaded,
  skewness-aware = Algorithm 2).
- ``order``: admission order inside an instance (fifo, lpt).
- ``balance``: Algorithm 1, single and cross datacenter.
- ``elastic``: the scale-up rule of §3.4.
"""
