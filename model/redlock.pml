/*
 * Redlock over N independent nodes: fan-out, per-node timeouts, majority, validity
 * ttl - elapsed - drift, fence = max over the majority (each node's next_fence is
 * max(counter + 1, time)), written back (RAISE_FENCE) and granted only once a majority
 * stores it, release everywhere, a node restarting empty with or without a restart delay.
 *
 * Code modelled (see README "Why it is safe"):
 *   asynclock/backends/redlock.py  RedlockBackend._acquire_once, release, _Tally/_each
 *   asynclock/backends/_scripts.py  ACQUIRE (with ARGV[4] floor), RAISE_FENCE, RELEASE
 *
 * Properties (-D): P_EXCL never two locally valid holders; P_FENCE fences of successive
 * grants strictly increase; P_WRITES accepted writes of two holders never interleave.
 * Options: NODES (3 or 5), RESTART (restarts that lose a node's data), DELAY (1: a
 * restarted node stays out for one TTL), FLOOR (1: fences also take the nodes' time,
 * one clock that never steps back; 0: counters only, clocks not trusted).
 * Mutants (-D): M_NO_WRITEBACK, M_NO_MAJORITY (grant on fewer nodes), M_NO_ELAPSED
 * (validity not reduced by the time the fan-out took), M_WRITEBACK_UNCONFIRMED (a
 * write-back request counts as stored without its confirmation).
 */

#ifndef NODES
#define NODES 3
#endif
#define Q (NODES / 2 + 1)
#ifndef NC
#define NC 2
#endif
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

/* compare-and-delete on every node at once; each request may be lost (the key then
   lapses with its TTL); a node that is down answers nothing */
inline release_all(i) {
#if NODES > 3
    /* 5 nodes (state space): the requests all arrive, or all are lost */
    if
    :: for (n : 0 .. NODES - 1) {
        if
        :: UP(n) && LIVE(n, mytok[i]) -> tok[n] = 0; exp[n] = 0
        :: else -> skip
        fi
       }
    :: skip
    fi;
#else
    for (n : 0 .. NODES - 1) {
        if
        :: UP(n) && LIVE(n, mytok[i]) -> tok[n] = 0; exp[n] = 0
        :: true -> skip
        fi
    }
#endif
    n = 0
}

proctype client(byte i) {
    byte k, n, r, start, granted, stored, big;
    byte reply[NODES];
end:
    do
    :: atomic { !held[i] && r < ROUNDS -> r++; mytok[i] = i * ROUNDS + r; start = now; k = 0 }
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
                printf("MSC: t=%d node %d grants client %d, fence %d\n", now, n, i, big);
                if
                :: reply[n] = big       /* answered in time */
#if NODES <= 3
                :: skip                 /* answered too late: counted as failed */
#endif
                fi
            :: true -> skip             /* refused, lost, or the node is down */
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
    :: atomic { held[i] -> held[i] = false; vu[i] = 0; fence[i] = 0; release_all(i) }
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
            :: tok[n] != 0 && exp[n] <= now -> tok[n] = 0; exp[n] = 0
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
        tok[n] = 0; exp[n] = 0; ctr[n] = 0;
        printf("MSC: t=%d node %d restarts empty (restart delay: %d)\n", now, n, DELAY);
#if DELAY
        down[n] = now + TTL;
#endif
        n = 0 }
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
