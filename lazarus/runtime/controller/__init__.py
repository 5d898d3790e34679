"""The controller process (one per job): ``lazarus controller``.

Everything here runs in the controller, on its asyncio event loop, and never in an agent
or a training worker:

* ``_controller`` — :class:`Controller`: the agents' connections, the rendezvous
  ``TCPStore``, heartbeats, plans sent down; it owns the parts below and gives them a
  ``Port`` (send to a node, record an event, save, timers) to act through;
* ``_membership`` — ``Membership``: the view of the cluster and when to plan (joins,
  failures, rebalances), without sockets (testable alone with a fake ``Port``);
* ``_probes`` — ``Probes``: the membership's reachability probes after a collective
  error and the admission probes of a node cut off for a broken link (no sockets either);
* ``_reachability`` — whom to cut off, from the probes' reports (pure);
* ``_port`` — the ``Port`` the membership acts through, its per-node record (``Node``)
  and the check of a message's fields;
* ``_resume`` — ``StateSaver`` (the state saved to the state directory) and ``Resume``
  (a restarted controller waiting for its members to come back);
* ``_state`` — that state's file (atomic JSON);
* ``_planner`` — pure functions computing a plan: replicas, placement, node mapping
  (the only module here that needs numpy, through :mod:`lazarus.planning`).

Kept light: nothing is imported here, so naming the package costs nothing; the public
name, :class:`lazarus.runtime.Controller`, loads ``_controller`` on first use.
"""

__all__: list[str] = []
