/*
 * Redlock over N independent nodes: fan-out, per-node timeouts, majority, validity
 * ttl - elapsed - drift, fence = max over the majority (each node's next_fence is
 * max(counter + 1, time)), written back (RAISE_FENCE) and granted only once a majority
 * stores it, release everywhere, a node restarting empty with or without a restart delay.
 * Every round writes a fresh token; a lease's release carries the token of the round
 * that was granted. A release (a refused round's give-back, a lease's release) may land
 * at any later time, or never: the courier delivers it, compare-and-delete (5 nodes: a
 * client's releases land together). ACQUIRE grants a free node, and again a node whose
 * key already holds the requesting token (a round sends one request per node, so with
 * fresh tokens only M_SAME_TOKEN reaches that path).
 *
 * Code modelled (see README "Why it is safe"):
 *   asynclock/backends/redlock.py  RedlockBackend._acquire_once, release, _Tally/_each
 *   asynclock/backends/redis/scripts.py  ACQUIRE (with ARGV[4] floor, already ours), RAISE_FENCE,
 *                                         RELEASE
 *
 * Properties (-D): P_EXCL never two locally valid holders; P_FENCE fences of successive
 * grants strictly increase; P_WRITES accepted writes of two holders never interleave.
 * Options: NODES (3 or 5), RESTART (restarts that lose a node's data), DELAY (1: a
 * restarted node stays out for one TTL), FLOOR (1: fences also take the nodes' time,
 * one clock that never steps back; 0: counters only, clocks not trusted).
 * Mutants (-D): M_NO_WRITEBACK, M_NO_MAJORITY (grant on fewer nodes), M_NO_ELAPSED
 * (validity not reduced by the time the fan-out took), M_WRITEBACK_UNCONFIRMED (a
 * write-back request counts as stored without its confirmation), M_SAME_TOKEN (every
 * round of a client writes one token: a late release of an earlier round deletes a
 * later round's grant).
 */

#ifndef NODES
#define NODES 3
#endif
#define Q (NODES / 2 + 1)
#define NC 2            /* clients (the monitor, FORGET and the courier name both) */
#ifndef ROUNDS
#define ROUNDS 1        /* acquire rounds per client */
#endif
#ifndef TMAX
#define TMAX 4
#endif
#ifndef RESTART
#define RESTART 0
#endif
#ifndef DELAY
#define DELAY 1
#endif
#ifndef ONE_STEP
#define ONE_STEP 0
#endif
#ifndef FLOOR
#define FLOOR 1
#endif
#define TTL 2
#define DRIFT 0

byte now = 0;
byte us = 0;            /* the nodes' time (µs), one clock, strictly increasing */
byte tok[NODES];        /* 0: no key */
byte exp[NODES];
byte ctr[NODES];        /* fence counter */
byte down[NODES];       /* a restarted node answers nothing before this time */
byte restarts = 0;

byte res_fence = 0;     /* fenced resource */
byte res_tok = 0;
byte last_fence = 0;    /* ghost */

bool held[NC];
byte vu[NC];
byte fence[NC];
byte mytok[NC];

#define LIVE(n, t) (tok[n] == (t) && exp[n] > now)
#define UP(n) (now >= down[n])

/* Releases in flight: rel[c * NODES + n] is the token a release of client c to node n
   deletes when it lands (0: none). At most one per client and node. */
byte rel[NC * NODES];

/* Fresh tokens: once its round is over, a token is never written again, so a release
   in flight to a node that does not hold its token (any more) deletes nothing wherever
   it lands: it is dropped at once (one state however it ends). Only a release to a node
   holding its token is in flight, so a node has at most one (tokens of two clients
   differ), and a client never has two to one node. With M_SAME_TOKEN a later round
   writes the token again: every release stays in flight until it lands. */
#ifdef M_SAME_TOKEN
#define KEEP(n, t) true
#define FORGET(n) skip
#else
#define KEEP(n, t) LIVE(n, t)
#define FORGET(n) rel[n] = 0; rel[NODES + n] = 0
#endif

/* a release lands on node n: RELEASE is compare-and-delete; a node that is down answers
   nothing (the request is lost) */
inline land(c, n) {
    if
    :: UP(n) && LIVE(n, rel[(c) * NODES + (n)]) ->
        printf("MSC: t=%d client %d's release of token %d lands on node %d\n", now, c, tok[n], n);
        tok[n] = 0; exp[n] = 0
    :: else -> skip
    fi;
    rel[(c) * NODES + (n)] = 0
}

/* release on every node: each request is in flight until the courier delivers it, at
   any later time, or never (lost: the key then lapses with its TTL). A release still in
   flight from an earlier round to the same node (M_SAME_TOKEN only) lands now or is
   lost. */
inline release_all(i) {
    for (n : 0 .. NODES - 1) {
        if
        :: KEEP(n, mytok[i]) ->
            if
            :: rel[i * NODES + n] != 0 ->
                if
                :: land(i, n)
                :: rel[i * NODES + n] = 0
                fi
            :: else -> skip
            fi;
            rel[i * NODES + n] = mytok[i]
        :: else -> skip
        fi
    }
    n = 0
}

proctype client(byte i) {
    byte k, n, r, start, granted, stored, big;
    byte reply[NODES];
end:
    do
    :: atomic { !held[i] && r < ROUNDS -> r++;
#ifdef M_SAME_TOKEN
        /* the old code: every round of one acquire writes the token of its first round
           (the next acquire, after a lease, has a new one) */
        if
        :: mytok[i] == 0 -> mytok[i] = i * ROUNDS + r
        :: else -> skip
        fi;
#else
        mytok[i] = i * ROUNDS + r;     /* a fresh token for every round */
#endif
        start = now; k = 0 }
        /* fan-out: every node, each bounded by the node timeout; a node may not be
           reached, or run the script and answer too late (its reply is then lost).
           ONE_STEP: the whole round at one instant (used for 5 nodes: state space) */
#if ONE_STEP
        atomic {
#endif
        do
        :: atomic { k < NODES ->
            n = (k + i) % NODES;
            if
            :: UP(n) && !(tok[n] != 0 && exp[n] > now) ->
                tok[n] = mytok[i]; exp[n] = now + TTL;
                us++;
#if FLOOR
                big = (ctr[n] + 1 > us -> ctr[n] + 1 : us);
#else
                big = ctr[n] + 1;
#endif
                ctr[n] = big;
                printf("MSC: t=%d node %d grants client %d, fence %d\n", now, n, i, big)
            :: UP(n) && LIVE(n, mytok[i]) ->
                /* already ours (a key with this token): granted again, renewed to a full
                   ttl from now, with the fence the node stores (a node that lost its
                   counter lost the key too) */
                exp[n] = now + TTL; big = ctr[n];
                printf("MSC: t=%d node %d grants client %d again (already ours), fence %d\n", now, n, i, big)
            :: true -> skip             /* refused, lost, or the node is down */
            fi;
            if
            :: big > 0 ->
                if
                :: reply[n] = big       /* answered in time */
#if NODES <= 3
                :: skip                 /* answered too late: counted as failed */
#endif
                fi
            :: else -> skip
            fi;
            big = 0; n = 0; k++ }
        :: else -> break
        od;
        /* a majority granted: the fence is the largest reply, written back (RAISE_FENCE,
           only where still held) to the nodes behind; granted once a majority stores it */
        atomic {
            k = 0;
            for (n : 0 .. NODES - 1) {
                if
                :: reply[n] > 0 -> granted++
                :: else -> skip
                fi;
                if
                :: reply[n] > big -> big = reply[n]
                :: else -> skip
                fi
            }
            for (n : 0 .. NODES - 1) {
                if
                :: reply[n] > 0 && reply[n] == big -> stored++
                :: else -> skip
                fi
            }
            n = 0
        }
#ifdef M_NO_WRITEBACK
        stored = granted;
#else
        if
        :: atomic { granted >= Q && stored < Q ->
            for (n : 0 .. NODES - 1) {
                if
                :: reply[n] > 0 && reply[n] < big ->
                    if
                    :: UP(n) && LIVE(n, mytok[i]) ->
                        if
                        :: big > ctr[n] -> ctr[n] = big
                        :: else -> skip
                        fi;
                        if
                        :: stored++     /* confirmed */
                        :: skip         /* its confirmation is lost */
                        fi
#if NODES <= 3
                    :: true ->          /* the request is lost (or the node refuses) */
#ifdef M_WRITEBACK_UNCONFIRMED
                        stored++        /* counted as stored without a confirmation */
#else
                        skip
#endif
#endif
                    :: else -> skip     /* refused: the node is down or lost the key */
                    fi
                :: else -> skip
                fi
            }
            n = 0 }
        :: else -> skip
        fi;
#endif
        atomic {
            if
#ifdef M_NO_MAJORITY
            :: granted >= Q - 1 && stored >= Q - 1 &&
#else
            :: granted >= Q && stored >= Q &&
#endif
#ifdef M_NO_ELAPSED
               TTL - DRIFT > 0 ->
                held[i] = true; vu[i] = now + TTL - DRIFT; fence[i] = big;
#else
               TTL - (now - start) - DRIFT > 0 ->
                held[i] = true; vu[i] = start + TTL - DRIFT; fence[i] = big;
#endif
                printf("MSC: t=%d client %d holds (fence %d), valid until t=%d\n", now, i, big, vu[i]);
#ifdef P_FENCE
                assert(big > last_fence);
#endif
                last_fence = big
            :: else ->
                /* no majority: give back everywhere at once */
                printf("MSC: t=%d client %d refused, gives back token %d\n", now, i, mytok[i]);
                release_all(i)
            fi;
            for (n : 0 .. NODES - 1) { reply[n] = 0 }
            n = 0; big = 0; stored = 0; granted = 0; start = 0
        }
#if ONE_STEP
        }
#endif

#ifdef P_WRITES
    /* the holder writes with its fence (also after its validity ran out: a pause) */
    :: atomic { held[i] && fence[i] >= res_fence ->
        assert(fence[i] > res_fence || res_tok == mytok[i]);
        printf("MSC: t=%d client %d writes with fence %d: accepted\n", now, i, fence[i]);
        res_fence = fence[i]; res_tok = mytok[i] }
#endif

    /* release on every node, including those that failed earlier */
    :: atomic { held[i] -> held[i] = false; vu[i] = 0; fence[i] = 0;
        printf("MSC: t=%d client %d releases token %d\n", now, i, mytok[i]);
        release_all(i);
#ifdef M_SAME_TOKEN
        mytok[i] = 0
#else
        skip
#endif
        }
    od
}

/* the clock; a node restarts empty, and with DELAY stays out for one TTL */
active proctype world() {
    byte n;
end:
    do
    :: atomic { now < TMAX -> now++;
        /* expired keys are gone (one state, however they expired) */
        for (n : 0 .. NODES - 1) {
            if
            :: tok[n] != 0 && exp[n] <= now -> tok[n] = 0; exp[n] = 0; FORGET(n)
            :: else -> skip
            fi;
            if
            :: down[n] <= now -> down[n] = 0
            :: else -> skip
            fi
        }
        n = 0 }
    :: atomic { restarts < RESTART ->
        restarts++;
        if
        :: n = 0
        :: n = 1
        fi;
        tok[n] = 0; exp[n] = 0; ctr[n] = 0; FORGET(n);
        printf("MSC: t=%d node %d restarts empty (restart delay: %d)\n", now, n, DELAY);
#if DELAY
        down[n] = now + TTL;
#endif
        n = 0 }
    od
}

/* delivers releases in flight, each at any time after it was sent (possibly after the
   same client's next round, on another connection); one never delivered is lost */
#define DELIVER(c, n) :: atomic { rel[(c) * NODES + (n)] != 0 -> land(c, n) }
#define ANY(c) (rel[(c) * NODES] + rel[(c) * NODES + 1] + rel[(c) * NODES + 2] + \
                rel[(c) * NODES + 3] + rel[(c) * NODES + 4] > 0)
active proctype courier() {
    byte n;
end:
    do
#if NODES > 3
    /* 5 nodes (state space): a client's releases land on every node at once */
    :: atomic { ANY(0) -> for (n : 0 .. NODES - 1) { land(0, n) } n = 0 }
    :: atomic { ANY(1) -> for (n : 0 .. NODES - 1) { land(1, n) } n = 0 }
#else
    DELIVER(0, 0)
    DELIVER(0, 1)
    DELIVER(0, 2)
    DELIVER(1, 0)
    DELIVER(1, 1)
    DELIVER(1, 2)
#endif
    od
}

#ifdef P_EXCL
bool never_two_holders = false;     /* names the assertion in pan's report */
active proctype monitor() {
end:
    atomic {
        (held[0] && now < vu[0] && held[1] && now < vu[1]) -> assert(never_two_holders)
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
