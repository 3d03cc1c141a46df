"""Multi-turn rollouts: environments (``task.env``) and tools (``task.tools``) between turns.

``loop`` (the trajectories the SGS runs), ``env`` and ``runner`` (environments in isolated worker
processes), ``tools`` (schemas, Hermes tool calls), ``chat`` (a conversation's tokens).
"""
