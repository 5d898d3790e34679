"""The controller process (one per job): ``lazarus controller``.

Everything here runs in the controller, on its asyncio event loop, and never in an agent
or a training worker:

* ``_controller`` — :class:`Controller`: the agents' connections, the rendezvous
  ``TCPStore``, failure detection, plans sent down;
* ``_membership`` — the view of the cluster and when to plan (joins, failures, rebalances);
* ``_resume`` — the state saved to, and resumed from, the state directory;
* ``_state`` — that state's file (atomic JSON);
* ``_planner`` — pure functions computing a plan: replicas, placement, node mapping
  (the only module here that needs numpy, through :mod:`lazarus.planning`).

Kept light: nothing is imported here, so naming the package costs nothing; the public
name, :class:`lazarus.runtime.Controller`, loads ``_controller`` on first use.
"""

__all__: list[str] = []
