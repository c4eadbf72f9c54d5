"""The reasoning agent's side of a play: the episode loop and what it needs, shared by every player.

- ``spade.agent.episode``: :class:`EpisodeRunner` plays one env on one seed (with or without the
  hint) through a session and a generator; :class:`PlayLimits`, how a play ends.
- ``spade.agent.ports``: the protocols it plays through (sessions, generation, chat templates).
- ``spade.agent.trajectory``: the token-level record of a play (what the learner trains on).
- ``spade.agent.pace``: paced turns (a long session's turns spread so sessions do not bunch).
- ``spade.agent.prompts``: the first message of a game and the hint's place in it.

The rollout service (``services/rollout``) and ``spade eval``'s pool suite both play through this
loop. Pure Python: nothing here opens a socket, a database or a queue.
"""
