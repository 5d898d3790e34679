"""The agent process (one per node): ``lazarus agent``.

Everything here runs in the agent, on its asyncio event loop: registering with the
controller, heartbeats, starting and watching the node's workers, relaying plans down and
reports up.

* ``_agent`` — :class:`Agent`;
* ``_dial`` — reaching the controller: one registration attempt, the retries and their pacing;
* ``_exit_codes`` — what the agent exits with;
* ``_agent_worker`` — the agent's side of its worker processes (spawn, stderr relay,
  exit status, the restart policy);
* ``_watchdog`` — the hang watchdog: a worker stopped (SIGSTOP) or whose training thread
  is blocked is killed and handled as crashed.

The agent never imports torch, numpy or the planner (its worker's start-up is most of a
cold join): no module here imports :mod:`lazarus.runtime.worker` or
:mod:`lazarus.runtime.controller`. Kept light: nothing is imported here; the public name
is :class:`lazarus.runtime.Agent`.
"""

__all__: list[str] = []
