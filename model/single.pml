/*
 * One Redis node: leases, renewal, extend, release, the fence and a fenced resource.
 *
 * Code modelled (see README "Why it is safe"):
 *   server scripts  asynclock/backends/redis/scripts.py  ACQUIRE (SET NX PX + next_fence),
 *                   EXTEND / EXTEND_MANY (compare-and-PEXPIRE), RELEASE (compare-and-DEL)
 *   client          asynclock/_lease.py Lease.extend, unconfirmed, confirmed, _release_once
 *                   asynclock/_watchdog.py  Watchdog._send / _renew (ttl captured at send)
 *
 * Time is discrete (ticks). A lease's local validity is start + ttl - DRIFT, start taken
 * before its request leaves. One extend request per lease is in flight at a time
 * (Lease._renewing); a request whose reply is lost may still run on the server later
 * (a "stray": sent on a connection that broke, held by a proxy).
 *
 * Properties (one per run, chosen with -D):
 *   P_WRITES  accepted writes of two holders never interleave (fenced resource)
 *   P_FENCE   fences of successive grants strictly increase (also across a restart)
 *   P_VALID   a client never believes validity past the server's expiry for it
 *   P_STALE   a release or extend succeeds only on the key its client acquired (ghost)
 * Mutants (-D): M_NO_FLOOR, M_WRONG_TTL, M_NO_LOWER, M_AFTER_REPLY, M_RELEASE_NO_OWNER,
 *   M_EXTEND_NO_OWNER, M_ACQUIRE_NO_NX, M_SHARED_TOKEN, M_RELEASE_NO_ASSUME
 */

#ifndef NC
#define NC 2            /* clients */
#endif
#ifndef ACQ
#define ACQ 1           /* acquisitions per client (each with a fresh token) */
#endif
#ifndef TMAX
#define TMAX 5          /* clock range 0..TMAX */
#endif
#ifndef RESTART
#define RESTART 0       /* server restarts that lose every key */
#endif
#ifndef RENEW
#define RENEW 1         /* client 0 renews and extends (Watchdog, Lease.extend) */
#endif
#define LONG 2          /* the lease's ttl (ticks) */
#define SHORT 1         /* a shorter ttl an extend() may ask for */
#define DRIFT 0
#define INF 255

mtype = { IDLE, ASKING, HELD, RELEASING };
mtype = { NONE, SENT, ANSWERED };

/* server */
byte now = 0;
byte key_tok = 0;       /* 0: no key */
byte key_exp = 0;
byte ctr = 0;           /* fence counter key */
byte us = 0;            /* server TIME in µs: strictly increasing, never steps back */
byte restarts = 0;

/* fenced resource */
byte res_fence = 0;
byte res_tok = 0;

/* ghost */
byte last_fence = 0;
byte key_who = 0;       /* the client (index + 1) whose ACQUIRE set the key */

#define LIVE(t) (key_tok == (t) && key_exp > now)

/* next_fence in scripts.py: max(counter + 1, server time) */
inline next_fence(f) {
    us++;
#ifdef M_NO_FLOOR
    f = ctr + 1;
#else
    f = (ctr + 1 > us -> ctr + 1 : us);
#endif
    ctr = f;
#ifdef P_FENCE
    assert(f > last_fence);
#endif
    last_fence = f
}

typedef Client {
    mtype st = IDLE;
    byte tok;
    byte n;             /* acquisitions made */
    byte fence;
    byte ttl;           /* Lease.ttl */
    byte vu;            /* Lease._valid_until */
    byte floor = INF;   /* Lease._ttl_floor */
    bool valid;         /* still believes it holds (body running) */
    bool pending;       /* its release failed: no longer renewed or extended */
    /* the one extend request in flight */
    mtype rq = NONE;
    byte rq_start;
    byte rq_ttl;
    bool rq_ext;        /* extend() (sets ttl on success) or a watchdog renewal */
    bool rq_ok;
    /* a request whose reply was lost, still on its way to the server */
    byte stray_ttl;     /* 0: none */
};
Client c[NC];

#define MIN(a, b) ((a) < (b) -> (a) : (b))

/* EXTEND script: compare-and-PEXPIRE */
inline extend_script(i, t, ok) {
#ifdef M_EXTEND_NO_OWNER
    ok = (key_tok != 0 && key_exp > now);
#else
    ok = LIVE(c[i].tok);
#endif
#ifdef P_STALE
    /* stronger than the guard: the key it extends is the one this client acquired */
    assert(!ok || key_who == i + 1);
#endif
    if
    :: ok -> key_exp = now + t
    :: else -> skip
    fi
}

inline forget(i) {
    c[i].pending = false; c[i].valid = false; c[i].vu = 0; c[i].ttl = 0; c[i].floor = INF
}

inline clear_rq(i) {
    c[i].rq_start = 0; c[i].rq_ttl = 0; c[i].rq_ext = false; c[i].rq_ok = false
}

proctype client(byte i) {
    byte f, t, sent;
    bool ok, ran;
end:
    do
    /* acquire: start taken before the request leaves; the script runs later */
    :: atomic { c[i].st == IDLE && c[i].n < ACQ ->
#ifdef M_SHARED_TOKEN
        c[i].n++; c[i].tok = c[i].n; c[i].st = ASKING;   /* every client the same tokens */
#else
        c[i].n++; c[i].tok = i * ACQ + c[i].n; c[i].st = ASKING;
#endif
        c[i].rq_start = now; c[i].ttl = LONG; c[i].floor = INF; c[i].stray_ttl = 0 }
        /* ... the ACQUIRE script, atomically on the server, some ticks later */
        atomic {
#ifdef M_ACQUIRE_NO_NX
            if
            :: true ->
#else
            if
            :: !(key_tok != 0 && key_exp > now) ->
#endif
                key_tok = c[i].tok; key_exp = now + LONG; key_who = i + 1;
                next_fence(f); c[i].fence = f; ok = true
            :: else -> ok = false
            fi
        }
        /* ... and the reply comes back later still */
        atomic {
            if
            :: ok ->
#ifdef M_AFTER_REPLY
                c[i].rq_start = now;
#endif
                c[i].vu = c[i].rq_start + LONG - DRIFT;
                c[i].st = HELD; c[i].valid = (now < c[i].vu)
            :: else -> c[i].st = IDLE
            fi;
            c[i].rq = NONE; c[i].rq_start = 0; ok = false; f = 0
        }

#ifdef P_WRITES
    /* the body writes to the fenced resource: accepted unless its fence is smaller
       than one seen (a paused holder may write long after its validity ended) */
    :: atomic { c[i].st == HELD && c[i].fence >= res_fence ->
#ifdef P_WRITES
        assert(c[i].fence > res_fence || res_tok == c[i].tok);
#endif
        res_fence = c[i].fence; res_tok = c[i].tok }
#endif

    /* the watchdog sees the local validity run out: lost */
    :: atomic { c[i].st == HELD && c[i].valid && now >= c[i].vu -> forget(i) }

#if RENEW
    /* a renewal (Watchdog._send): asks for the ttl the lease has now */
    :: atomic { i == 0 && c[i].st == HELD && c[i].valid && !c[i].pending && c[i].rq == NONE ->
        c[i].rq = SENT; c[i].rq_start = now; c[i].rq_ttl = c[i].ttl; c[i].rq_ext = false }

    /* extend(SHORT) / extend(LONG) (Lease.extend): waits for the request in flight;
       a shorter TTL lowers the validity before the request leaves */
    :: atomic { i == 0 && c[i].st == HELD && c[i].valid && !c[i].pending && c[i].rq == NONE ->
        if
        :: t = SHORT
        :: t = LONG
        fi;
#ifndef M_NO_LOWER
        if
        :: now + t - DRIFT < c[i].vu -> c[i].vu = now + t - DRIFT
        :: else -> skip
        fi;
#endif
        c[i].rq = SENT; c[i].rq_start = now; c[i].rq_ttl = t; c[i].rq_ext = true; t = 0 }

    /* the extend request runs on the server */
    :: atomic { c[i].rq == SENT ->
        extend_script(i, c[i].rq_ttl, ok); c[i].rq_ok = ok; c[i].rq = ANSWERED; ok = false }

    /* its reply: confirmed (confirmed) or refused (lost) */
    :: atomic { c[i].rq == ANSWERED ->
        c[i].rq = NONE;
        if
        :: c[i].st == HELD && c[i].valid && c[i].rq_ok ->
#ifdef M_WRONG_TTL
            t = c[i].rq_ttl;
#else
            t = MIN(c[i].rq_ttl, c[i].floor);
#endif
#ifdef M_AFTER_REPLY
            c[i].rq_start = now;
#endif
            c[i].vu = c[i].rq_start + t - DRIFT;
            if
            :: c[i].rq_ext -> c[i].ttl = c[i].rq_ttl
            :: else -> skip
            fi;
            t = 0
        :: c[i].st == HELD && c[i].valid && !c[i].rq_ok -> forget(i)
        :: else -> skip
        fi;
        clear_rq(i) }

    /* its reply is lost (timeout, broken connection): it may have run, or may run
       later; unconfirmed: never believe longer than that request would leave the lease */
    :: atomic { c[i].rq != NONE ->
        if
        :: c[i].rq == SENT && c[i].stray_ttl == 0 -> c[i].stray_ttl = c[i].rq_ttl
        :: else -> skip
        fi;
        c[i].rq = NONE;
        if
        :: c[i].st == HELD && c[i].valid ->
            c[i].vu = MIN(c[i].vu, c[i].rq_start + c[i].rq_ttl - DRIFT);
            c[i].floor = MIN(c[i].floor, c[i].rq_ttl)
        :: else -> skip
        fi;
        clear_rq(i) }

    /* a stray request lands on the server, any time later */
    :: atomic { c[i].stray_ttl != 0 ->
        extend_script(i, c[i].stray_ttl, ok); c[i].stray_ttl = 0; ok = false }
#endif

#if RENEW
    /* release (after the body, or by a holder that paused past its lease): the request
       leaves (_release_once: sent = now); the lease keeps its validity until the reply */
    :: atomic { c[i].st == HELD && c[i].rq == NONE ->
        c[i].st = RELEASING; sent = now; ran = false }

    /* the RELEASE script runs on the server: compare-and-delete (or the request is lost:
       the reply then never comes, see below) */
    :: atomic { c[i].st == RELEASING && !ran ->
        ran = true;
#ifdef M_RELEASE_NO_OWNER
        ok = (key_tok != 0 && key_exp > now);
#else
        ok = LIVE(c[i].tok);
#endif
#ifdef P_STALE
        assert(!ok || key_who == i + 1);
#endif
        if
        :: ok -> key_tok = 0; key_exp = 0
        :: else -> skip
        fi;
        ok = false }

    /* no reply (timeout, broken connection; the script may have run or not): the lease
       stays held ("release pending"), no longer renewed or extended, with no validity
       from the moment the request left (unconfirmed(sent, 0)); a later release (the
       background clean-up) tries again */
    :: atomic { c[i].st == RELEASING ->
#ifndef M_RELEASE_NO_ASSUME
        c[i].vu = MIN(c[i].vu, sent - DRIFT);
#endif
        c[i].st = HELD; c[i].pending = true; sent = 0; ran = false }

    /* the reply (released, or not ours): the lease ends */
    :: atomic { c[i].st == RELEASING && ran ->
        forget(i); sent = 0; ran = false;
#else
    /* release (after the body, or by a holder that paused past its lease), in one step:
       without renewals (RENEW=0: the P_WRITES / P_FENCE runs) the client's validity
       plays no part, and a release that is late or lost is one that happens later or
       never (the key lapses) */
    :: atomic { c[i].st == HELD && c[i].rq == NONE ->
        forget(i);
        ok = LIVE(c[i].tok);
        if
        :: ok -> key_tok = 0; key_exp = 0
        :: else -> skip
        fi;
        ok = false;
#endif
        c[i].st = IDLE; c[i].fence = 0; c[i].tok = 0 }
    od
}

/* the clock, and a server restart that loses every key (time does not step back) */
active proctype world() {
end:
    do
    :: atomic { now < TMAX -> now++ }
    :: atomic { restarts < RESTART -> restarts++; key_tok = 0; key_exp = 0; ctr = 0; us++ }
    od
}

#ifdef P_VALID
bool valid_until_reply_or_expiry_kept = false;  /* names the assertion in pan's report */
/* invariant 1: while a client believes it holds, the server keeps its key that long */
active proctype monitor() {
    byte j;
end:
    atomic {
        !(
#if NC >= 1
          (!(c[0].st == HELD && c[0].valid && now < c[0].vu) ||
           (key_tok == c[0].tok && key_exp >= c[0].vu))
#endif
#if NC >= 2
          && (!(c[1].st == HELD && c[1].valid && now < c[1].vu) ||
           (key_tok == c[1].tok && key_exp >= c[1].vu))
#endif
#if NC >= 3
          && (!(c[2].st == HELD && c[2].valid && now < c[2].vu) ||
           (key_tok == c[2].tok && key_exp >= c[2].vu))
#endif
        ) -> assert(valid_until_reply_or_expiry_kept)
    }
}
#endif

init {
    byte k;
    atomic {
        for (k : 0 .. NC - 1) {
            run client(k)
        }
    }
}
