"""A deterministic simulation of the asynclock engine.

The real :class:`asynclock.Coordinator`, locks, leases, watchdog, elections, semaphores
and waiters run on a virtual-time event loop (:mod:`tests.sim.loop`) against a simulated
server (:mod:`tests.sim.server`, the memory backend's table semantics on a drifting
clock) behind a simulated network (:mod:`tests.sim.network`: seeded delays, resets,
partitions, client pauses). Random workloads (:mod:`tests.sim.workload`) run per seed
while :mod:`tests.sim.invariants` checks the safety invariants (README, "Guarantees")
after every loop step and every server event, and the liveness ones (no loss without a
fault, hand-off within round trips, no body step after its loss) on virtual time.
:mod:`tests.sim.runner` runs seeds (``python -m tests.sim.runner --seed N`` replays one),
:mod:`tests.sim.mutants` checks that re-introduced and planted bugs are caught.

The Redis kinds (:mod:`tests.sim.redis_world`) replace the simulated server, network and
client backend with the real Redis and Redlock backends, connected through the loop's
``create_connection`` (:mod:`tests.sim.wire`) to simulated Redis nodes that run the
shipped Lua scripts (:mod:`tests.sim.redis_node`); the same workloads and checks run.
"""
