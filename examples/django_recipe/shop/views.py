"""Paying an invoice under its lock: one payment of an invoice at a time, everywhere."""

from django.http import HttpRequest, HttpResponse, HttpResponseNotAllowed, JsonResponse

import asynclock.sync

from .locks import coordinator

#: Sent with 423 and 503: when to try again, in seconds.
RETRY = {"Retry-After": "1"}


def charge(pk: int, *, fence: int) -> None:
    """The work the lock protects. Pass the fence to what it writes: a store that refuses
    fences older than the newest it saw stops a writer whose lease was lost."""


def pay(request: HttpRequest, pk: int) -> HttpResponse:
    """``POST /invoices/<pk>/pay``: 200 once paid; 423 when another request kept the
    invoice's lock for 5 s; 503 when the lock server is unreachable or the lease was lost."""
    if request.method != "POST":
        return HttpResponseNotAllowed(["POST"])
    try:
        with coordinator().lock(f"invoice:{pk}", ttl=30, timeout=5) as lease:
            charge(pk, fence=lease.fence)
    except asynclock.sync.LockTimeout:
        return JsonResponse({"error": "invoice is being paid"}, status=423, headers=RETRY)
    except (asynclock.sync.BackendError, asynclock.sync.LockLost):
        return JsonResponse({"error": "try again"}, status=503, headers=RETRY)
    return JsonResponse({"invoice": pk, "paid": True, "fence": lease.fence})
