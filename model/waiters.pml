/*
 * The waiter queue and wake-ups on one Redis node.
 *
 * Code modelled (see README "Why it is safe"):
 *   asynclock/backends/redis/scripts.py  ACQUIRE (queued: join, keeping one's place),
 *       ACQUIRE_FAIR (refused while an earlier live waiter is queued), RELEASE (DEL,
 *       then hand_on/wake_next: the oldest waiter whose place has not lapsed),
 *       DEQUEUE (a waiter that gives up leaves and passes the wake-up on), next_waiter
 *   asynclock/_lock.py  Lock._wait / _wait_loop (subscribe first, then try; sleep until
 *       woken, the holder's TTL or the recheck step), asynclock/_wakeup.py WakeSlot.wait
 *   asynclock/backends/redis/pubsub.py  Waiter (subscribe to the client's inbox; dequeue on
 *       giving up)
 *
 * Process 1 holds the lock at the start; waiters 2 .. W+1 each want it once. A waiter
 * may give up (timeout, cancel) or die (its place stays until it lapses). Pub/sub
 * delivery and a woken waiter's attempt take less than a tick; a waiter's timer fires
 * on time.
 *
 * Properties (-D): P_WAKE no live waiter sleeps while the lock is free (0 ticks; with a
 * dead waiter around, at most STAY + RECHECK ticks: the recheck bound); P_ORDER (with
 * FAIR) the lock is granted in arrival order among live waiters.
 * Mutants (-D): M_WAKE_EARLY, M_SUB_AFTER, M_DEQUEUE_NO_PASS, M_NO_LAPSE, M_BARGE,
 *   M_REJOIN_BACK, M_DEQUEUE_NO_HEAD (DEQUEUE does not wake the new first waiter)
 */

#ifndef W
#define W 2             /* waiters */
#endif
#define P (W + 2)       /* ids 0 (none), 1 holder, 2 .. W+1 waiters */
#ifndef TMAX
#define TMAX 10
#endif
#ifndef FAIR
#define FAIR 0
#endif
#ifndef DEADMAX
#define DEADMAX 1       /* waiters that die */
#endif
#ifndef GIVEUPS
#define GIVEUPS 1       /* waiters that give up */
#endif
#define TTL 3
#ifndef RECHECK
#define RECHECK 3       /* retry.maximum: the longest sleep between attempts */
#endif
#define STAY (RECHECK + 1) /* a place lapses this long after the last attempt (RECHECK + margin) */

mtype = { SUB, TRY, SLEEP, HOLD, GONE, DEAD };

byte now = 0;
byte key_tok = 1;       /* the holder (0: free) */
byte key_exp = TTL;
bool inq[P];
byte score[P];          /* place in line (arrival order) */
byte due[P];            /* when the place lapses */
byte seq = 0;
bool subscribed[P];
bool woken[P];          /* WakeSlot.woken */
mtype st[P];
byte until[P];
byte arrived[P];        /* ghost: order of first arrival in the line */
byte fa[P];             /* ghost: ticks asleep while the lock was free */
byte dead = 0;
byte giveups = 0;
bool releasing = false; /* M_WAKE_EARLY: a release that woke before deleting */

#define FREE (key_tok == 0 || key_exp <= now)
#define LIVE_PLACE(v) (inq[v] && due[v] > now)

/* next_waiter: the oldest waiter whose place has not lapsed, dropping lapsed ones */
inline next_waiter(t) {
    t = 0;
    do
    :: true ->
        b = 0;
        for (v : 2 .. P - 1) {
            if
            :: inq[v] && (b == 0 || score[v] < score[b]) -> b = v
            :: else -> skip
            fi
        }
        if
        :: b == 0 -> break
#ifdef M_NO_LAPSE
        :: b != 0 -> t = b; break
#else
        :: b != 0 && due[b] > now -> t = b; break
        :: b != 0 && due[b] <= now -> inq[b] = false; due[b] = 0; score[b] = 0
#endif
        fi
    od;
    b = 0; v = 0
}

/* wake_next: PUBLISH to the target's inbox; heard only while it is subscribed */
inline wake_next() {
    next_waiter(tw);
    if
    :: tw != 0 && subscribed[tw] -> woken[tw] = true
    :: else -> skip
    fi;
    tw = 0
}

inline leave(w) {
    inq[w] = false; due[w] = 0; score[w] = 0
}

inline join(w) {
#ifdef M_REJOIN_BACK
    seq++; score[w] = seq;
#else
    if
    :: !inq[w] -> seq++; score[w] = seq
    :: else -> skip
    fi;
#endif
    inq[w] = true; due[w] = now + STAY;
    if
    :: arrived[w] == 0 -> arrived[w] = score[w]
    :: else -> skip
    fi
}

inline check_order(w) {
#if FAIR && defined(P_ORDER)
    for (v2 : 2 .. P - 1) {
        assert(!(v2 != w && (st[v2] == TRY || st[v2] == SLEEP) && arrived[v2] != 0
                 && (arrived[w] == 0 || arrived[v2] < arrived[w])))
    }
    v2 = 0;
#endif
    skip
}

/* RELEASE: compare-and-delete, then wake the oldest live waiter */
inline release(w) {
    if
    :: key_tok == w && key_exp > now ->
#ifdef M_WAKE_EARLY
        wake_next(); releasing = true
#else
        key_tok = 0; key_exp = 0; wake_next()
#endif
    :: else -> skip
    fi
}

proctype holder() {
    byte tw, b, v;
    /* releases, or crashes and lets the key expire */
    if
    :: atomic { release(1) }
#ifdef M_WAKE_EARLY
        atomic { if :: releasing -> key_tok = 0; key_exp = 0; releasing = false :: else -> skip fi }
#endif
    :: skip
    fi
}

proctype waiter(byte w) {
    byte tw, v2, t, left, b, v;
#ifdef M_SUB_AFTER
    st[w] = TRY;                                     /* try first, subscribe after */
#else
    atomic { subscribed[w] = true; st[w] = TRY }    /* subscribe first, then try */
#endif
end:
    do
    :: atomic { st[w] == TRY ->
        /* the acquire script (a caller that waits joins the queue in it) */
#if FAIR
        next_waiter(t);
#ifdef M_BARGE
        t = 0;
#endif
        if
        :: (t == 0 || t == w) && FREE ->
#else
        if
        :: FREE ->
#endif
            check_order(w);
            key_tok = w; key_exp = now + TTL; leave(w); st[w] = HOLD; subscribed[w] = false
        :: else ->
            join(w);
            /* sleep until woken, or the recheck step passes; only the first live
               waiter is told the holder's remaining TTL (ACQUIRE: "only the first
               waiter comes back when the lease ends"; the others get 0); fair, a lock
               that is free but promised to the first waiter: until its place lapses */
            left = RECHECK;
#if FAIR
            if
            :: !FREE && (t == 0 || t == w) && key_exp - now < left -> left = key_exp - now
            :: FREE && t != 0 && due[t] > now && due[t] - now < left -> left = due[t] - now
            :: else -> skip
            fi;
#else
            next_waiter(t);
            if
            :: !FREE && t == w && key_exp - now < left -> left = key_exp - now
            :: else -> skip
            fi;
#endif
            until[w] = now + left; st[w] = SLEEP
#ifdef M_SUB_AFTER
            ; if
            :: !subscribed[w] -> st[w] = SUB
            :: else -> skip
            fi
#endif
        fi;
        t = 0; left = 0 }
#ifdef M_SUB_AFTER
    :: atomic { st[w] == SUB -> subscribed[w] = true; st[w] = SLEEP }
#endif
    :: atomic { st[w] == SLEEP && (woken[w] || now >= until[w]) ->
        woken[w] = false; until[w] = 0; st[w] = TRY }
    /* gives up (timeout, cancel): unsubscribes and leaves the queue; DEQUEUE passes the
       wake-up on when the lock is free, and wakes the new first waiter when the first
       one leaves a held lock (it sleeps on its recheck step, not the holder's TTL) */
    :: atomic { (st[w] == SLEEP || st[w] == TRY) && giveups < GIVEUPS ->
        giveups++; st[w] = GONE; subscribed[w] = false; woken[w] = false; until[w] = 0;
        if
        :: inq[w] ->
            /* the head of the queue (ZRANGE 0 0: lapsed or not) before leaving */
            t = 0;
            for (v : 2 .. P - 1) {
                if
                :: inq[v] && (t == 0 || score[v] < score[t]) -> t = v
                :: else -> skip
                fi
            }
            v = 0;
            leave(w);
#ifndef M_DEQUEUE_NO_PASS
            if
            :: FREE -> wake_next()
#ifndef M_DEQUEUE_NO_HEAD
            :: !FREE && t == w -> wake_next()
#endif
            :: else -> skip
            fi;
#endif
            t = 0
        :: else -> skip
        fi }
    /* dies: its place stays in the queue until it lapses */
    :: atomic { st[w] == SLEEP && dead < DEADMAX ->
        dead++; st[w] = DEAD; subscribed[w] = false; woken[w] = false; until[w] = 0 }
    /* holds, then releases */
    :: atomic { st[w] == HOLD -> release(w); st[w] = GONE }
#ifdef M_WAKE_EARLY
        atomic { if :: releasing -> key_tok = 0; key_exp = 0; releasing = false :: else -> skip fi }
#endif
    od
}

/* nothing due for waiter v: not subscribing or trying, no wake-up or timer pending */
#define QUIET(v) (v >= P || (st[v] != SUB && st[v] != TRY && \
                  !(st[v] == SLEEP && (woken[v] || until[v] <= now))))

/* the clock: a tick only once nothing is due (delivery, an attempt, a timer) */
active proctype clock() {
    byte v;
end:
    do
    :: atomic { now < TMAX && !releasing && QUIET(2) && QUIET(3) && QUIET(4) && QUIET(5) &&
        QUIET(6) ->
        for (v : 2 .. P - 1) {
            if
            :: st[v] == SLEEP && FREE -> fa[v]++
            :: else -> fa[v] = 0
            fi;
#ifdef P_WAKE
            assert(fa[v] <= (dead > 0 -> STAY + RECHECK : 0));
#endif
            skip
        }
        v = 0;
        now++;
        if
        :: key_tok != 0 && key_exp <= now -> key_tok = 0; key_exp = 0
        :: else -> skip
        fi }
    od
}

init {
    byte k;
    atomic {
        assert(W >= 1 && W <= 5);   /* the clock's QUIET(2) .. QUIET(6) */
        for (k : 2 .. P - 1) {
            st[k] = SUB
        }
        run holder();
        for (k : 2 .. P - 1) {
            run waiter(k)
        }
    }
}
