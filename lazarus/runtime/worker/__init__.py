"""The training worker process (G per node, spawned by the agent).

Everything here runs inside the training process, beside the user's model:

* ``_trainer`` — :class:`ElasticTrainer`, the step loop (``_elastic_config``: its config;
  ``_worker_state``: the state it holds, which each reconfiguration takes and returns);
* ``_channel`` — :class:`AgentChannel`, the worker's end of the agent connection
  (``_plan_feed``: its plan messages read as :class:`~lazarus.runtime._plan.Plan`);
* ``_reconfigure`` — applying a controller plan in process to a worker's state (it
  imports no trainer); its parts, owned by the
  reconfigurer: ``_join_gate`` (a join prepared while the members train), ``_moc_groups``
  (moc's groups formed in a thread), ``_rendezvous_store`` (its clients of the plans'
  stores); with ``_transfer`` (unit states moved between ranks) and ``_store_connect`` (a
  rendezvous-store connect that can be given up on);
* ``_abort`` — hard abort of a broken process group; ``_backend`` — device and backend;
  ``_step_reduce`` — the step's one all-reduce; ``_lazy_dynamo`` — ``torch._dynamo``
  deferred until something compiles; ``_progress`` — the training thread's progress beat,
  read by the agent's hang watchdog.

Kept light: nothing is imported here (``_channel`` needs no torch; the rest does), and the
public names (:mod:`lazarus.runtime`) load their module on first use.
"""

__all__: list[str] = []
