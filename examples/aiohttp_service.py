"""A small aiohttp service on asynclock: pay an invoice once, whatever the concurrency.

- ``POST /invoices/{invoice_id}/pay`` runs under the lock ``invoice:{invoice_id}``
  (``@locked``) and hands the lease's fence to the store, which refuses a write carrying
  a smaller fence than one it has already seen (a holder whose lease ran out). A second
  request for the same invoice waits for the first (up to 2 s), then finds it paid; one
  that waits longer is answered ``423 Locked`` with ``Retry-After``.
- A leader-only job (one replica at a time among all that share the lock server)
  reconciles the invoices every few seconds, fenced by its term.

Run it (Python 3.11+, from a clone, with ``pip install -e '.[aiohttp]'``)::

    python examples/aiohttp_service.py

It serves on http://127.0.0.1:8080 with the in-process ``memory://`` backend, which
needs no server. To see two replicas share locks and elect one leader, point both at a
Redis or Valkey server::

    ASYNCLOCK_URL=redis://127.0.0.1:6379/0 PORT=8080 python examples/aiohttp_service.py
    ASYNCLOCK_URL=redis://127.0.0.1:6379/0 PORT=8081 python examples/aiohttp_service.py

Then::

    curl -X POST localhost:8080/invoices/42/pay & curl -X POST localhost:8080/invoices/42/pay
    # one pays (about 1 s), the other waits for it and answers "already paid"
    curl localhost:8080/invoices/42
    curl localhost:8080/leader    # which replica runs the reconciler
    curl localhost:8080/health    # the reconciler task's state on this replica
    for i in 1 2 3; do curl -si -X POST 'localhost:8080/invoices/7/pay?slow=3' & done
    # one pays (3 s); the other two give up after 2 s: 423 Locked, Retry-After: <seconds>

Each replica keeps its own fake store: in a real service the store (a database) is
shared, and it is the one that checks the fences.
"""

import asyncio
import logging
import os

from aiohttp import web

from asynclock import Term
from asynclock.integrations.aiohttp import (
    COORDINATOR,
    LEASE,
    leader_status,
    leader_task,
    locked,
    setup,
)

URL = os.environ.get("ASYNCLOCK_URL", "memory://")
PORT = int(os.environ.get("PORT", "8080"))
IDENTITY = os.environ.get("INSTANCE", f"api-{PORT}")

logger = logging.getLogger("aiohttp_service")


class StaleFenceError(Exception):
    """A write with a fence smaller than one the store has already accepted."""


class InvoiceStore:
    """A fake store that remembers the largest fence it has seen per invoice and refuses
    writes with a smaller one, as a real resource would (a column, a version check)."""

    def __init__(self) -> None:
        self.paid: dict[int, int] = {}  # invoice -> fence of the payment
        self.fences: dict[str, int] = {}

    def _check(self, key: str, fence: int) -> None:
        if fence < self.fences.get(key, 0):
            raise StaleFenceError(f"fence {fence} < {self.fences[key]} already seen for {key}")
        self.fences[key] = fence

    async def pay(self, invoice_id: int, fence: int, seconds: float) -> bool:
        """Charge the invoice unless it is paid; False if it was paid already."""
        self._check(f"invoice:{invoice_id}", fence)
        if invoice_id in self.paid:
            return False
        await asyncio.sleep(seconds)  # the payment provider is slow
        self._check(f"invoice:{invoice_id}", fence)
        self.paid[invoice_id] = fence
        return True

    async def reconcile(self, term: int) -> int:
        """The leader's periodic job: returns how many invoices it looked at."""
        self._check("reconciler", term)
        await asyncio.sleep(0.1)
        return len(self.paid)


STORE = web.AppKey("STORE", InvoiceStore)
routes = web.RouteTableDef()


# No leading zeros: one spelling per invoice, so one lock name per invoice (match_info
# holds the path's text, and "042" and "42" would be two names).
@routes.post("/invoices/{invoice_id:[1-9][0-9]*}/pay")
@locked("invoice:{invoice_id}", ttl=10, timeout=2)
async def pay(request: web.Request) -> web.Response:
    """Pay the invoice once: concurrent requests for it run one at a time."""
    invoice_id = int(request.match_info["invoice_id"])
    lease = request[LEASE]
    slow = float(request.query.get("slow", "1"))
    try:
        paid_now = await request.app[STORE].pay(invoice_id, lease.fence, slow)
    except StaleFenceError as exc:
        raise web.HTTPConflict(text=str(exc)) from exc
    return web.json_response(
        {"invoice": invoice_id, "paid": True, "already_paid": not paid_now, "fence": lease.fence}
    )


@routes.get("/invoices/{invoice_id:[1-9][0-9]*}")
async def invoice(request: web.Request) -> web.Response:
    """Whether the invoice is paid, and under which fence."""
    invoice_id = int(request.match_info["invoice_id"])
    paid = request.app[STORE].paid
    return web.json_response(
        {"invoice": invoice_id, "paid": invoice_id in paid, "fence": paid.get(invoice_id)}
    )


@routes.get("/leader")
async def leader(request: web.Request) -> web.Response:
    """Which replica leads the reconciler now."""
    current = await request.app[COORDINATOR].election("reconciler").leader()
    return web.json_response(
        {"leader": current, "this_instance": IDENTITY, "leading": current == IDENTITY}
    )


@routes.get("/health")
async def health(request: web.Request) -> web.Response:
    """Each leader task's state; 503 once one has stopped (only with on_error="stop")."""
    states = leader_status(request)
    body = {name: status.as_dict() for name, status in states.items()}
    healthy = all(status.running for status in states.values())
    return web.json_response(body, status=200 if healthy else 503)


def make_app() -> web.Application:
    """The application: routes, the coordinator's lifetime and the leader-only job."""
    app = web.Application()
    store = InvoiceStore()
    app[STORE] = store
    app.add_routes(routes)
    setup(app, URL, identity=IDENTITY)

    async def reconcile(term: Term) -> None:
        """Runs in one replica at a time; cancelled on leadership loss or at cleanup."""
        logger.warning("%s leads the reconciler (term %d)", IDENTITY, term.fence)
        while True:
            count = await store.reconcile(term.fence)
            logger.warning("term %d: reconciled %d invoice(s)", term.fence, count)
            await asyncio.sleep(5)

    leader_task(app, "reconciler", reconcile, ttl=10, identity=IDENTITY)
    return app


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    web.run_app(make_app(), host="127.0.0.1", port=PORT)
