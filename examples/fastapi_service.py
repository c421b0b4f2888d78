"""A small FastAPI service on asynclock: pay an invoice once, whatever the concurrency.

- ``POST /invoices/{invoice_id}/pay`` holds the lock ``invoice:{invoice_id}`` for the
  request and hands the lease's fence to the store, which refuses a write carrying a
  smaller fence than one it has already seen (a holder whose lease ran out). A second
  request for the same invoice waits for the first (up to 2 s), then finds it paid; one
  that waits longer is answered ``423 Locked`` with ``Retry-After``.
- A leader-only job (one replica at a time among all that share the lock server)
  reconciles the invoices every few seconds, fenced by its term.

Run it (Python 3.11+, from a clone, with ``pip install -e '.[fastapi]' uvicorn``)::

    python examples/fastapi_service.py

It serves on http://127.0.0.1:8000 with the in-process ``memory://`` backend, which
needs no server. To see two replicas share locks and elect one leader, point both at a
Redis or Valkey server::

    ASYNCLOCK_URL=redis://127.0.0.1:6379/0 PORT=8000 python examples/fastapi_service.py
    ASYNCLOCK_URL=redis://127.0.0.1:6379/0 PORT=8001 python examples/fastapi_service.py

Then::

    curl -X POST localhost:8000/invoices/42/pay & curl -X POST localhost:8000/invoices/42/pay
    # one pays (about 1 s), the other waits for it and answers "already paid"
    curl localhost:8000/invoices/42
    curl localhost:8000/leader    # which replica runs the reconciler
    curl localhost:8000/health    # the reconciler task's state on this replica
    for i in 1 2 3; do curl -si -X POST 'localhost:8000/invoices/7/pay?slow=3' & done
    # one pays (3 s); the other two give up after 2 s: 423 Locked, Retry-After: <seconds>

Each replica keeps its own fake store: in a real service the store (a database) is
shared, and it is the one that checks the fences.
"""

import asyncio
import logging
import os
from typing import Annotated

import uvicorn
from fastapi import Depends, FastAPI, Request
from fastapi.responses import JSONResponse

from asynclock import Coordinator, Lease, Term
from asynclock.integrations.fastapi import FastAPILocks

URL = os.environ.get("ASYNCLOCK_URL", "memory://")
PORT = int(os.environ.get("PORT", "8000"))
IDENTITY = os.environ.get("INSTANCE", f"api-{PORT}")

logger = logging.getLogger("fastapi_service")


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


store = InvoiceStore()
locks = FastAPILocks(URL, identity=IDENTITY)
app = FastAPI(title="invoices", lifespan=locks.lifespan)


@app.exception_handler(StaleFenceError)
async def stale_fence(request: Request, exc: StaleFenceError) -> JSONResponse:
    return JSONResponse({"detail": str(exc)}, status_code=409)


# ``{invoice_id:int}`` makes /invoices/042 and /invoices/42 the same lock name.
@app.post("/invoices/{invoice_id:int}/pay")
async def pay(
    invoice_id: int,
    lease: Annotated[Lease, locks.lock("invoice:{invoice_id}", ttl=10, timeout=2)],
    slow: float = 1.0,
) -> dict[str, object]:
    """Pay the invoice once: concurrent requests for it run one at a time."""
    paid_now = await store.pay(invoice_id, lease.fence, slow)
    return {"invoice": invoice_id, "paid": True, "already_paid": not paid_now, "fence": lease.fence}


@app.get("/invoices/{invoice_id:int}")
async def invoice(invoice_id: int) -> dict[str, object]:
    """Whether the invoice is paid, and under which fence."""
    return {
        "invoice": invoice_id,
        "paid": invoice_id in store.paid,
        "fence": store.paid.get(invoice_id),
    }


@app.get("/leader")
async def leader(
    coord: Annotated[Coordinator, Depends(locks.get_coordinator)],
) -> dict[str, object]:
    """Which replica leads the reconciler now."""
    current = await coord.election("reconciler").leader()
    return {"leader": current, "this_instance": IDENTITY, "leading": current == IDENTITY}


@app.get("/health")
async def health() -> JSONResponse:
    """Each leader task's state; 503 once one has stopped (only with on_error="stop")."""
    states = locks.leader_status()
    body = {name: status.as_dict() for name, status in states.items()}
    healthy = all(status.running for status in states.values())
    return JSONResponse(body, status_code=200 if healthy else 503)


async def reconcile(term: Term) -> None:
    """Runs in one replica at a time; cancelled when leadership is lost or at shutdown."""
    logger.warning("%s leads the reconciler (term %d)", IDENTITY, term.fence)
    while True:
        count = await store.reconcile(term.fence)
        logger.warning("term %d: reconciled %d invoice(s)", term.fence, count)
        await asyncio.sleep(5)


locks.leader_task("reconciler", reconcile, ttl=10, identity=IDENTITY)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(message)s")
    uvicorn.run(app, host="127.0.0.1", port=PORT)
