"""The SQL text the session backend sends: the fence step, ``lock_timeout`` settings, and
every statement of a lease, built once per server version (:class:`Statements`).

Each step of a lease is one statement, so one round trip. Inside a statement each step
is a subquery over the one before, evaluated row by row in that order (a subquery with
volatile functions in its target list is never merged into its parent, and ``OFFSET 0``
says so again): a later step runs only for the rows an earlier one granted.
"""

from __future__ import annotations

from .holders import APP_PREFIX

__all__ = (
    "HOLD_FLAG",
    "IDLE",
    "NO_FLAG",
    "RESET",
    "TAKE_FLAG",
    "TRY",
    "TRY_BEFORE_WAIT",
    "TRY_FENCE_WAIT_MS",
    "WAIT",
    "Statements",
    "fence_select",
    "lock_timeout_sql",
)

# Session settings a connection carries while asynclock uses it, restored when it goes
# back to the pool. idle_session_timeout is also reset after every lease.
IDLE = "idle_session_timeout"
# Everything a lease may change on its session; RESET when a connection leaves us (with
# transaction_timeout on PostgreSQL >= 17: Statements.reset).
RESET = (
    "RESET application_name; RESET tcp_keepalives_idle; RESET tcp_keepalives_interval; "
    "RESET idle_session_timeout; RESET client_connection_check_interval; "
    "RESET statement_timeout"
)
# Waits set statement_timeout to 0 (no limit) for the session before they wait: a role or
# database statement_timeout would end a wait in the queue with an error, and the server
# arms statement_timeout when a statement starts, so it must be set by the statement
# before. The wait itself is bounded by its lock_timeout and the caller's deadline; our
# other statements are short. RESET when the connection goes back to the pool.
_UNBOUNDED = "set_config('statement_timeout', '0', false)"
# How often a server backend waiting in the lock queue checks that its client is still
# there (PostgreSQL >= 14): a killed waiter leaves the queue within this.
_CHECK_INTERVAL_MS = 1000
# Lock acquire statements: try once; try before a wait; wait in the queue.
TRY, TRY_BEFORE_WAIT, WAIT = "try", "try-before-wait", "wait"
# Permit scans: not waiting; the first scan of a wait (takes the waiting flag); later
# scans of a wait (the flag is held).
NO_FLAG, TAKE_FLAG, HOLD_FLAG = 0, 1, 2


def _micros(timestamp: str) -> str:
    """SQL for ``timestamp`` (a UTC ``timestamp without time zone``) in whole µs since
    the Unix epoch, exact on every version: the whole seconds of ``date_part('epoch')`` of
    the timestamp cut to the second (an integral double) plus its microseconds field
    (``date_part('epoch')`` of the timestamp itself is a double that loses microseconds,
    and ``extract()`` returns numeric only from PostgreSQL 14)."""
    return (
        f"(date_part('epoch', date_trunc('second', {timestamp}))::bigint * 1000000 "
        f"+ date_part('microseconds', {timestamp})::bigint % 1000000)"
    )


# One reading of the server's clock, as _micros takes it.
_CLOCK = "clock_timestamp() AT TIME ZONE 'UTC'"


# How many clock readings the fence step takes at most while it waits for the next
# microsecond: a clock that never moves is broken, and the statement must still end.
_SPIN_LIMIT = 100_000


def fence_select(
    sequence: str, *, granted_rows: str, fence_key: tuple[str, str], carry: str = ""
) -> str:
    """A SELECT of ``(<carry>, fence, waited)``: the fence step for each granted row.

    ``granted_rows`` is the FROM clause of the rows granted (one at most, e.g.
    ``(...) AS attempt WHERE ok``), ``fence_key`` the two SQL expressions of the fence
    key, ``carry`` the columns of ``granted_rows`` to pass on (``"key, "``). Each step is
    a subquery over the one before, evaluated row by row in that order (a subquery with
    volatile functions in its target list is never merged into its parent, and ``OFFSET
    0`` says so again): the transaction-level lock on the fence key (taken only for a
    granted row; it ends with the statement's or the savepoint's transaction), then
    ``nextval`` and one clock reading, then clock readings until one differs from it, at
    most :data:`_SPIN_LIMIT` (``waited``: how many; a reading that went back ends the
    wait too, no wait could mend that). Select ``waited`` in the statement's result: an
    output column is always computed, so the wait always runs.
    """
    a, b = fence_key
    literal = "'" + sequence.replace("'", "''") + "'"
    # generate_series in a target list yields lazily: LIMIT 1 stops at the first
    # reading that differs (in FROM it would make all _SPIN_LIMIT rows first).
    wait = (
        f"(SELECT n FROM (SELECT generate_series(1, {_SPIN_LIMIT}) AS n) AS g "
        f"WHERE {_CLOCK} <> r.at LIMIT 1)"
    )
    return (
        f"SELECT {carry}greatest(r.floor, {_micros('r.at')}) AS fence, {wait} AS waited "
        f"FROM (SELECT {carry}nextval({literal}) AS floor, {_CLOCK} AS at "
        f"FROM (SELECT {carry}pg_advisory_xact_lock({a}::int4, {b}::int4) "
        f"FROM {granted_rows} OFFSET 0) AS locked OFFSET 0) AS r"
    )


#: How long a try (``timeout=0``) waits for the fence step, unless the session has a
#: ``lock_timeout`` of its own: the fence key is held for microseconds, but a migration's
#: ``ALTER SEQUENCE`` holds back ``nextval``.
TRY_FENCE_WAIT_MS = 1000


def lock_timeout_sql(param: str, *, unless_set: bool) -> str:
    """SQL that sets ``lock_timeout`` to ``param`` (milliseconds, text) for the rest of
    the transaction; with ``unless_set``, only if the session has none (``0``)."""
    if unless_set:
        value = (
            f"CASE current_setting('lock_timeout') WHEN '0' THEN {param} "
            "ELSE current_setting('lock_timeout') END"
        )
    else:
        value = param
    return f"set_config('lock_timeout', {value}, true)"


class Statements:
    """The SQL for one server version and configuration, built once.

    Lock acquire statements come in variants: trying once, trying before a wait (which
    also arms ``client_connection_check_interval`` and lifts ``statement_timeout`` and
    ``transaction_timeout`` for the wait), or waiting; exclusive or shared; setting TCP
    keepalives (on a connection's first lease) or not. Each names the session as ours
    (``asynclock:0:<ttl ms>:<identity>``: holder known, fence not yet) before it takes
    the lock, so that ``inspect()`` never sees the grant under a name that is not ours,
    then takes the lock, runs the fence step (:func:`fence_select`) and
    names the session with its fence. Parameters: ``$1`` key, ``$2`` the application_name
    tail (``<ttl ms>:<identity>``), ``$3``/``$4`` the fence key, ``$5`` ``lock_timeout``
    (the wait's; for a try, the bound of its fence step unless the session has a
    ``lock_timeout`` of its own), then ``idle_session_timeout`` (PostgreSQL >= 14), then
    the keepalives (first lease).

    Permit scans (:attr:`scan`) take the first free slot of a semaphore; see
    :meth:`_scan`.
    """

    def __init__(self, sequence: str, version: int) -> None:
        self.has_idle_timeout = version >= 14
        # transaction_timeout (PostgreSQL >= 17) ends a session whose transaction, a single
        # statement's included, lasts longer: a wait in the queue is one. Setting or
        # resetting it is an error on older servers.
        has_transaction_timeout = version >= 17
        self.unbounded = [_UNBOUNDED]
        self.reset = RESET
        if has_transaction_timeout:
            self.unbounded.append("set_config('transaction_timeout', '0', false)")
            self.reset += "; RESET transaction_timeout"
        self.acquire: dict[tuple[bool, str, bool], str] = {}
        for configure in (False, True):
            for mode in (TRY, TRY_BEFORE_WAIT, WAIT):
                for shared in (False, True):
                    self.acquire[configure, mode, shared] = self._acquire(
                        sequence, configure=configure, mode=mode, shared=shared
                    )
        self.scan: dict[tuple[bool, int], str] = {
            (configure, flag): self._scan(sequence, configure=configure, flag=flag)
            for configure in (False, True)
            for flag in (NO_FLAG, TAKE_FLAG, HOLD_FLAG)
        }
        unlock = {False: "pg_advisory_unlock", True: "pg_advisory_unlock_shared"}
        reset_idle = f", set_config('{IDLE}', $2, false)" if self.has_idle_timeout else ""
        self.release = {
            shared: f"SELECT {fn}($1) AS released{reset_idle}" for shared, fn in unlock.items()
        }
        # A permit's session is pinned to it: whatever advisory lock it has (its slot, the
        # waiting flag of an interrupted wait) is the permit's. $1 the slot's key (NULL if
        # an interrupted scan never told us), $2 the waiting flag, $3 the NOTIFY channel.
        # The NOTIFY is sent only if a waiter holds the flag. It makes the statement's
        # transaction write a commit record; nothing in it needs to be durable, so the
        # commit does not wait for the WAL flush (measured: 9 ms -> 1 ms hand-off).
        reset_idle = f", set_config('{IDLE}', $4, false)" if self.has_idle_timeout else ""
        self.release_permit = (
            "WITH quick AS (SELECT set_config('synchronous_commit', 'off', true)), "
            "slot AS (SELECT coalesce(pg_advisory_unlock($1::bigint), false) AS released "
            "FROM quick), "
            "cleared AS (SELECT released, pg_advisory_unlock_all() FROM slot), "
            "told AS (SELECT released, CASE "
            "WHEN NOT (released OR $1::bigint IS NULL) THEN false "
            "WHEN pg_try_advisory_lock($2::bigint) THEN NOT pg_advisory_unlock($2::bigint) "
            "ELSE pg_notify($3, 'released') IS NOT NULL END AS told FROM cleared) "
            f"SELECT released, told{reset_idle} FROM told"
        )
        # A waiter that gives up leaves the waiting flag (its only lock) behind.
        self.unflag = "SELECT pg_advisory_unlock_all()"
        # Any statement resets the server's idle timer; the pid tells whether it ran on
        # the session that holds the lock.
        self.heartbeat = "SELECT pg_backend_pid()"
        new_ttl = "set_config('application_name', $1, false)"
        if self.has_idle_timeout:
            new_ttl += f", set_config('{IDLE}', $2, false)"
        self.heartbeat_new_ttl = f"SELECT pg_backend_pid(), {new_ttl}"
        self.inspect = (
            "SELECT l.pid, a.application_name, a.state, "
            "EXTRACT(EPOCH FROM (clock_timestamp() - a.state_change))::float8 AS idle_for "
            "FROM pg_locks AS l LEFT JOIN pg_stat_activity AS a ON a.pid = l.pid "
            "WHERE l.locktype = 'advisory' AND l.granted AND l.objsubid = 1 "
            "AND l.classid = $1 AND l.objid = $2 "
            "AND l.database = (SELECT oid FROM pg_database WHERE datname = current_database())"
        )
        # aclose(): sessions of ours the server still has (a waiter in the lock queue reads
        # its socket only at its next client check) are ended, and (PostgreSQL >= 14)
        # waited for until they are gone. $1 their pids, $2 how long to wait for each.
        wait = ", $2::bigint" if self.has_idle_timeout else ""
        self.end_sessions = (
            f"SELECT count(*) FILTER (WHERE pg_terminate_backend(pid{wait})) "
            "FROM unnest($1::int[]) AS pid"
        )

    def _granted_row(self, tail: int, first: int, *, configure: bool, extra: str = "") -> str:
        """The select list of a grant (from ``granted``, a :func:`fence_select`): fence,
        the fence step's ``waited`` (selected so that it runs), pid and the session's
        settings. ``$<tail>`` is the application_name tail; the idle timeout and the
        keepalives take the parameters from ``$<first>`` on."""
        n = first
        named = f"'{APP_PREFIX}' || granted.fence || ':' || ${tail}"
        columns = [
            "granted.fence",
            "granted.waited",
            "pg_backend_pid() AS pid",
            f"set_config('application_name', {named}, false)",
        ]
        if self.has_idle_timeout:
            columns.append(f"set_config('{IDLE}', ${n}, false)")
            n += 1
        if configure:
            columns += [
                f"set_config('tcp_keepalives_idle', ${n}, false)",
                f"set_config('tcp_keepalives_interval', ${n + 1}, false)",
            ]
        if extra:
            columns.append(extra)
        return ", ".join(columns)

    def _acquire(self, sequence: str, *, configure: bool, mode: str, shared: bool) -> str:
        # Each step a subquery over the one before (see fence_select): the session named,
        # then the lock, then the fence step, then the session's settings.
        columns = self._granted_row(2, 6, configure=configure)
        kind = "_shared" if shared else ""
        settings = [f"set_config('application_name', '{APP_PREFIX}0:' || $2, false)"]
        if mode == WAIT:
            settings.append(lock_timeout_sql("$5", unless_set=False))
            granted_rows = (
                f"(SELECT pg_advisory_lock{kind}($1) FROM (SELECT {', '.join(settings)} "
                "OFFSET 0) AS named OFFSET 0) AS locked"
            )
        else:
            settings.append(lock_timeout_sql("$5", unless_set=True))
            if mode == TRY_BEFORE_WAIT:
                # The server arms the client-connection check, statement_timeout and
                # transaction_timeout when a statement (or its transaction) starts, from
                # the session's values: set in the waiting statement itself they would
                # come too late (measured: a killed waiter stayed queued). Session scope,
                # set here, before the wait; RESET when the connection goes back.
                settings += self.unbounded
                if self.has_idle_timeout:
                    settings.append(
                        "set_config('client_connection_check_interval', "
                        f"'{_CHECK_INTERVAL_MS}', false)"
                    )
            granted_rows = (
                f"(SELECT pg_try_advisory_lock{kind}($1) AS ok FROM (SELECT "
                f"{', '.join(settings)} OFFSET 0) AS named OFFSET 0) AS attempt WHERE ok"
            )
        fenced = fence_select(sequence, granted_rows=granted_rows, fence_key=("$3", "$4"))
        return f"SELECT {columns} FROM ({fenced}) AS granted"

    def _scan(self, sequence: str, *, configure: bool, flag: int) -> str:
        """Take the first free permit slot, at most one, in a single statement.

        ``$1`` the permit prefix (bytea), ``$2`` the limit, ``$3`` the slot to start at,
        ``$4`` the application_name tail, ``$5``/``$6`` the semaphore's fence key, ``$7``
        ``lock_timeout`` (for the waiting flag when taking it, else the bound of the
        fence step unless the session has its own), then idle timeout and keepalives,
        then (waiting) the waiting flag's key.

        The slots are tried one by one in a recursive CTE: each step runs only if the
        step before did not get its slot (``WHERE NOT s.ok``), so at most one
        ``pg_try_advisory_lock`` returns true; a recursive CTE is evaluated step by
        step, whatever the plan. Keys are computed by the server, as :func:`permit_key`
        does (no array of ``limit`` keys travels with every attempt).
        """
        flag_param = 8 + int(self.has_idle_timeout) + 2 * int(configure)
        extra = ""
        if flag != NO_FLAG:
            # Granted: the waiter is a waiter no more.
            extra = f"pg_advisory_unlock_shared(${flag_param}::bigint)"
        columns = self._granted_row(4, 8, configure=configure, extra=extra)
        key = (
            "('x' || left(encode(sha256($1::bytea || convert_to((({step}) % $2::int)::text, "
            "'UTF8')), 'hex'), 16))::bit(64)::bigint"
        )
        if flag == TAKE_FLAG:
            # Held before the scan: a release after the scan sees the flag and notifies.
            # From here the session waits idle between scans, up to the recheck interval:
            # a role's idle_session_timeout would end it (and the wait), so it is lifted,
            # as statement_timeout is for lock waits. A grant sets it to the lease's ttl
            # (the select list is evaluated after this CTE); RESET when the connection
            # goes back to the pool.
            lift = f", set_config('{IDLE}', '0', false)" if self.has_idle_timeout else ""
            ctes = (
                f"limited AS (SELECT {lock_timeout_sql('$7', unless_set=False)}{lift}), "
                f"flagged AS (SELECT pg_advisory_lock_shared(${flag_param}::bigint) "
                "FROM limited), "
            )
            first_source = "flagged, "
        else:
            ctes = f"limited AS (SELECT {lock_timeout_sql('$7', unless_set=True)}), "
            first_source = "limited, "
        first_key = key.format(step="$3::int")
        next_key = key.format(step="s.step + 1 + $3::int")
        fenced = fence_select(
            sequence, granted_rows="scan WHERE ok", fence_key=("$5", "$6"), carry="key, "
        )
        return (
            f"WITH RECURSIVE {ctes}"
            "scan(step, key, ok) AS ("
            f"SELECT 0, k.key, pg_try_advisory_lock(k.key) FROM {first_source}"
            f"LATERAL (SELECT {first_key} AS key) AS k "
            "UNION ALL "
            "SELECT s.step + 1, k.key, pg_try_advisory_lock(k.key) FROM scan AS s, "
            f"LATERAL (SELECT {next_key} AS key) AS k "
            "WHERE NOT s.ok AND s.step + 1 < $2::int) "
            f"SELECT granted.key, {columns} FROM ({fenced}) AS granted"
        )
