"""A worker's view of whether its router is reachable, and what it does about it
(docs/reliability.md "The router dies").

The worker's report socket to the router sends ZeroMQ heartbeats (PING every
heartbeat_s; no answer within router_timeout_s closes the connection), so a router that
dies -- its process, or its whole host with no reset ever sent -- shows as a closed
connection; a router listening again at that address (restarted, same secret) shows as
a new handshake. From those two facts over time:

    up --closed--> down --router_timeout_s--> lost --rejoin_timeout_s since down--> give up
     ^              |                           |
     +--handshake---+---------------------------+   (back: say hello at once)

- lost: the router that sent this worker its requests is gone (it has also counted this
  worker dead by now, and moved those requests elsewhere): the worker gives them up and
  frees their blocks. Once per outage.
- give up: no router came back within rejoin_timeout_s: the worker exits with
  EXIT_ROUTER_LOST, saying so.

Time is passed in (monotonic seconds), never read here."""
from __future__ import annotations

EXIT_ROUTER_LOST = 3  # the worker's exit code when no router came back (2: a config error or a refusal)
UP, DOWN, LOST = "up", "down", "lost"


class RouterLost(RuntimeError):
    """No router was reachable for rejoin_timeout_s: the worker exits (EXIT_ROUTER_LOST)."""


class RouterLink:
    """Owns the router's reachability as this worker sees it: up, down since when, or
    lost (its requests given up); `observe` turns each look at the connection into at
    most one action."""

    def __init__(self, lost_after_s: float, give_up_after_s: float, now: float) -> None:
        self.lost_after_s = lost_after_s
        self.give_up_after_s = give_up_after_s
        self.state = DOWN  # not connected yet: the first handshake brings it up
        self.down_since = now
        self.handshakes = 0  # successful handshakes seen so far (each a new connection)

    def observe(self, connected: bool, handshakes: int, now: float) -> str | None:
        """One look at the connection: whether it is up now and how many handshakes have
        succeeded on it so far. Returns "back" (a new connection after the first: say
        hello now, a restarted router registers this worker), "lost" (give up what the
        router sent), "give_up" (exit), or None."""
        new = handshakes > self.handshakes
        first = self.handshakes == 0
        self.handshakes = handshakes
        if connected:
            was = self.state
            self.state = UP
            return "back" if new and not first or was == LOST else None
        if self.state == UP:
            self.state, self.down_since = DOWN, now
        down_for = now - self.down_since
        if down_for >= self.give_up_after_s:
            return "give_up"
        if self.state == DOWN and down_for >= self.lost_after_s and not first:
            self.state = LOST
            return "lost"
        return None

    def why(self, address: str, now: float) -> str:
        """The line a worker that gives up logs and exits with."""
        return (f"no router reachable at {address} for {now - self.down_since:.0f} s (--rejoin-timeout "
                f"{self.give_up_after_s:g}): exiting with code {EXIT_ROUTER_LOST}")
